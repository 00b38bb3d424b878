"""``LowBitTrainer``: the transformers ``Trainer`` with the low-bit recipes applied at construction."""

from __future__ import annotations

import json
import os
import shutil

import torch
from transformers import Trainer

from .args import LowBitTrainingArguments
from .distributed import keep_integer_params_unsharded, unsharded_copy
from .export import merge_lora, save_quantized
from .mixed_precision import refresh_weight_caches, set_weight_cache
from .prepare import apply_recipes, log_reports
from .qat import FakeQuantScheduleCallback, QATConfig
from .validation import check_training_setup

DATA_STATE_NAME = "hf_lowbit_data_state.json"
_SHAPE_SAMPLE = 64  # training rows inspected to tell packed (fixed-length) data from ragged data


class LowBitTrainer(Trainer):
    """A ``Trainer`` whose model is prepared by ``hf_lowbit.prepare_model`` when it is constructed.

    ``trainer.model`` already shows the swapped modules; ``trainer.lowbit_reports`` holds what each
    recipe swapped and skipped. ``peft_config`` (a ``peft.LoraConfig`` …) wraps the prepared model
    in a ``PeftModel``.
    """

    def __init__(self, model=None, args: LowBitTrainingArguments | None = None, *pargs, peft_config=None, **kwargs):
        if args is None:
            args = LowBitTrainingArguments(output_dir="trainer_output")
        if not isinstance(args, LowBitTrainingArguments):
            raise TypeError("LowBitTrainer needs args=LowBitTrainingArguments(...) (a subclass of "
                            f"TrainingArguments with the low-bit switches), got {type(args).__name__}")
        if model is None:
            raise ValueError("LowBitTrainer prepares the model when it is constructed: pass model=...; "
                             "model_init is not supported")
        model, self.lowbit_reports = apply_recipes(model, args, peft_config)
        log_reports(self.lowbit_reports)
        self.lowbit_cuda_graphs = _use_cuda_graphs(args)
        if self.lowbit_cuda_graphs and args.torch_compile_mode is None:
            args.torch_compile_mode = "reduce-overhead"  # read by Trainer.__init__ (accelerate's dynamo plugin)
        super().__init__(model, args, *pargs, **kwargs)
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
        cache = args.lowbit_weight_cache
        self.lowbit_weight_cache = bool(args.lowbit_recipes) and not sharded and (
            cache if cache is not None else args.gradient_accumulation_steps > 1)
        self._lowbit_cache_on = False
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
            # before accelerate shards the model in train()
            keep_integer_params_unsharded(self.accelerator.state.fsdp_plugin, self.model, self.args.device)
        if args.qat_scheme is not None:
            self.add_callback(FakeQuantScheduleCallback(args.qat_fake_quant_after_n_steps))

    def save_quantized(self, path: str) -> list[str]:
        """Convert the QAT model and write a checkpoint stock transformers loads (see ``hf_lowbit.export``).

        LoRA adapters are merged first; ``self.model`` becomes the converted model (torchao quantized
        weights), whose ``push_to_hub(repo)`` then uploads exactly the files written here.
        """
        if self.args.qat_scheme is None:
            raise ValueError("LowBitTrainer.save_quantized needs LowBitTrainingArguments(qat_scheme=...): "
                             "the model was not trained with fake quantization")
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
            raise NotImplementedError("LowBitTrainer.save_quantized of a LoRA model in a distributed run: save the "
                                      "adapter (trainer.save_model), then merge and export from one process")
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        files = []
        if self.is_world_process_zero():
            files = save_quantized(unsharded_copy(model, state, self.args), path, config,
                                   tokenizer=self.processing_class)
        self.accelerator.wait_for_everyone()
        return files

    def check_setup(self) -> list[str]:
        """Warn about what in this run keeps the recipes from being fast or stable (see validation)."""
        packed, tokens = _inspect_shapes(self.train_dataset, self.args.per_device_train_batch_size)
        optim = getattr(self.args.optim, "value", self.args.optim)
        return check_training_setup(recipes=self.args.lowbit_recipes, device=self.args.device,
                                    compiled=self.args.torch_compile, packed=packed,
                                    optimizer=str(optim), tokens_per_step=tokens,
                                    grad_accum=self.args.gradient_accumulation_steps)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.check_setup()
        self._seek_data(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints that survive a kill
    def _save_checkpoint(self, model, trial):
        """Write ``checkpoint-N`` under ``.tmp-checkpoint-N/`` and rename it into place once complete: a
        process killed mid-save leaves the previous checkpoint the last one (``get_last_checkpoint`` and
        ``resume_from_checkpoint=True`` see only complete ones). A streaming train dataset's position is
        saved with it (``hf_lowbit_data_state.json``) so resuming continues the stream where it was."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, f".tmp-{name}")
        main = self.args.should_save
        if main:
            shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
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
            if os.path.exists(final):  # the same step saved again (a resumed run)
                shutil.rmtree(final)
            os.rename(staged, final)
            shutil.rmtree(staging, ignore_errors=True)
            best = self.state.best_model_checkpoint
            if best and best.startswith(staging):
                self.state.best_model_checkpoint = run_dir + best[len(staging):]
                self.state.save_to_json(os.path.join(final, "trainer_state.json"))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

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

    def _lowbit_before_forward(self, model, training: bool) -> None:
        """Keep the cached low-bit weights current (a host-side version check per layer; a weight changed
        by anything, not only the optimizer, is requantized here, outside the compiled graph). With CUDA
        graphs and gradient accumulation, allocate ``.grad`` outside the graphs so the backward adds into
        it instead of handing the graph's output buffer to ``.grad`` (which the next replay overwrites)."""
        if self.lowbit_weight_cache:
            if not self._lowbit_cache_on:  # lazily: the model is on its training device by now
                set_weight_cache(self.model, True)
                self._lowbit_cache_on = True
            refresh_weight_caches(self.model)
        if training and self.lowbit_cuda_graphs and self.args.gradient_accumulation_steps > 1:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def training_step(self, model, inputs, *args, **kwargs):
        self._lowbit_before_forward(model, training=True)
        return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        self._lowbit_before_forward(model, training=False)
        return super().prediction_step(model, inputs, *args, **kwargs)


def _use_cuda_graphs(args: LowBitTrainingArguments) -> bool:
    """Whether this run compiles with CUDA graphs (see ``LowBitTrainingArguments.lowbit_cuda_graphs``)."""
    if args.lowbit_cuda_graphs is not None:
        return args.lowbit_cuda_graphs
    low_bit_compute = bool(args.lowbit_recipes)
    # FSDP / DeepSpeed (from the arguments or an accelerate launch config): their hooks and collectives
    # run between the graphs, and the graphs would capture parameters that the wrappers swap
    sharded = bool(args.fsdp) or bool(args.deepspeed) or any(
        os.environ.get(v, "false").lower() in ("1", "true") for v in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    return (low_bit_compute and args.torch_compile and args.torch_compile_mode is None and not sharded
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


__all__ = ["LowBitTrainer"]
