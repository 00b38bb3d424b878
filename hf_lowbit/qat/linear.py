"""Quantization-aware training: fake-quantize during fine-tuning, then convert to torchao's quantized tensors.

* :data:`QAT_SCHEMES`: scheme name -> how to fake-quantize, the torchao PTQ config that convert applies, and
  where the export is meant to run. For ExecuTorch / CPU (torchao's unpacked int4-in-int8 layout): ``"8da4w"``
  (int8 per-token asymmetric dynamic activations + int4 per-group symmetric weights =
  ``Int8DynamicActivationIntxWeightConfig``) and ``"int4_weight_only"`` (``IntxWeightOnlyConfig``); both also per
  channel (``group_size=PER_CHANNEL``, i.e. -1: one scale per weight row, torchao's ``PerAxis(0)``). For NVIDIA
  GPUs: ``"int4_tinygemm"`` (``Int4WeightOnlyConfig`` in the ``tile_packed_to_4d`` packing, torch's tinygemm
  kernel, sm_80+) and ``"fp8_rowwise"`` (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``,
  ``torch._scaled_mm``, sm_89+).
* :class:`QATConfig` and :func:`convert_to_qat` (the recipe's shape, as for the other recipes): swap
  eligible ``nn.Linear`` for :class:`QATLinear` through ``swap_linears``; layers whose ``in_features``
  is not a multiple of the group size are skipped and reported (per channel: no such rule). Layer size does not
  matter here (``QATConfig.filter`` sets ``min_features=1``): every linear the export quantizes must have trained
  with fake quant. :func:`prepare_qat` is the same with the filter built from an ``exclude`` list.
* :class:`QATLinear`: one ``autograd.Function`` that fake-quantizes the activation and the weight
  (``hf_lowbit.kernels.fake_quant``, the same arithmetic as torchao's convert) and multiplies; backward is the
  straight-through estimator and *recomputes* the fake-quantized operands from the saved input and
  weight, so nothing weight- or activation-sized is kept beyond what bf16 keeps. Under
  ``torch.compile`` the quantization fuses into a couple of kernels, and a selective activation
  checkpoint around the function (see :func:`qat_linear`) keeps the partitioner from saving the
  fake-quantized operands anyway.
* :func:`set_fake_quant_enabled` and :class:`FakeQuantScheduleCallback`: fake quant off for the
  first ``N`` optimizer steps, then on, decided from ``state.global_step`` so resuming is correct.
* :func:`convert_qat`: back to ``nn.Linear`` (shared parameters), then torchao's ``quantize_`` with the
  scheme's config on exactly the layers that were trained with fake quant.

torchao's own ``FakeQuantizedLinear`` (from ``quantize_(model, QATConfig(base, step="prepare"))``) is
also recognized by :func:`set_fake_quant_enabled` and :func:`convert_qat`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import TrainerCallback

from ..compute import compute_dtype
from ..kernels.fake_quant import (fake_quant_fp8_rowwise, fake_quant_int4_tinygemm, fake_quant_per_group_sym,
                                  fake_quant_per_token_asym)
from ..swap import LinearFilter, SwapReport, including_output_embeddings, swap_linears


PER_CHANNEL = -1
"""``QATConfig(group_size=PER_CHANNEL)`` (``qat_group_size=-1``, ``eval_qat.py --group_size -1``): one int4 scale per
weight row, i.e. one group of ``in_features`` per output channel, whatever each layer's ``in_features``; torchao's
``PerAxis(0)`` granularity (its block size ``(1, in_features)``, the same arithmetic as a group of that size). -1 as
transformers' ``GPTQConfig`` / ``AwqConfig`` spell per-column quantization, and an integer, so the command line
takes it. The IntxUnpacked schemes (8da4w, int4_weight_only) only; ``fp8_rowwise`` is per row anyway."""


def group_label(group_size: int) -> str:
    """``"per channel"`` for :data:`PER_CHANNEL`, else ``"group N"`` (reports, model cards, benchmark tables)."""
    return "per channel" if group_size == PER_CHANNEL else f"group {group_size}"


@dataclass(frozen=True)
class QATScheme:
    """One QAT scheme: how it fake-quantizes, what convert makes of it, and where the result is meant to run.

    ``fake_quant_weight(w, group_size)`` and ``fake_quant_act(x)`` (None: activations unquantized) are
    torchao's arithmetic for ``base_config(group_size)``'s convert (:mod:`hf_lowbit.kernels.fake_quant`);
    ``fake_quant_weight`` gets the group size in elements (per channel: ``in_features``), ``base_config`` the
    configured one (per channel: :data:`PER_CHANNEL`).
    ``weight_dtype``: the converted tensor's dtype where torchao fixes it (the weight is cast to it before the
    fake quant and before convert); ``act_dtype``: the dtype the converted kernel takes activations in (its
    output is cast back). ``grouped``: weights in groups of ``group_size`` along ``in_features`` (else per
    output row, the group size unused); ``group_sizes``: the only group sizes the converted kernel takes (then
    not per channel either).
    ``alignment``: in and out features must be multiples of it (else torchao's convert leaves the layer
    unquantized, so the swap skips it too). ``min_capability``: the CUDA compute capability the converted
    kernels need (None: any device). ``convert_on_cuda``: torchao's convert packs the weight with a CUDA op.
    ``runtime``: where the exported checkpoint is meant to be served (model card, docs). ``serving``: how to
    serve it fast and what that measured (the model card's Serving section; tests/test_qat_schemes.py checks its
    figures against docs/results).
    """

    name: str
    description: str
    tensor_type: str
    runtime: str
    fake_quant_weight: Callable[[Tensor, int], Tensor]
    fake_quant_act: Callable[[Tensor], Tensor] | None
    base_config: Callable[[int], object]  # group_size -> torchao AOBaseConfig applied by convert
    weight_dtype: torch.dtype | None = None
    act_dtype: torch.dtype | None = None
    grouped: bool = True
    group_sizes: tuple[int, ...] | None = None
    alignment: int = 1
    min_capability: tuple[int, int] | None = None
    convert_on_cuda: bool = False
    serving: str = ""

    def group_size_problem(self, group_size: int) -> str | None:
        """Why ``group_size`` (:data:`PER_CHANNEL` included) does not suit this scheme's converted kernel (None: it
        does); the reason ends with what to choose instead."""
        if self.group_sizes is not None and group_size not in self.group_sizes:
            sizes = ", ".join(map(str, self.group_sizes))
            if group_size == PER_CHANNEL:
                others = " or ".join(n for n, s in QAT_SCHEMES.items() if s.grouped and s.group_sizes is None)
                return (f"the {self.tensor_type} kernel has no per-channel int4, it takes groups of {sizes} elements "
                        f"only; choose one of them, or scheme {others} for per-channel int4 weights")
            return f"the {self.tensor_type} kernel takes groups of {sizes} elements only; choose one of them"
        return None


def _intx_granularity(group_size: int):
    """torchao's granularity for an IntxUnpacked weight: ``PerAxis(0)`` per channel (one scale per output row), else
    ``PerGroup(group_size)``."""
    from torchao.quantization import PerAxis, PerGroup

    return PerAxis(0) if group_size == PER_CHANNEL else PerGroup(group_size)


def _8da4w(group_size: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                 weight_granularity=_intx_granularity(group_size))


def _int4_weight_only(group_size: int):
    from torchao.quantization import IntxWeightOnlyConfig

    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=_intx_granularity(group_size))


def _int4_tinygemm(group_size: int):
    from torchao.quantization import Int4WeightOnlyConfig
    from torchao.quantization.quantize_.workflows import Int4ChooseQParamsAlgorithm, Int4PackingFormat

    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                int4_choose_qparams_algorithm=Int4ChooseQParamsAlgorithm.TINYGEMM)


def _fp8_rowwise(group_size: int):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())


_EXECUTORCH = ("ExecuTorch / CPU: torchao's unpacked int4-in-int8 layout, meant for lowering to ExecuTorch "
               "(XNNPACK, KleidiAI); on a GPU it runs slower than the bf16 model")

_SERVE_CODE = """```python
from transformers import AutoModelForCausalLM
from hf_lowbit.qat import prepare_for_serving
{import_line}

model = AutoModelForCausalLM.from_pretrained("{{name}}", device_map="cuda")
{swap_line}
compile_config = prepare_for_serving(model)  # plain-tensor weights, fewer guards, generate's stop check deferred
out = model.generate(input_ids, max_new_tokens=256, cache_implementation="static", compile_config=compile_config)
```"""
_INT4_SERVING = _SERVE_CODE.format(
    import_line="from hf_lowbit.qat.int4_serving import use_int4_kernels",
    swap_line='use_int4_kernels(model, decode="triton_mma")  # a tensor-core GEMV to 16 rows, dequantize + cuBLAS above'
) + """

