"""``LowBitTrainingArguments``: ``TrainingArguments`` plus the low-bit recipe switches.

The switches live in one dataclass mixin, ``LowBitArgumentsMixin``, shared by every arguments class
that carries them (``LowBitTrainingArguments`` here, ``hf_lowbit.trl.LowBitSFTConfig`` over
``trl.SFTConfig``). Every field carries ``help`` metadata, so ``HfArgumentParser`` turns it into a CLI
flag, and is validated in ``__post_init__`` with an error that names it.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .qat import PER_CHANNEL, QAT_SCHEMES

# mixed-precision recipe field -> its number format (a record in hf_lowbit.kernels.formats), in the order applied
MIXED_PRECISION_RECIPES = {"int8_mixed_precision": "int8", "fp8_mixed_precision": "fp8",
                           "fp8_tensorwise_mixed_precision": "fp8_tensorwise"}
# how to keep Liger's other kernels but not its fused LM head + loss (hf_lowbit.integrations.liger), in errors
FLCE_OFF = "liger_kernel_config={'fused_linear_cross_entropy': False}"


def liger_requested(args, kernel: str) -> bool:
    """Whether ``args`` ask Liger for ``kernel`` (a ``liger_kernel_config`` key: each is on by default in Liger's
    Llama-family patches)."""
    if not getattr(args, "use_liger_kernel", False):
        return False
    return bool((getattr(args, "liger_kernel_config", None) or {}).get(kernel, True))


def fused_cross_entropy_requested(args) -> bool:
    """Whether ``args`` ask Liger for its fused linear cross-entropy (the default of Liger's Llama-family patches)."""
    return liger_requested(args, "fused_linear_cross_entropy")


def sharded_by_launch(args) -> bool:
    """FSDP or DeepSpeed, from the arguments or an accelerate launch config (known before the Trainer exists)."""
    return bool(args.fsdp) or bool(args.deepspeed) or any(
        os.environ.get(v, "false").lower() in ("1", "true")
        for v in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))


