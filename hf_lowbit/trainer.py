"""``LowBitTrainerMixin``: the low-bit behaviour for any transformers ``Trainer`` subclass, and
``LowBitTrainer`` = the mixin + ``Trainer``. (``hf_lowbit.trl`` puts the same mixin on trl's
``SFTTrainer``.)"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import shutil
import warnings

import torch
from transformers import Trainer

from . import atomic
from .args import LowBitArgumentsMixin, LowBitTrainingArguments, sharded_by_launch
from .integrations.causal_mask import (FullAttentionMaskCollator, collator_mode, dispatches_batches, plain_causal_for,
                                       plain_causal_model)
from .integrations.distributed import (check_deepspeed, prepare_integer_params_for_fsdp2, prepare_lowbit_all_gather,
                                       unsharded_copy)
from .integrations.liger import apply_liger
from .integrations.throughput import ThroughputMeter, peak_tflops
from .mixed_precision import FusedGradAccumulation, MixedPrecisionLinear
from .prepare import apply_recipes, log_reports
from .qat import QAT_SCHEMES, FakeQuantScheduleCallback, QATConfig, cuda_capability_problem, merge_lora, save_quantized
from .warnings import LowBitWarning, check_training_setup

logger = logging.getLogger("hf_lowbit")
DATA_STATE_NAME = "hf_lowbit_data_state.json"
_SHAPE_SAMPLE = 64  # training rows inspected to tell packed (fixed-length) data from ragged data
# what an interrupted checkpoint save or rotation leaves in the run directory (removed by the next save)
_STALE_CHECKPOINT = re.compile(r"^\.tmp-checkpoint-\d+(\.old)?$")


class LowBitTrainerMixin:
    """The low-bit behaviour, mixed in before a ``Trainer`` subclass: ``class T(LowBitTrainerMixin, Trainer)``.

    The model is prepared (``hf_lowbit.prepare_model``'s swaps) when the trainer is constructed, before
    the base class sees it, so ``trainer.model`` already shows the swapped modules;
    ``trainer.lowbit_reports`` holds what each recipe swapped and skipped. With ``use_liger_kernel=True``
    Liger's patches are applied at the end of ``__init__`` over the swapped model and reported last
    (``hf_lowbit.integrations.liger``: Liger owns the norms, the SwiGLU activation, RoPE and LM head + loss; the recipes
    the linears). ``peft_config`` (a
    ``peft.LoraConfig`` …) wraps the prepared model in a ``PeftModel``: here, unless the base class takes
    ``peft_config`` itself (trl's trainers), in which case it gets the swapped model and the config with
    ``"all-linear"`` resolved against the quantized bases, and wraps it once, its own way. ``args`` must
    be a ``LowBitArgumentsMixin`` dataclass (``lowbit_args_class`` is the default and the name errors use).
    Training logs gain ``train_tokens_per_second`` and ``train_mfu`` (see ``hf_lowbit.integrations.throughput``).
    """

    lowbit_args_class: type = LowBitTrainingArguments

    def __init__(self, model=None, args=None, *pargs, peft_config=None, **kwargs):
        name, args_name = type(self).__name__, self.lowbit_args_class.__name__
        if args is None:
            args = self.lowbit_args_class(output_dir="trainer_output")
        if not isinstance(args, LowBitArgumentsMixin):
            raise TypeError(f"{name} needs args={args_name}(...) (the low-bit switches of LowBitArgumentsMixin "
                            f"on top of the base class's arguments), got {type(args).__name__}")
        if model is None or isinstance(model, str):
            raise ValueError(f"{name} prepares the model when it is constructed: pass model=<a loaded model>; "
                             "model names and model_init are not supported")
        check_deepspeed(args)  # before the swaps: under ZeRO-3 the weights may already be empty placeholders
        check_qat_device(args, args.device, args_name)
        base_takes_peft = "peft_config" in inspect.signature(super().__init__).parameters
        model, self.lowbit_reports = apply_recipes(model, args, peft_config, attach_peft=not base_takes_peft)
        log_reports(self.lowbit_reports)
        if base_takes_peft:
            kwargs["peft_config"] = peft_config
        self.lowbit_cuda_graphs = _use_cuda_graphs(args, adapters=peft_config is not None)
        if self.lowbit_cuda_graphs and args.torch_compile_mode is None:
            args.torch_compile_mode = "reduce-overhead"  # read by Trainer.__init__ (accelerate's dynamo plugin)
        self.lowbit_throughput = ThroughputMeter()
        super().__init__(model, args, *pargs, **kwargs)
        # the causal mask left to SDPA's is_causal under torch.compile (hf_lowbit.integrations.causal_mask)
        why_not = plain_causal_model(self.model) if args.lowbit_skip_causal_mask else "lowbit_skip_causal_mask=False"
        self.lowbit_skip_causal_mask = why_not is None
        # an all-ones mask dropped under the stock loss, kept with the batch marked under trl's (it counts tokens
        # with attention_mask), left alone under other losses: see _get_dataloader
        self._lowbit_mask_mode = collator_mode(type(self)) if why_not is None else None
        if why_not is not None and args.lowbit_skip_causal_mask and args.torch_compile:
            logger.info("lowbit_skip_causal_mask: the causal mask stays materialized under torch.compile: %s", why_not)
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        cache = args.lowbit_weight_cache
        self.lowbit_weight_cache = bool(args.lowbit_recipes) and not sharded and (
            cache if cache is not None else args.gradient_accumulation_steps > 1)
        self._lowbit_cached_layers: list[MixedPrecisionLinear] | None = None  # found on the first step
        # AdamW in one Triton pass a large parameter, which refreshes a cached weight's cache too (LowBitAdamW, made
        # in create_optimizer). Unset, it resolves off when the launch is sharded (sharded_by_launch, as the fused
        # MLP, whose choice is made before the Trainer exists); the Trainer's own test stands guard: off if unset,
        # refused if asked for
        self.lowbit_fused_adamw = args.resolved_fused_adamw(adapters=peft_config is not None) and not (
            sharded and args.lowbit_fused_adamw is None)
        if self.lowbit_fused_adamw and sharded:
            raise ValueError(f"{args_name}.lowbit_fused_adamw=True: not with FSDP or DeepSpeed, whose sharded "
                             "parameters and optimizers it does not take; leave it unset")
        fused = args.lowbit_fused_grad_accum
        # several processes or devices: DDP / FSDP / DeepSpeed hooks, DataParallel's replicas (several GPUs in one
        # process), SageMaker's and XLA's wrappers take each gradient from autograd. One process launched by torchrun
        # ("distributed", world size 1) is let through: on GPUs accelerate wraps no DDP around a single process (on the
        # CPU it does, and one process's DDP has nothing to reduce: the same parameters as without, measured)
        distributed = sharded or args.world_size > 1 or args.parallel_mode.value not in ("not_parallel", "distributed")
        if fused and distributed:
            raise ValueError(f"{args_name}.lowbit_fused_grad_accum=True: not with DDP, FSDP, DeepSpeed or "
                             "DataParallel (nor XLA or SageMaker), whose hooks take each gradient from autograd; "
                             "leave it unset (off there)")
        # unset: off (docs/benchmarks.md, "Fused gradient accumulation"); the arguments refuse True without a low-bit
        # weight gradient
        self.lowbit_fused_grad_accum = bool(fused)
        if fused and args.gradient_accumulation_steps == 1:
            warnings.warn(f"{args_name}.lowbit_fused_grad_accum=True with gradient_accumulation_steps=1: nothing "
                          "accumulates, and each step zeroes .grad for its matmuls to add into (more memory traffic "
                          "than without); leave it unset", LowBitWarning, stacklevel=2)
        self._lowbit_fused: FusedGradAccumulation | None = None  # made on the first training step
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
            # before accelerate shards the model in train(): quantized bases shardable on torch < 2.13 too
            prepare_integer_params_for_fsdp2(self.accelerator.state.fsdp_plugin, self.model, self.args.device)
        # before accelerate shards the model in train(), and before the optimizer is made (new Parameters)
        prepare_lowbit_all_gather(args, self.model,
                                  self.accelerator.state.fsdp_plugin if self.is_fsdp_enabled else None)
        if args.qat_scheme is not None:
            self.add_callback(FakeQuantScheduleCallback(args.qat_fake_quant_after_n_steps))
        if getattr(args, "use_liger_kernel", False):
            # here, not only in train(): after our swaps and the base class's own setup (trl's SFTTrainer turns
            # Liger's fused cross-entropy off in its __init__), so trainer.model and the reports show the result
            report = apply_liger(self.model, args.liger_kernel_config)
            self.lowbit_reports.append(report)
            log_reports([report])
            if args.torch_compile and args.lowbit_recipes:
                warnings.warn("use_liger_kernel=True with torch_compile=True: measured on an H200 (torch 2.11, "
                              "liger-kernel 0.8.5, 1x2048 tokens, grad accumulation 8), Liger's kernels broke the "
                              "compiled graph 16 times and INT8 ran at 0.85x bf16 instead of 1.07x without Liger "
                              "(docs/benchmarks.md, 'Liger'); the low-bit speedup needs the compiled graph, so "
                              "leave use_liger_kernel off with these recipes", LowBitWarning, stacklevel=2)

    def save_quantized(self, path: str) -> list[str]:
        """Convert the QAT model and write a checkpoint stock transformers loads (see ``hf_lowbit.qat.export``).

        LoRA adapters are merged first; ``self.model`` becomes the converted model (torchao quantized
        weights), whose ``push_to_hub(repo)`` then uploads exactly the files written here.
        """
        if self.args.qat_scheme is None:
            raise ValueError(f"{type(self).__name__}.save_quantized needs {self.lowbit_args_class.__name__}"
                             "(qat_scheme=...): the model was not trained with fake quantization")
        config = QATConfig(scheme=self.args.qat_scheme, group_size=self.args.qat_group_size)
        if self.args.world_size > 1 or self.is_fsdp_enabled:
            return self._save_quantized_gathered(path, config)
        self.model = merge_lora(self.model)
        return save_quantized(self.model, path, config, tokenizer=self.processing_class)

    def _save_quantized_gathered(self, path: str, config: QATConfig) -> list[str]:
        """Distributed (DDP / FSDP2): every rank takes part in gathering the full state dict; rank 0
        loads it into an unsharded copy of the model on the CPU, converts and writes it once."""
        from peft import PeftModel
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, PeftModel):
            raise NotImplementedError(f"{type(self).__name__}.save_quantized of a LoRA model in a distributed run: "
                                      "save the adapter (trainer.save_model), then merge and export from one process")
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        files = []
        if self.is_world_process_zero():
            files = save_quantized(unsharded_copy(model, state, self.args), path, config,
                                   tokenizer=self.processing_class)
        self.accelerator.wait_for_everyone()
        return files

    def check_setup(self) -> list[str]:
        """Warn about what in this run keeps the recipes from being fast or stable (see ``hf_lowbit.warnings``)."""
        packed, tokens = _inspect_shapes(self.train_dataset, self.args.per_device_train_batch_size)
        optim = getattr(self.args.optim, "value", self.args.optim)
        return check_training_setup(recipes=self.args.lowbit_recipes, device=self.args.device,
                                    compiled=self.args.torch_compile, packed=packed,
                                    optimizer=str(optim), tokens_per_step=tokens,
                                    grad_accum=self.args.gradient_accumulation_steps)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.check_setup()
        self._seek_data(resume_from_checkpoint)
        self.lowbit_throughput.reset()
        try:
            with self._nan_inf_filter_on_device():
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:  # the weights' gradients back to autograd: the accumulators become ordinary .grad, freed by zero_grad
            if self._lowbit_fused is not None:
                self._lowbit_fused.close()
                self._lowbit_fused = None

    # ------------------------------------------------------------------ no host sync per micro-batch
    @contextlib.contextmanager
    def _nan_inf_filter_on_device(self):
        """``logging_nan_inf_filter`` (on by default) makes ``Trainer`` test every micro-batch's loss with
        ``torch.isnan(loss) or torch.isinf(loss)``: a host sync per micro-batch, so the CPU cannot run ahead of
        the GPU and the GPU waits while the next micro-batch is prepared and launched (on the H200 at 1x2048
        tokens with accumulation: ~11 ms of idle GPU per ~30 ms micro-batch, CUDA graphs or not;
        docs/benchmarks.md). While ``train`` runs, the loop's ``training_step`` (the whole override chain, so a
        subclass's own ``training_step`` still sees the raw loss) is wrapped to return what the Trainer would add
        to its running loss, chosen on the device, and the flag reads ``False`` only from that return until the
        loop's next call, ``floating_point_ops``, right after its test: callbacks, logger integrations and saved
        arguments see the user's value. The running loss, and so every logged loss, is the stock loop's bit for
        bit. Not under torch_xla, whose loop skips the test anyway."""
        from transformers.utils import is_torch_xla_available

        if not self.args.logging_nan_inf_filter or is_torch_xla_available():
            yield
            return
        step, flops = self.training_step, self.floating_point_ops  # bound: the full override chain

        def training_step(*args, **kwargs):
            loss = step(*args, **kwargs)
            filtered = self._filter_nan_inf(loss)
            if filtered is not loss:  # the loop's own test would only re-read it: skip that one sync
                self.args.logging_nan_inf_filter = False
            return filtered

        def floating_point_ops(*args, **kwargs):
            self.args.logging_nan_inf_filter = True
            return flops(*args, **kwargs)

        self.training_step, self.floating_point_ops = training_step, floating_point_ops
        try:
            yield
        finally:
            del self.training_step, self.floating_point_ops  # the class's methods again
            self.args.logging_nan_inf_filter = True

    def _filter_nan_inf(self, loss: torch.Tensor) -> torch.Tensor:
        """What ``Trainer`` adds to its running loss for ``loss``: the loss, or where it is NaN/inf the mean of
        the losses added since the last log (its ``logging_nan_inf_filter`` branch), chosen on the device. ``loss``
        itself where that cannot be done here (a transformers whose loop keeps its running loss elsewhere, a loss on
        another device): the Trainer then tests it, or raises, as usual."""
        running = getattr(self, "_tr_loss", None)
        if (not isinstance(loss, torch.Tensor) or not isinstance(running, torch.Tensor)
                or not hasattr(self, "_globalstep_last_logged") or loss.device != running.device):
            return loss
        mean = running / (1 + self.state.global_step - self._globalstep_last_logged)
        return torch.where(torch.isfinite(loss), loss, mean)  # float32 like the running loss, as the Trainer adds

    # ------------------------------------------------------------------ saves that survive a kill
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``, written to ``<output_dir>/.tmp-model`` and moved in with the config last
        (:func:`hf_lowbit.atomic.publish_files`): killed at any moment, ``output_dir`` holds the previous model,
        the new one, or no ``config.json`` (no model) beside the ``.tmp-model`` that the next save removes.
        Checkpoints (``_internal_call`` into their directory) are staged whole by ``_save_checkpoint``;
        ``push_to_hub``'s own save (``_internal_call``, no directory) is staged here. Under FSDP or DeepSpeed every
        process writes its part, so every process must call it, as for the Trainer's own."""
        if _internal_call and output_dir is not None:
            return super().save_model(output_dir, _internal_call=True)
        target = output_dir if output_dir is not None else self.args.output_dir
        staging = os.path.join(target, atomic.MODEL_STAGING)
        collective = self.is_fsdp_enabled or self.is_deepspeed_enabled  # all ranks write (sharded states)
        if self.args.should_save:
            atomic.clear(staging)  # left by a save killed before it finished
            os.makedirs(target, exist_ok=True)
        if collective:
            self.accelerator.wait_for_everyone()
        super().save_model(staging, _internal_call=True)  # no push yet: the files are not in place
        if collective:
            self.accelerator.wait_for_everyone()
        if self.args.should_save and os.path.isdir(staging):
            atomic.publish_files(staging, target)
        if collective:
            self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial):
        """Write ``checkpoint-N`` under ``.tmp-checkpoint-N/`` and swap it into place once complete: a
        process killed mid-save leaves the previous checkpoint the last one (``get_last_checkpoint`` and
        ``resume_from_checkpoint=True`` see only complete ones), and the next checkpoint save removes what it
        left. Checkpoints over ``save_total_limit`` are renamed away before they are deleted, so none is ever
        half deleted. A streaming train dataset's position is saved with it (``hf_lowbit_data_state.json``)
        so resuming continues the stream where it was."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, atomic.TMP + name)
        main = self.args.should_save
        if main and os.path.isdir(run_dir):  # what killed saves left: staged and parked checkpoints
            atomic.clear(*(os.path.join(run_dir, d) for d in os.listdir(run_dir) if _STALE_CHECKPOINT.match(d)))
        self.accelerator.wait_for_everyone()
        self._get_output_dir = lambda trial=None: staging  # every rank writes its part into the staging dir
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        staged, final = os.path.join(staging, name), os.path.join(run_dir, name)
        if main and hasattr(self.train_dataset, "position"):
            consumed = (self.state.global_step * self.args.per_device_train_batch_size
                        * self.args.gradient_accumulation_steps * self.args.world_size)
            with open(os.path.join(staged, DATA_STATE_NAME), "w") as f:
                json.dump(self.train_dataset.position(consumed), f)
        self.accelerator.wait_for_everyone()
        if main:
            best = self.state.best_model_checkpoint
            if best and best.startswith(staging):
                self.state.best_model_checkpoint = run_dir + best[len(staging):]
                self.state.save_to_json(os.path.join(staged, "trainer_state.json"))
            atomic.replace_dir(staged, final)  # the same step saved again (a resumed run) is swapped out whole
            shutil.rmtree(staging, ignore_errors=True)
            self._rotate_checkpoints_atomically(run_dir)
        self.accelerator.wait_for_everyone()

    def _rotate_checkpoints_atomically(self, run_dir: str) -> None:
        """``save_total_limit``: delete the oldest checkpoints (by modification time: a resumed run's new ones
        count as newest) but the newest and the best, each renamed to ``.tmp-checkpoint-N.old`` first."""
        from transformers.trainer_utils import sort_checkpoints

        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        found = [os.path.normpath(c) for c in sort_checkpoints(run_dir, use_mtime=True)]
        best = self.state.best_model_checkpoint
        keep = {found[-1]} | ({os.path.normpath(best)} if best else set())
        doomed = [c for c in found if c not in keep][:max(0, len(found) - max(limit, len(keep)))]
        for path in doomed:
            parked = atomic.staging_dir(path) + ".old"
            atomic.clear(parked)
            os.rename(path, parked)
            shutil.rmtree(parked)

    def _seek_data(self, resume_from_checkpoint) -> None:
        """Put a streaming train dataset where the checkpoint left it; the Trainer then skips no batches."""
        if not resume_from_checkpoint or not hasattr(self.train_dataset, "seek"):
            return
        path = resume_from_checkpoint
        if isinstance(path, bool) or path == "True":
            from transformers.trainer_utils import get_last_checkpoint

            path = get_last_checkpoint(self.args.output_dir)
        state_file = os.path.join(path, DATA_STATE_NAME) if path else None
        if state_file and os.path.exists(state_file):
            with open(state_file) as f:
                self.train_dataset.seek(json.load(f))
            self.args.ignore_data_skip = True

    def create_optimizer(self, *args, **kwargs):
        """The Trainer's optimizer; with ``lowbit_fused_adamw`` the ``torch.optim.AdamW`` it makes becomes
        :class:`~hf_lowbit.mixed_precision.LowBitAdamW` with the same groups and options (one passed in with
        ``optimizers=`` is left as it is)."""
        given = self.optimizer is not None  # passed in by the user (optimizers=(...)): left as it is
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.lowbit_fused_adamw and not given and type(optimizer) is torch.optim.AdamW:
            from .mixed_precision import LowBitAdamW

            optimizer = self.optimizer = LowBitAdamW.from_optimizer(optimizer)
        return optimizer

    def _lowbit_before_forward(self, model, training: bool) -> None:
        """Keep the cached low-bit weights current (a host-side version check per layer; a weight changed
        by anything, not only the optimizer, is requantized here, outside the compiled graph). With CUDA
        graphs and gradient accumulation, allocate ``.grad`` outside the graphs so the backward adds into
        it instead of handing the graph's output buffer to ``.grad`` (which the next replay overwrites); with
        ``lowbit_fused_grad_accum`` the low-bit weights' ``.grad`` are their matmuls' accumulators
        (:class:`~hf_lowbit.mixed_precision.FusedGradAccumulation`)."""
        if self.lowbit_weight_cache:
            if self._lowbit_cached_layers is None:  # lazily: the model is on its training device by now
                self._lowbit_cached_layers = [m for m in self.model.modules() if isinstance(m, MixedPrecisionLinear)]
                for m in self._lowbit_cached_layers:
                    m.set_weight_cache(True)
            for m in self._lowbit_cached_layers:  # per micro-batch: no walk over the whole model
                m.refresh_weight_cache()
        if training and self.lowbit_fused_grad_accum:
            if self._lowbit_fused is None:  # lazily: the model is on its training device by now (closed after train())
                self._lowbit_fused = FusedGradAccumulation(self.model)
                if not self._lowbit_fused.layers:
                    warnings.warn("lowbit_fused_grad_accum=True: no layer here has a trainable low-bit weight "
                                  "gradient (LoRA trains its adapters in bf16 over frozen bases), so nothing is fused",
                                  LowBitWarning, stacklevel=2)
            self._lowbit_fused.prepare()
        if training and self.lowbit_cuda_graphs and self.args.gradient_accumulation_steps > 1:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _get_dataloader(self, dataset, *args, **kwargs):
        """The ``Trainer``'s data loaders with :class:`FullAttentionMaskCollator` over the collator, for
        ``lowbit_skip_causal_mask``: in them only, so ``self.data_collator`` stays the user's (trl checks its type)."""
        collator, mode = self.data_collator, getattr(self, "_lowbit_mask_mode", None)
        if mode is not None and collator is not None:
            if dispatches_batches(self.accelerator, dataset):
                logger.info("lowbit_skip_causal_mask: accelerate dispatches this data loader's batches across "
                            "processes, so padding masks are left as they are (batches with no mask still skip it)")
            else:
                self.data_collator = FullAttentionMaskCollator(collator, drop=mode == "drop")
        try:
            return super()._get_dataloader(dataset, *args, **kwargs)
        finally:
            self.data_collator = collator

    def training_step(self, model, inputs, *args, **kwargs):
        self._lowbit_before_forward(model, training=True)
        if "input_ids" in inputs:
            self.lowbit_throughput.count(inputs["input_ids"])
        with plain_causal_for(inputs, self.lowbit_skip_causal_mask):
            return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        self._lowbit_before_forward(model, training=False)
        with plain_causal_for(inputs, self.lowbit_skip_causal_mask):
            return super().prediction_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add ``train_tokens_per_second`` (all processes) and ``train_mfu`` (with a known peak: the GPU's
        name in ``hf_lowbit.integrations.throughput.PEAK_BF16_TFLOPS`` or ``lowbit_peak_tflops``) to training-step logs.
        Per-process token counts are summed by one all-reduce here, at log time, never per step.
        (With ``include_num_input_tokens_seen``, ``Trainer.log`` overwrites the first with its session average.)"""
        if "loss" in logs:
            peak = self.args.lowbit_peak_tflops or peak_tflops(self.args.device)
            logs.update(self.lowbit_throughput.read(self.model, peak, self.accelerator.num_processes, self._sum_counts))
        return super().log(logs, *args, **kwargs)

    def _sum_counts(self, counts: list[int]) -> list[int]:
        total = self.accelerator.reduce(torch.tensor(counts, device=self.args.device), reduction="sum")
        return [int(v) for v in total.tolist()]


class LowBitTrainer(LowBitTrainerMixin, Trainer):
    """A ``Trainer`` whose model is prepared by ``hf_lowbit.prepare_model`` when it is constructed
    (everything is ``LowBitTrainerMixin``'s; ``args`` are ``LowBitTrainingArguments``)."""


def check_qat_device(args: LowBitArgumentsMixin, device: torch.device, args_name: str) -> None:
    """Refuse, in one line, a QAT scheme whose converted kernels the training GPU lacks (FP8 below sm_89).

    Fake quantization itself runs anywhere (CPU training is fine); a CUDA device that cannot run what the
    export serves with is almost always the GPU it will be served on, so the run is stopped before it
    trains for a checkpoint this GPU cannot use (nor convert: torchao's FP8 convert needs sm_89 too).
    """
    if args.qat_scheme is None:
        return
    if torch.device(device).type != "cuda":
        problem = cuda_capability_problem(args.qat_scheme)
        if problem:  # training here is fine; the export is not
            warnings.warn(f"qat_scheme={args.qat_scheme!r} trains here with fake quantization, but save_quantized "
                          f"cannot convert in this process: {problem}; keep the trained model (save_model) and export "
                          "it where that GPU is (docs/qat.md, 'Where they convert')", LowBitWarning, stacklevel=3)
        return
    problem = cuda_capability_problem(args.qat_scheme, device)
    if problem is None:
        return
    have = torch.cuda.get_device_capability(device)
    gpu = [n for n, s in QAT_SCHEMES.items() if s.min_capability is not None and s.min_capability <= have]
    cpu = [n for n, s in QAT_SCHEMES.items() if s.min_capability is None]
    alternative = (f"qat_scheme={gpu[0]!r} to serve on this GPU, or " if gpu else "") + \
        " / ".join(repr(n) for n in cpu) + " for ExecuTorch/CPU"
    raise ValueError(f"{args_name}.qat_scheme={args.qat_scheme!r}: {problem}; use {alternative}")


def _use_cuda_graphs(args: LowBitArgumentsMixin, adapters: bool = False) -> bool:
    """Whether this run compiles with CUDA graphs (see ``LowBitArgumentsMixin.lowbit_cuda_graphs``).

    Automatically wherever INT8/FP8 compute runs, full fine-tuning and LoRA / QLoRA alike (``adapters``): at
    1-2k-token micro-batches both steps wait on kernel launches (measured on the H200: docs/benchmarks.md
    "Regimes" and "QLoRA regimes"); a QLoRA base computing in bf16 is not low-bit compute and keeps it off."""
    if args.lowbit_cuda_graphs is not None:
        return args.lowbit_cuda_graphs
    low_bit_compute = bool(args.lowbit_recipes)
    # FSDP / DeepSpeed (from the arguments or an accelerate launch config): their hooks and collectives
    # run between the graphs, and the graphs would capture parameters that the wrappers swap
    return (low_bit_compute and args.torch_compile and args.torch_compile_mode is None and not sharded_by_launch(args)
            and args.device.type == "cuda")


def _inspect_shapes(dataset, batch_size: int) -> tuple[bool | None, int | None]:
    """(all sampled sequences one length?, tokens per micro-batch) of a map-style dataset."""
    if not hasattr(dataset, "__getitem__"):  # None, or an iterable dataset
        return None, None
    try:
        n = min(len(dataset), _SHAPE_SAMPLE)
        lengths = {len(dataset[i]["input_ids"]) for i in range(n)}
    except (TypeError, KeyError, IndexError):
        return None, None
    if not lengths:
        return None, None
    if len(lengths) > 1:
        return False, None
    return True, lengths.pop() * batch_size


__all__ = ["LowBitTrainer", "LowBitTrainerMixin"]