Measured by hf_lowbit on one H200 (32 Llama-8B-shaped layers, the compiled path above, the bf16 model in the same
run; docs/qat.md): greedy decode at batch 1 **1.87x** the bf16 model's tokens/s (2.14x in an earlier run; torchao's
PTQ of the same config on torchao's own tinygemm path 1.37x in the same run), 1.60x at batch 8; prefill of 2048
tokens 0.95x; 0.28x its size. Loaded with plain transformers alone, the same weights run torchao's tinygemm kernel
for prefill and decode (slower at both: docs/qat.md)."""
_FP8_SERVING = _SERVE_CODE.format(
    import_line="from hf_lowbit.qat.fp8_serving import use_fp8_kernels",
    swap_line="use_fp8_kernels(model)  # FP8 GEMV for decode (activation quantized once), _scaled_mm for prefill") + """

Measured by hf_lowbit on one H200 (32 Llama-8B-shaped layers, the compiled path above without the deferred stop
check, the bf16 model in the same run; docs/qat.md): greedy decode at batch 1 **1.34-1.42x** the bf16 model's tokens/s
in two runs, prefill of 2048 tokens 1.49-1.52x (torchao's FP8 PTQ served by torchao's own path: 0.95x and 1.42x in the
same run); 0.51x its size."""

QAT_SCHEMES: dict[str, QATScheme] = {
    "8da4w": QATScheme(
        "8da4w", "int8 per-token asymmetric dynamic activations, int4 per-group symmetric weights",
        "IntxUnpackedToInt8Tensor", _EXECUTORCH,
        lambda w, g: fake_quant_per_group_sym(w, g, 4), lambda x: fake_quant_per_token_asym(x, 8), _8da4w),
    "int4_weight_only": QATScheme(
        "int4_weight_only", "int4 per-group symmetric weights, activations unquantized",
        "IntxUnpackedToInt8Tensor", _EXECUTORCH,
        lambda w, g: fake_quant_per_group_sym(w, g, 4), None, _int4_weight_only),
    "int4_tinygemm": QATScheme(
        "int4_tinygemm", "int4 per-group asymmetric weights (bf16 scale and float zero point per group), "
        "bf16 activations", "Int4TilePackedTo4dTensor",
        "NVIDIA GPU, sm_80+: torch's tinygemm int4 kernel (aten._weight_int4pack_mm, core PyTorch; no extra "
        "package), bf16 activations; converts on a CUDA device",
        fake_quant_int4_tinygemm, None, _int4_tinygemm, weight_dtype=torch.bfloat16, act_dtype=torch.bfloat16,
        group_sizes=(32, 64, 128, 256), min_capability=(8, 0), convert_on_cuda=True,
        serving=_INT4_SERVING),
    "fp8_rowwise": QATScheme(
        "fp8_rowwise", "float8 e4m3 per-token dynamic activations, float8 e4m3 per-output-channel weights",
        "Float8Tensor",
        "NVIDIA GPU, sm_89+ (Ada, Hopper): FP8 tensor cores through torch._scaled_mm (core PyTorch) with row-wise "
        "scales",
        lambda w, g: fake_quant_fp8_rowwise(w), fake_quant_fp8_rowwise, _fp8_rowwise,
        weight_dtype=torch.bfloat16, grouped=False, alignment=16, min_capability=(8, 9), serving=_FP8_SERVING),
}


def get_scheme(name: str) -> QATScheme:
    if name not in QAT_SCHEMES:
        raise ValueError(f"unknown QAT scheme {name!r}; valid schemes: {', '.join(QAT_SCHEMES)}")
    return QAT_SCHEMES[name]


@dataclass(frozen=True)
class QATConfig:
    """A scheme name from :data:`QAT_SCHEMES` and the weight group size (along ``in_features``).

    ``group_size``: an integer >= 2, or :data:`PER_CHANNEL` (-1) for one scale per weight row (8da4w,
    int4_weight_only; every linear qualifies, there is no divisibility rule). ``include_lm_head``: also
    fake-quantize the output embedding. ``fake_quant_enabled``: whether the swapped layers start with fake
    quantization on (off while ``qat_fake_quant_after_n_steps`` runs). Only ``scheme`` and ``group_size`` matter to
    :func:`convert_qat` / the export.
    """

    scheme: str = "8da4w"
    group_size: int = 256
    include_lm_head: bool = False
    fake_quant_enabled: bool = True

    recipe = "qat"  # the recipe's name in reports

    def __post_init__(self):
        spec = get_scheme(self.scheme)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or (g < 2 and g != PER_CHANNEL):
            raise ValueError(f"QATConfig.group_size must be an integer >= 2, or {PER_CHANNEL} for per channel (one "
                             f"scale per weight row), got {g!r}")
        problem = spec.group_size_problem(g)
        if problem:
            raise ValueError(f"QATConfig.group_size={g}{' (per channel)' if self.per_channel else ''} with scheme "
                             f"{self.scheme!r}: {problem}")

    @property
    def spec(self) -> QATScheme:
        return QAT_SCHEMES[self.scheme]

    @property
    def per_channel(self) -> bool:
        """One scale per weight row: ``group_size`` is :data:`PER_CHANNEL`, or the scheme is row-wise anyway."""
        return self.group_size == PER_CHANNEL or not self.spec.grouped

    @property
    def granularity(self) -> str:
        """``"per channel"`` or ``"group N"``, for reports, reprs and model cards."""
        return group_label(PER_CHANNEL if self.per_channel else self.group_size)

    @property
    def description(self) -> str:
        """The scheme's description with this config's weight granularity (per-group or per-channel)."""
        d = self.spec.description
        return d.replace("per-group", "per-channel") if self.group_size == PER_CHANNEL else d

    def base_config(self):
        """The torchao PTQ config that :func:`convert_qat` applies (and ``TorchAoConfig`` records)."""
        return self.spec.base_config(self.group_size)

    def filter(self, base: LinearFilter) -> LinearFilter:
        """``base`` with QAT's shape rule (``in_features`` a multiple of the group size; none per channel) and no
        size floor.

        ``min_features`` is 1 whatever ``base`` says: ``lowbit_min_features`` keeps matmuls too small for
        low-bit *kernels* to pay in high precision, but QAT runs no low-bit kernel while training, and the
        export quantizes exactly the layers that trained with fake quant, so a size floor here would only
        leave small layers unquantized in the exported model. Row-wise schemes (``fp8_rowwise``) have no
        group rule; their kernel's alignment (features multiples of 16) is the rule instead, the layers
        torchao's convert would silently leave unquantized. ``include_lm_head`` lifts the default
        exclusion of the output embedding (patterns that name it are dropped by :func:`convert_to_qat`).
        """
        spec = self.spec
        return replace(base, min_features=1, multiple_of=max(base.multiple_of, spec.alignment),
                       in_features_multiple_of=1 if self.per_channel else self.group_size,
                       exclude_output_embeddings=base.exclude_output_embeddings and not self.include_lm_head)


class _QATLinearFn(torch.autograd.Function):
    """``F.linear(fq(x), fq(W), b)``; saves only ``x`` and ``W``, recomputes ``fq(x)``, ``fq(W)`` in backward (STE).

    The scheme is passed by name (a constant to dynamo). A scheme with an ``act_dtype`` (tinygemm: bf16)
    multiplies in that dtype and casts the output back, as its converted kernel does.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, scheme: str, group_size: int) -> Tensor:
        dtype = compute_dtype(x)
        xq, wq = _fake_operands(x.to(dtype), weight, scheme, group_size)
        y = F.linear(xq, wq, None if bias is None else bias.to(xq.dtype)).to(dtype)
        ctx.save_for_backward(x, weight)  # the fake-quantized operands are recomputed in backward
        ctx.cfg = (scheme, group_size, dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        scheme, group_size, dtype, bias_dtype = ctx.cfg
        xq, wq = _fake_operands(x.to(dtype), weight, scheme, group_size)
        g2 = grad_out.reshape(-1, weight.shape[0]).to(xq.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # straight-through: d(fake_quant(x))/dx = identity
            dx = (g2 @ wq).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (g2.T @ xq.reshape(-1, x.shape[-1])).to(weight.dtype)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, dw, db, None, None


def _fake_operands(x: Tensor, weight: Tensor, scheme: str, group_size: int) -> tuple[Tensor, Tensor]:
    """The fake-quantized input and weight, both in the dtype the matmul runs in (per channel: one group of
    ``in_features`` per weight row, which is what torchao's ``PerAxis(0)`` computes)."""
    s = QAT_SCHEMES[scheme]
    if group_size == PER_CHANNEL:
        group_size = weight.shape[-1]
    if s.act_dtype is not None:
        x = x.to(s.act_dtype)
    xq = x if s.fake_quant_act is None else s.fake_quant_act(x)
    wq = s.fake_quant_weight(weight.to(s.weight_dtype or x.dtype), group_size)
    return xq, wq.to(xq.dtype)


# Under torch.compile, what the QAT linear keeps for backward: the matmul output (as a plain linear
# does) and the per-token / per-group min and max (tiny); the elementwise rest is recomputed.
_KEPT_OPS = tuple(getattr(torch.ops.aten, n).default for n in ("mm", "addmm", "bmm", "amin", "amax"))


def _keep_matmul_and_min_max(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.MUST_RECOMPUTE


def qat_linear(x: Tensor, weight: Tensor, bias: Tensor | None, config: QATConfig) -> Tensor:
    """``F.linear`` on fake-quantized operands (as ``config``'s scheme), straight-through gradients.

    Under ``torch.compile`` the call runs in a selective activation checkpoint (policy
    :func:`_keep_matmul_and_min_max`): AOTAutograd's CSE merges the backward's recomputation of the
    fake-quantized operands with the forward's, and the partitioner would then keep them (a bf16 copy
    of the weight and of the input) until backward; the policy makes it recompute them instead.
    """
    args = (x, weight, bias, config.scheme, config.group_size)
    if torch.compiler.is_compiling():
        return checkpoint(_QATLinearFn.apply, *args, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _keep_matmul_and_min_max))
    return _QATLinearFn.apply(*args)


class QATLinear(nn.Linear):
    """An ``nn.Linear`` that fake-quantizes while ``fake_quant_enabled``; same parameters and state-dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config: QATConfig = QATConfig()):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if not config.per_channel and in_features % config.group_size:
            raise ValueError(f"QATLinear: in_features={in_features} is not a multiple of "
                             f"group_size={config.group_size}")
        self.qat_config = config
        self.fake_quant_enabled = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QATConfig) -> "QATLinear":
        """Wrap ``linear``'s own parameters (shared, not copied)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding this layer's parameters (for convert / export)."""
        new = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        new.weight = self.weight
        new.bias = self.bias
        new.train(self.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        if not self.fake_quant_enabled:
            return F.linear(x, self.weight, self.bias)
        return qat_linear(x, self.weight, self.bias, self.qat_config)

    def extra_repr(self) -> str:
        c = self.qat_config
        return f"{super().extra_repr()}, qat={c.scheme}, {c.granularity}, fake_quant={self.fake_quant_enabled}"


def _torchao_fake_quantized_types() -> tuple[type, ...]:
    from torchao.quantization.qat import FakeQuantizedLinear

    return (FakeQuantizedLinear,)


def convert_to_qat(model: nn.Module, config: QATConfig, filter: LinearFilter = LinearFilter()) -> SwapReport:
    """Swap ``model``'s eligible linears for :class:`QATLinear` in place; return the report.

    ``filter`` gets QAT's rules (:meth:`QATConfig.filter`). With ``config.include_lm_head`` the output
    embedding is swapped too, and exclusion patterns that name it are dropped
    (:func:`~hf_lowbit.swap.including_output_embeddings`).
    """
    linear_filter = config.filter(filter)
    if config.include_lm_head:
        linear_filter = including_output_embeddings(model, linear_filter)

    def make(name, linear):
        layer = QATLinear.from_linear(linear, config)
        layer.fake_quant_enabled = config.fake_quant_enabled
        return layer

    return swap_linears(model, make, recipe=config.recipe,
                        target=f"QAT {config.scheme} fake quant ({config.granularity})",
                        filter=linear_filter, already=(QATLinear, *_torchao_fake_quantized_types()))


def prepare_qat(model: nn.Module, config: QATConfig, exclude: tuple[str, ...] = ("lm_head",),
                include_lm_head: bool = False, enabled: bool = True) -> SwapReport:
    """:func:`convert_to_qat` with the filter built from ``exclude`` (names/globs left alone) and the
    ``include_lm_head`` / ``enabled`` switches set on ``config``."""
    config = replace(config, include_lm_head=include_lm_head, fake_quant_enabled=enabled)
    return convert_to_qat(model, config, LinearFilter(exclude=tuple(exclude)))


def set_fake_quant_enabled(model: nn.Module, enabled: bool) -> int:
    """Switch fake quantization on/off in every QAT layer of ``model`` (ours and torchao's); return how many."""
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    n = 0
    for module in model.modules():
        if isinstance(module, QATLinear):
            module.fake_quant_enabled = bool(enabled)
            n += 1
        elif isinstance(module, _torchao_fake_quantized_types()):
            enable_linear_fake_quant(module, enabled=bool(enabled))
            n += 1
    return n


def fake_quant_enabled_at(step: int, after_n_steps: int) -> bool:
    """Whether the optimizer step that starts with ``global_step == step`` fake-quantizes."""
    return step >= after_n_steps


class FakeQuantScheduleCallback(TrainerCallback):
    """Fake quant off for the first ``after_n_steps`` optimizer steps, then on.

    Decided from ``state.global_step`` at the start of training and of every step, so a run resumed
    from a checkpoint saved before or after step N is in the right state from its first step.
    """

    def __init__(self, after_n_steps: int):
        if isinstance(after_n_steps, bool) or not isinstance(after_n_steps, int) or after_n_steps < 0:
            raise ValueError(f"after_n_steps must be an integer >= 0, got {after_n_steps!r}")
        self.after_n_steps = after_n_steps
        self.enabled: bool | None = None

    def _apply(self, state, model):
        enabled = fake_quant_enabled_at(state.global_step, self.after_n_steps)
        if enabled != self.enabled and model is not None:
            set_fake_quant_enabled(model, enabled)
            self.enabled = enabled

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.enabled = None  # resuming: global_step was restored before this call
        self._apply(state, model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._apply(state, model)


def cuda_capability_problem(scheme: str, device: torch.device | str | None = None) -> str | None:
    """Why the CUDA device ``device`` (default: the current one) cannot run ``scheme``'s converted kernels, or
    None. No CUDA at all is a problem only for the GPU schemes (``min_capability`` set)."""
    spec = get_scheme(scheme)
    need = spec.min_capability
    if need is None:
        return None
    if not torch.cuda.is_available():
        return f"its kernels need an NVIDIA GPU of compute capability sm_{need[0]}{need[1]}+ and this process has none"
    have = torch.cuda.get_device_capability(device)
    if have < need:
        return (f"its kernels need compute capability sm_{need[0]}{need[1]}+ and this GPU is sm_{have[0]}{have[1]}")
    return None


def _without_inductor_settings(base):
    """torchao's PTQ config ``base`` with ``set_inductor_config`` off, where it has that field.

    torchao's int4 (``Int4WeightOnlyConfig``) and FP8 transforms otherwise call
    ``recommended_inductor_config_setter()`` on every layer they quantize, which turns on, for the whole process
    and for good, Inductor's coordinate-descent autotuning of every Triton kernel compiled afterwards
    (``coordinate_descent_tuning``, ``coordinate_descent_check_all_directions``; also
    ``force_fuse_int_mm_with_mul``). A training graph compiled after a convert in the same process (a PTQ
    baseline before a QAT fine-tune, as ``benchmarks/eval_qat.py`` does) then spends minutes autotuning
    each of its kernels in its first step (issue 26).
    """
    if is_dataclass(base) and any(f.name == "set_inductor_config" for f in fields(base)):
        return replace(base, set_inductor_config=False)
    return base


def convert_qat(model: nn.Module, config: QATConfig) -> list[str]:
    """Replace every fake-quantized linear of ``model`` by an ``nn.Linear`` with a torchao quantized weight.

    Returns the converted module names. ``config`` gives torchao's PTQ config (it must be the one
    the layers were trained with). In place; the model is for inference afterwards. A scheme with a
    ``weight_dtype`` gets its weights cast to it first (torchao's tinygemm and FP8 row-wise tensors take bf16
    only). GPU schemes convert only in a process with a GPU that runs them (torchao's FP8 convert checks the
    current GPU; tinygemm's packing is a CUDA op): a layer held elsewhere is packed on the current CUDA device
    and moved back, so a CPU copy (the distributed export's) converts too. Without such a GPU this raises
    before touching the model. Converting leaves the process's Inductor settings as they were (torchao's
    ``set_inductor_config`` is turned off, see :func:`_without_inductor_settings`): for torchao's recommended
    serving settings call ``torchao.quantization.utils.recommended_inductor_config_setter()`` yourself.
    """
    from torchao.quantization import quantize_

    spec = config.spec
    problem = cuda_capability_problem(config.scheme)
    if problem:
        raise RuntimeError(f"convert_qat: qat_scheme={config.scheme!r} cannot be converted here: {problem}; "
                           f"export on the GPU that will serve it ({spec.runtime.split(':')[0]})")
    fq_types = _torchao_fake_quantized_types()
    names = [n for n, m in model.named_modules() if isinstance(m, (QATLinear, *fq_types))]
    base = _without_inductor_settings(config.base_config())
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, attr).to_linear()
        if spec.weight_dtype is not None and linear.weight.dtype != spec.weight_dtype:
            linear.weight = nn.Parameter(linear.weight.detach().to(spec.weight_dtype), requires_grad=False)
        home = linear.weight.device
        if spec.convert_on_cuda and home.type != "cuda":
            linear.to("cuda")
        quantize_(linear, base)
        setattr(parent, attr, linear.to(home))
    return names


__all__ = ["QAT_SCHEMES", "PER_CHANNEL", "group_label", "QATScheme", "QATConfig", "QATLinear", "qat_linear",
           "convert_to_qat", "prepare_qat", "convert_qat", "cuda_capability_problem", "set_fake_quant_enabled",
           "fake_quant_enabled_at", "FakeQuantScheduleCallback", "get_scheme"]