@dataclass
class LowBitArgumentsMixin:
    """The low-bit fields and their validation, mixed in before a ``TrainingArguments`` subclass.

    Every field has a default, so dataclass ordering holds whatever the other base declares; the combined
    class must itself be a ``@dataclass`` (its generated ``__init__`` takes both sets of fields).

    One base default differs: where ``accelerator_config`` says nothing about ``non_blocking`` (unset, or a dict
    without the key) and batches are pinned (``dataloader_pin_memory``, on by default) for a CUDA device,
    ``accelerator_config.non_blocking`` becomes ``True``. Each batch's host-to-device copy is then queued behind
    the GPU's work instead of making the host wait for it (transformers 5 copies a step's gradient-accumulation
    batches at its start, one blocking copy each by default). ``accelerator_config={"non_blocking": False}``
    turns it off; an ``AcceleratorConfig`` or a JSON file is used as given.
    """

    int8_mixed_precision: bool = field(default=False, metadata={"help": (
        "Run the forward and backward matmuls of the model's nn.Linear layers in INT8 with dynamic "
        "row-wise scaling; weights, optimizer state and everything else keep their precision.")})
    fp8_mixed_precision: bool = field(default=False, metadata={"help": (
        "Like int8_mixed_precision, with float8 e4m3 operands and row-wise scales (Hopper FP8 tensor cores "
        "through torch._scaled_mm). Linears whose features are not multiples of 16 are skipped and reported.")})
    fp8_tensorwise_mixed_precision: bool = field(default=False, metadata={"help": (
        "fp8_mixed_precision with one scale per tensor, not per row: no per-column quantization, cuBLAS's plain FP8 "
        "GEMM; one outlier sets the whole tensor's scale (docs/usage.md).")})
    lowbit_output: bool = field(default=True, metadata={"help": (
        "Low-bit (INT8/FP8) forward matmul Y = X·Wᵀ (X per token, W per output channel). --no_lowbit_output runs it "
        "in the compute dtype.")})
    lowbit_grad_input: bool = field(default=True, metadata={"help": (
        "Low-bit input-gradient matmul dX = dY·W (dY per token with W's row scales folded in, W's forward codes).")})
    lowbit_grad_weight: bool = field(default=True, metadata={"help": (
        "Low-bit weight-gradient matmul dW = dYᵀ·X (both per feature, across tokens).")})
    lowbit_exclude_modules: list[str] = field(default_factory=lambda: ["lm_head"], metadata={"help": (
        "Module names or glob patterns that keep full-precision matmuls; 'lm_head' also matches "
        "'model.lm_head'. The model's output embedding is always excluded (unless lowbit_include_lm_head).")})
    lowbit_include_lm_head: bool = field(default=False, metadata={"help": (
        "INT8/FP8 mixed precision: also run the LM head's three matmuls (logits, their input and weight gradients) in "
        "the recipe's format, whatever lowbit_exclude_modules says of it. Held-out loss vs bf16: FP8 1.0015x, INT8 "
        "1.319x (warned).")})
    lowbit_min_features: int = field(default=64, metadata={"help": (
        "Skip (and report) linears whose in_features or out_features is below this: such matmuls are "
        "too small for low-bit kernels to pay. Mixed precision and QLoRA bases; not QAT, whose export "
        "quantizes every linear it fake-quantized, whatever its size.")})
    lowbit_weight_cache: bool | None = field(default=None, metadata={"help": (
        "Quantize each weight once per optimizer step (its low-bit codes in both layouts, +2 bytes per weight "
        "element) and reuse it for every gradient-accumulation micro-batch, instead of twice per micro-batch. "
        "Recomputed whenever the weight changes. Default (unset): on when gradient_accumulation_steps > 1 and the "
        "model is not sharded (FSDP, DeepSpeed).")})
    lowbit_fused_grad_accum: bool | None = field(default=None, metadata={"help": (
        "Gradient accumulation: add low-bit weight gradients into .grad in their matmul, not by a separate add; one "
        "process only. Unset: off (not yet faster on the H200; docs/usage.md).")})
    lowbit_fused_adamw: bool | None = field(default=None, metadata={"help": (
        "AdamW in one Triton pass a parameter of >= 2**20 elements (LowBitAdamW), refreshing the weight cache "
        "too. Unset: on for INT8/FP8 full fine-tuning on CUDA (docs/usage.md).")})
    lowbit_stochastic_rounding: bool = field(default=False, metadata={"help": (
        "INT8 mixed precision: round the backward's operands stochastically (the output gradient in both "
        "gradient matmuls, the input in the weight gradient) instead of to nearest, so their rounding is "
        "unbiased; the forward still rounds to nearest. The random numbers are drawn inside the quantization kernels "
        "(no random tensor). On the H200 it cost speed (INT8 0.65x bf16 instead of 0.99x, all three matmuls) and "
        "did not improve the loss (docs/benchmarks.md, 'The seed table').")})
    lowbit_dual_grad_quant: bool | None = field(default=None, metadata={"help": (
        "INT8/FP8: dY quantized for dX and dW by one op, same bits; slower on the H200 (docs/usage.md). Unset: off.")})
    lowbit_fused_swiglu: bool | None = field(default=None, metadata={"help": (
        "INT8/FP8: Llama-style MLPs as one function, the SwiGLU one Triton kernel each way. Unset: on for "
        "full fine-tuning on CUDA (docs/usage.md).")})
    lowbit_save_x_codes: bool | None = field(default=None, metadata={"help": (
        "INT8/FP8: linears keep their input's weight-gradient codes (1 byte, same bits), not the input; eager "
        "only (compiled, the partitioner already decides; docs/usage.md). Unset: off.")})
    lowbit_cuda_graphs: bool | None = field(default=None, metadata={"help": (
        "Compile with CUDA graphs (torch_compile_mode='reduce-overhead'): at 1-2k-token micro-batches the "
        "low-bit step is otherwise bound by kernel launches. Default (unset): on for INT8/FP8 compute (full "
        "fine-tuning, LoRA and QLoRA) with torch_compile=True, no torch_compile_mode given, on a CUDA device, "
        "without FSDP or DeepSpeed.")})
    lowbit_skip_causal_mask: bool = field(default=True, metadata={"help": (
        "Leave a plain causal mask to SDPA (is_causal) and skip a host sync (docs/usage.md).")})
    qat_scheme: str | None = field(default=None, metadata={"help": (
        "Quantization-aware training: fake-quantize the linears during training, then convert with "
        f"LowBitTrainer.save_quantized. One of {', '.join(QAT_SCHEMES)}: 8da4w / int4_weight_only export for "
        "ExecuTorch/CPU, int4_tinygemm (sm_80+) / fp8_rowwise (sm_89+) for NVIDIA GPUs (docs/qat.md). Default: off.")})
    qat_group_size: int = field(default=256, metadata={"help": (
        "QAT weight group size along in_features (int4_tinygemm: 32-256); linears whose in_features is not a "
        "multiple of it are skipped and reported. -1: per channel, one scale per weight row, every linear "
        "(8da4w, int4_weight_only; torchao's PerAxis(0)). fp8_rowwise is per row and ignores it.")})
    qat_fake_quant_after_n_steps: int = field(default=0, metadata={"help": (
        "QAT: train the first N optimizer steps without fake quantization, then with it (follows "
        "global_step, so resuming from a checkpoint is correct). 0: from the first step.")})
    qat_include_lm_head: bool = field(default=False, metadata={"help": (
        "QAT: also fake-quantize (and convert) the output embedding (LM head); input embeddings always "
        "stay unquantized.")})
    lora_base_quant: str | None = field(default=None, metadata={"help": (
        "QLoRA: store each frozen base linear as 'nf4' (4-bit NormalFloat, 64-element blocks) or 'int8' "
        "(per output channel) in its own module, with LoRA (needs peft_config) on top. With "
        "int8_mixed_precision its forward and input-gradient matmuls run in INT8.")})
    lora_base_int8_cache: bool = field(default=False, metadata={"help": (
        "With lora_base_quant='nf4' and int8_mixed_precision: keep an INT8 copy of each NF4 base, computed once "
        "(+1 byte per base parameter; saves a dequantize+quantize of every base weight per matmul).")})
    lowbit_fsdp_lowbit_all_gather: bool = field(default=False, metadata={"help": (
        "FSDP2 with int8_mixed_precision or fp8_mixed_precision: all-gather each low-bit linear's weight already "
        "quantized (INT8/FP8 codes + float32 row scales, ~1 byte per weight instead of bf16's 2) and compute with "
        "the gathered codes instead of re-quantizing the gathered weight; the sharded weights stay high precision "
        "for the optimizer and receive the usual reduce-scattered gradients. Bit-identical to the default gather "
        "(tested on CPU); its speed is not yet measured on GPUs. Not with torch_compile (docs/distributed.md).")})
    lowbit_peak_tflops: float | None = field(default=None, metadata={"help": (
        "The accelerator's dense bf16 peak in TFLOP/s, for the train_mfu log entry. Default (unset): looked up "
        "from the GPU's name (H100/H200 989, A100 312, ...); unknown GPUs and CPUs log no MFU.")})

    def __post_init__(self):
        said = self.accelerator_config
        if isinstance(said, str) and said.startswith("{"):  # a dict given as JSON on the command line
            said = json.loads(said)
        unsaid = said is None or (isinstance(said, dict) and "non_blocking" not in said)
        super().__post_init__()  # accelerator_config -> AcceleratorConfig; use_cpu -> dataloader_pin_memory=False
        self._validate_lowbit()
        # CUDA only: on the CPU no batch is copied, so the arguments stay the stock ones (hf_lowbit.cli.sft unpins there
        # after construction, which would leave non_blocking on unpinned memory); other accelerators are unmeasured
        if unsaid and self.dataloader_pin_memory and self.device.type == "cuda":
            self.accelerator_config.non_blocking = True  # read by Trainer.create_accelerator_and_postprocess

    def _validate_lowbit(self) -> None:
        """Check the low-bit fields on their own and against each other; each error names its field."""
        cls = type(self).__name__
        for name in (*MIXED_PRECISION_RECIPES, "lowbit_output", "lowbit_grad_input",
                     "lowbit_grad_weight", "lora_base_int8_cache", "lowbit_fsdp_lowbit_all_gather",
                     "lowbit_include_lm_head"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{cls}.{name} must be True or False, got {value!r}")
        if not isinstance(self.lowbit_stochastic_rounding, bool):
            raise TypeError(f"{cls}.lowbit_stochastic_rounding must be True or False, "
                            f"got {self.lowbit_stochastic_rounding!r}")
        if self.lowbit_stochastic_rounding and not self.int8_mixed_precision:
            raise ValueError(f"{cls}.lowbit_stochastic_rounding=True needs int8_mixed_precision=True "
                             "(it is implemented for INT8 operands only)")
        for name in ("lowbit_weight_cache", "lowbit_cuda_graphs", "lowbit_dual_grad_quant", "lowbit_save_x_codes",
                     "lowbit_fused_grad_accum", "lowbit_fused_adamw", "lowbit_fused_swiglu"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{cls}.{name} must be True, False or None (automatic), got {value!r}")
        if self.lowbit_fused_grad_accum and not (self.lowbit_recipes and self.lowbit_grad_weight):
            raise ValueError(f"{cls}.lowbit_fused_grad_accum=True adds the low-bit weight-gradient matmul's product "
                             "into .grad: it needs int8_mixed_precision or fp8_mixed_precision (or "
                             "fp8_tensorwise_mixed_precision) with lowbit_grad_weight=True")
        if self.lowbit_fused_adamw:
            optim = getattr(self.optim, "value", self.optim)
            if optim not in ("adamw_torch", "adamw_torch_fused"):
                raise ValueError(f"{cls}.lowbit_fused_adamw=True replaces torch's AdamW: optim must be 'adamw_torch' "
                                 f"or 'adamw_torch_fused', got {optim!r}")
        if self.lowbit_weight_cache and not self.lowbit_recipes:
            raise ValueError(f"{cls}.lowbit_weight_cache=True caches the INT8/FP8 form of trainable "
                             "weights: it needs int8_mixed_precision or fp8_mixed_precision "
                             "(or fp8_tensorwise_mixed_precision)")
        # how INT8/FP8 linears quantize their backward's operands: (flag, what it does, the matmuls it needs)
        for name, what, needs in (
                ("lowbit_dual_grad_quant", "quantizes the output gradient for both gradient matmuls at once",
                 ("lowbit_grad_input", "lowbit_grad_weight")),
                ("lowbit_save_x_codes", "keeps the weight gradient's codes of each input", ("lowbit_grad_weight",)),
                ("lowbit_fused_swiglu", "computes each Llama-style MLP as one function",
                 ("lowbit_output", "lowbit_grad_input", "lowbit_grad_weight"))):
            if not getattr(self, name):
                continue
            flag = f"{cls}.{name}=True"
            if not self.lowbit_recipes:
                raise ValueError(f"{flag} {what} of INT8/FP8 linears: it needs int8_mixed_precision or "
                                 "fp8_mixed_precision (or fp8_tensorwise_mixed_precision)")
            if self.lowbit_stochastic_rounding:
                raise ValueError(f"{flag} with lowbit_stochastic_rounding=True: it rounds to nearest only; switch one "
                                 "off")
            if not all(getattr(self, n) for n in needs):
                raise ValueError(f"{flag} {what}: it needs {' and '.join(needs)} True")
        if self.lowbit_fused_swiglu and self.fp8_tensorwise_mixed_precision:
            raise ValueError(f"{cls}.lowbit_fused_swiglu=True quantizes the SwiGLU per row: it needs "
                             "int8_mixed_precision or fp8_mixed_precision, not fp8_tensorwise_mixed_precision")
        if self.lowbit_fused_swiglu and liger_requested(self, "swiglu"):
            raise ValueError(f"{cls}.lowbit_fused_swiglu=True with use_liger_kernel=True: Liger's SwiGLU patch would "
                             "replace the fused MLP's forward; pass liger_kernel_config={'swiglu': False} (Liger's "
                             "other kernels still apply) or lowbit_fused_swiglu=False")
        if self.lowbit_include_lm_head:
            flag = f"{cls}.lowbit_include_lm_head=True"
            if not self.lowbit_recipes:
                raise ValueError(f"{flag} swaps the LM head for INT8/FP8 matmuls: it needs int8_mixed_precision or "
                                 "fp8_mixed_precision (or fp8_tensorwise_mixed_precision)")
            if fused_cross_entropy_requested(self):
                raise ValueError(f"{flag} with use_liger_kernel=True: Liger's fused linear cross-entropy multiplies "
                                 "by lm_head.weight directly, bypassing the LM head's low-bit matmuls; pass "
                                 f"{FLCE_OFF} (Liger's other kernels still apply) or lowbit_include_lm_head=False")
            if self.int8_mixed_precision:
                warnings.warn(f"{flag} with int8_mixed_precision: an INT8 LM head did not keep loss parity (+31.9% "
                              "held-out loss vs bf16 over 1,500 steps of a 143M Llama, "
                              "docs/results/quality_parity_head_h200.md); FP8's head did (+0.15%). Use "
                              "fp8_mixed_precision or lowbit_include_lm_head=False", UserWarning, stacklevel=3)
        if self.lowbit_cuda_graphs and self.torch_compile_mode not in (None, "reduce-overhead"):
            raise ValueError(f"{cls}.lowbit_cuda_graphs=True with torch_compile_mode="
                             f"{self.torch_compile_mode!r}: CUDA graphs are torch_compile_mode='reduce-overhead'; "
                             "leave one of them unset")
        if isinstance(self.lowbit_exclude_modules, str):
            self.lowbit_exclude_modules = [self.lowbit_exclude_modules]
        bad = [p for p in self.lowbit_exclude_modules if not isinstance(p, str) or not p.strip()]
        if bad:
            raise ValueError(f"{cls}.lowbit_exclude_modules must be non-empty module names "
                             f"or glob patterns, got {bad!r}")
        if isinstance(self.lowbit_min_features, bool) or not isinstance(self.lowbit_min_features, int) \
                or self.lowbit_min_features < 1:
            raise ValueError(f"{cls}.lowbit_min_features must be an integer >= 1, "
                             f"got {self.lowbit_min_features!r}")
        if self.qat_scheme is not None and self.qat_scheme not in QAT_SCHEMES:
            raise ValueError(f"{cls}.qat_scheme={self.qat_scheme!r} is not a QAT scheme; "
                             f"valid schemes: {', '.join(QAT_SCHEMES)} (or None for no QAT)")
        for name, low, also in (("qat_group_size", 2, PER_CHANNEL), ("qat_fake_quant_after_n_steps", 0, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (value < low and value != also):
                raise ValueError(f"{cls}.{name} must be an integer >= {low}"
                                 f"{'' if also is None else f', or {also} for per channel'}, got {value!r}")
        if self.qat_scheme is not None:
            problem = QAT_SCHEMES[self.qat_scheme].group_size_problem(self.qat_group_size)
            if problem:
                per_channel = " (per channel)" if self.qat_group_size == PER_CHANNEL else ""
                raise ValueError(f"{cls}.qat_group_size={self.qat_group_size}{per_channel} with "
                                 f"qat_scheme={self.qat_scheme!r}: {problem}")
        if not isinstance(self.lowbit_skip_causal_mask, bool):
            raise TypeError(f"{cls}.lowbit_skip_causal_mask must be True or False, "
                            f"got {self.lowbit_skip_causal_mask!r}")
        if not isinstance(self.qat_include_lm_head, bool):
            raise TypeError(f"{cls}.qat_include_lm_head must be True or False, "
                            f"got {self.qat_include_lm_head!r}")
        if self.qat_scheme is not None and self.qat_include_lm_head and fused_cross_entropy_requested(self):
            raise ValueError(f"{cls}.qat_include_lm_head=True with use_liger_kernel=True: Liger's fused linear "
                             "cross-entropy multiplies by lm_head.weight directly, bypassing the LM head's fake "
                             f"quantization; pass {FLCE_OFF} (Liger's other kernels still apply) or "
                             "qat_include_lm_head=False")
        if self.qat_scheme is not None and self.lowbit_recipes:
            raise ValueError(f"{cls}.qat_scheme={self.qat_scheme!r} with "
                             f"{self.lowbit_recipes[0]}=True: a linear is either fake-quantized for QAT or "
                             "computed in low precision; switch one off")
        if len(self.lowbit_recipes) > 1:
            raise ValueError(f"{cls}.{self.lowbit_recipes[0]} and {self.lowbit_recipes[1]} are both True: "
                             "each linear computes in one format; choose one")
        if self.lora_base_quant is not None and self.lora_base_quant not in ("nf4", "int8"):
            raise ValueError(f"{cls}.lora_base_quant must be None, 'nf4' or 'int8', "
                             f"got {self.lora_base_quant!r}")
        if self.lora_base_quant and self.qat_scheme is not None:
            raise ValueError(f"{cls}.qat_scheme={self.qat_scheme!r} with lora_base_quant="
                             f"{self.lora_base_quant!r}: QAT fake-quantizes a high-precision base for a later "
                             "export, a QLoRA base is stored quantized already; use one (QAT + LoRA needs no "
                             "lora_base_quant)")
        fp8 = next((r for r in self.lowbit_recipes if r.startswith("fp8")), None)
        if self.lora_base_quant and fp8:
            raise ValueError(f"{cls}.lora_base_quant with {fp8} is not supported: "
                             "a quantized base computes in INT8 (int8_mixed_precision) or in the compute dtype")
        if self.lora_base_int8_cache and not (self.lora_base_quant == "nf4" and self.int8_mixed_precision):
            raise ValueError(f"{cls}.lora_base_int8_cache=True needs lora_base_quant='nf4' and "
                             "int8_mixed_precision=True (it caches the INT8 form of NF4 bases for INT8 compute)")
        if self.lowbit_recipes and not (self.lowbit_output or self.lowbit_grad_input or self.lowbit_grad_weight):
            raise ValueError(f"{cls}.{self.lowbit_recipes[0]}=True with lowbit_output, "
                             "lowbit_grad_input and lowbit_grad_weight all False quantizes nothing: "
                             "enable at least one matmul or switch the recipe off")
        if self.lowbit_fsdp_lowbit_all_gather:
            flag = f"{cls}.lowbit_fsdp_lowbit_all_gather=True"
            if not self.lowbit_recipes:
                raise ValueError(f"{flag} all-gathers INT8/FP8 weights: it needs int8_mixed_precision or "
                                 "fp8_mixed_precision (under FSDP2)")
            if not (self.lowbit_output and self.lowbit_grad_input):
                raise ValueError(f"{flag} replaces the weight by its gathered codes in the forward and input-gradient "
                                 "matmuls: it needs lowbit_output and lowbit_grad_input True")
            if self.torch_compile:
                raise ValueError(f"{flag} with torch_compile=True: the gathered low-bit weight is not traceable by "
                                 "torch.compile yet; switch one off")
            if self.fp8_tensorwise_mixed_precision:
                raise ValueError(f"{flag} with fp8_tensorwise_mixed_precision=True: each rank would quantize its shard "
                                 "with its own scale, not the whole weight's; use fp8_mixed_precision (row-wise)")
        peak = self.lowbit_peak_tflops
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0):
            raise ValueError(f"{cls}.lowbit_peak_tflops must be a positive number of TFLOP/s or None, got {peak!r}")

    @property
    def lowbit_recipes(self) -> list[str]:
        """The low-bit recipes these arguments switch on, in the order they are applied."""
        return [name for name in MIXED_PRECISION_RECIPES if getattr(self, name)]

    def resolved_fused_swiglu(self, adapters: bool = False) -> bool:
        """``lowbit_fused_swiglu``, unset resolved: on for full fine-tuning (no ``adapters``, no QLoRA base) in INT8/FP8
        row-wise compute of all three matmuls with nearest rounding, on a CUDA device (where the SwiGLU kernels run),
        not sharded, unless Liger patches the SwiGLU. On the H200 it gained in whole steps (docs/benchmarks.md, "Issue
        25, session 34"); anything else (LoRA, FSDP: unmeasured) keeps the MLP per linear."""
        if self.lowbit_fused_swiglu is not None:
            return self.lowbit_fused_swiglu
        return bool((self.int8_mixed_precision or self.fp8_mixed_precision) and not self.fp8_tensorwise_mixed_precision
                    and not adapters and not self.lora_base_quant and not self.lowbit_stochastic_rounding
                    and not liger_requested(self, "swiglu")
                    and self.lowbit_output and self.lowbit_grad_input and self.lowbit_grad_weight
                    and not sharded_by_launch(self) and self.device.type == "cuda")

    def resolved_fused_adamw(self, adapters: bool = False) -> bool:
        """``lowbit_fused_adamw``, unset resolved: on for INT8/FP8 full fine-tuning (no ``adapters``, no QLoRA base:
        their trained parameters are all small) with torch's AdamW (``optim='adamw_torch_fused'``, the default, or
        ``'adamw_torch'``) on a CUDA device, not sharded (FSDP, DeepSpeed: :func:`sharded_by_launch`, the same test as
        ``resolved_fused_swiglu``'s). On the H200 its step took 0.72x torch's fused AdamW's, +0.07 on the 1x2048 ratio
        (docs/benchmarks.md, "Issue 25, session 34")."""
        if self.lowbit_fused_adamw is not None:
            return self.lowbit_fused_adamw
        optim = getattr(self.optim, "value", self.optim)
        return bool(self.lowbit_recipes and not adapters and not self.lora_base_quant and not sharded_by_launch(self)
                    and optim in ("adamw_torch", "adamw_torch_fused") and self.device.type == "cuda")


@dataclass
class LowBitTrainingArguments(LowBitArgumentsMixin, TrainingArguments):
    """``TrainingArguments`` with the low-bit switches of ``LowBitArgumentsMixin`` (for ``LowBitTrainer``)."""
