"""Serving an ``fp8_rowwise`` export with our own decode kernel: :func:`use_fp8_kernels`.

    model = AutoModelForCausalLM.from_pretrained(export_dir, device_map="cuda")
    use_fp8_kernels(model)  # every row-wise Float8Tensor linear -> Fp8ServingLinear; q/k/v, gate/up stacked
    model.generate(ids, cache_implementation="static", compile_config=serving_compile_config(), ...)

:class:`Fp8ServingLinear` holds the weight torchao loaded (``Float8Tensor``: e4m3 codes ``qdata`` [N, K] and float32
row scales ``scale`` [N, 1]) as plain buffers, the same bytes, and calls ``hf_lowbit::fp8_rowwise_linear``
(:mod:`hf_lowbit.kernels.fp8_gemv`): the Triton GEMV at decode (M ≤ 16 rows: by default the activation quantized
once by a row kernel, the fp8 weight streamed once), ``torch._scaled_mm`` at prefill as the export runs it. Same
arithmetic as torchao's linear (the activation codes bit for bit, float32 sums), except that an all-zero activation row
gives the bias where torchao's gives NaN. Plain buffers also take the tensor-subclass flattening out of every compiled
call (what :func:`hf_lowbit.qat.serving.unwrap_quantized_weights` does for the weights this does not swap).

On the H200 the GEMV's first design (``fused``) measured slow, its second (``codes``, the default) 1.03-1.93x
``_scaled_mm`` per linear; q/k/v and gate/up stacked (the default, :mod:`hf_lowbit.qat.siblings`) cut a 32-layer
model's GPU time a decoded token 15% more (docs/qat.md § Serving).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8_gemv import fp8_rowwise_linear
from ..swap import SERVING_FILTER, SwapReport, swap_linears
from .siblings import fuse_siblings, shared_problem

__all__ = ["Fp8ServingLinear", "fp8_serving_problem", "stack_problem", "use_fp8_kernels"]


class Fp8ServingLinear(nn.Module):
    """``y = fp8_rowwise_linear(x, codes, scale, bias)`` over the last dim of ``x``; codes ``[N, K]`` e4m3 (K
    contiguous), scales ``[N]`` float32, bias ``[N]`` or None, all buffers (saved in a state dict, moved by
    ``.to(device)``, never trained)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn or scale.numel() != codes.shape[0]:
            raise ValueError(f"Fp8ServingLinear: codes [N, K] float8_e4m3fn and N scales, got {codes.dtype} "
                             f"{tuple(codes.shape)} and {scale.numel()} scales")
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_codes", codes.contiguous())
        self.register_buffer("weight_scale", scale.detach().reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8ServingLinear:
        """From an ``nn.Linear`` whose weight is a row-wise torchao ``Float8Tensor`` (:func:`fp8_serving_problem`
        says why not otherwise): its ``qdata`` and ``scale`` as they are, no copy where already contiguous."""
        problem = fp8_serving_problem(linear)
        if problem:
            raise ValueError(f"Fp8ServingLinear.from_linear: {problem}")
        w = linear.weight
        return cls(w.qdata, w.scale, linear.bias)

    @classmethod
    def concat(cls, modules: list[Fp8ServingLinear]) -> Fp8ServingLinear:
        """One linear computing ``modules``' outputs side by side (their codes, scales and biases stacked along the
        output dim; :func:`stack_problem` says when it cannot): what :func:`hf_lowbit.qat.siblings.fuse_siblings`
        serves q/k/v and gate/up with."""
        problem = stack_problem(modules)
        if problem:
            raise ValueError(f"Fp8ServingLinear.concat: {problem}")
        bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        return cls(torch.cat([m.weight_codes for m in modules]), torch.cat([m.weight_scale for m in modules]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight_codes, self.weight_scale, self.bias)

    def forward_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The output features ``start:end`` alone, from those rows of the weight (views, no copy): a stacked
        sibling's own product (:mod:`hf_lowbit.qat.siblings`)."""
        bias = None if self.bias is None else self.bias[start:end]
        return self._forward(x, self.weight_codes[start:end], self.weight_scale[start:end], bias)

    def _forward(self, x, codes, scale, bias):
        out = fp8_rowwise_linear(x.reshape(-1, self.in_features), codes, scale, bias)
        return out.reshape(*x.shape[:-1], codes.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def fp8_serving_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot become an :class:`Fp8ServingLinear` (one line), or None when it can: an ``nn.Linear``
    whose weight is torchao's ``Float8Tensor`` with e4m3 codes, one scale per weight row, and row-wise e4m3
    activation quantization without bounds (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)."""
    if not isinstance(module, nn.Linear):
        return f"not an nn.Linear ({type(module).__name__})"
    w = module.weight
    kind = type(w).__name__
    if kind != "Float8Tensor":
        return f"weight is {kind}, not a torchao Float8Tensor"
    N, K = w.shape
    if w.qdata.dtype != torch.float8_e4m3fn or w.qdata.dim() != 2:
        return f"Float8Tensor codes are {w.qdata.dtype} {w.qdata.dim()}-D, not 2-D float8_e4m3fn"
    if w.scale.numel() == 1:
        return "tensor-wise scales (one for the whole weight), not row-wise"
    if list(w.block_size or []) != [1, K] or w.scale.numel() != N:
        return f"scales per block {w.block_size}, not per row [1, {K}]"
    act = w.act_quant_kwargs
    if act is None:
        return "weight-only FP8 (no activation quantization)"
    if type(act.granularity).__name__ != "PerRow" or act.float8_dtype != torch.float8_e4m3fn:
        return f"activation quantized {type(act.granularity).__name__} {act.float8_dtype}, not per-row e4m3"
    if act.hp_value_lb is not None or act.hp_value_ub is not None:
        return f"activation scale bounds ({act.hp_value_lb}, {act.hp_value_ub}) not implemented"
    return None


def stack_problem(modules: list[Fp8ServingLinear]) -> str | None:
    """Why ``modules`` cannot be stacked into one :class:`Fp8ServingLinear` (one line), or None: the checks every
    kind shares (:func:`hf_lowbit.qat.siblings.shared_problem`); row-wise codes and scales stack as they are."""
    return shared_problem(modules)


def use_fp8_kernels(model: nn.Module, stack_siblings: bool = True) -> SwapReport:
    """Replace every ``nn.Linear`` of ``model`` whose weight is a row-wise torchao ``Float8Tensor`` (the LM head too)
    by an :class:`Fp8ServingLinear`, in place, as :func:`hf_lowbit.qat.int4_serving.use_int4_kernels` does for int4;
    the report lists what was swapped and, for the other linears (plain weights, tensor-wise scales, other torchao
    types; a parametrized one is a subclass: call this before :func:`hf_lowbit.qat.prepare_for_serving`), why not.
    Call after loading and before compiling; ``print(report)`` gives the summary.

    ``stack_siblings`` (default): q/k/v and gate/up each served by one GEMV over their stacked weights
    (:mod:`hf_lowbit.qat.siblings`: fewer, larger decode launches; the same bytes): on the H200, 32 Llama-8B layers,
    the GPU's time a decoded token 4.23 -> 3.58 ms (bf16 5.08), the same call (docs/qat.md). ``False``: one
    :class:`Fp8ServingLinear` per linear, as loaded."""
    report = swap_linears(model, lambda name, linear: Fp8ServingLinear.from_linear(linear), recipe="fp8_kernels",
                          target="Fp8ServingLinear", filter=SERVING_FILTER, check=fp8_serving_problem)
    if stack_siblings:
        fuse_siblings(model, Fp8ServingLinear, Fp8ServingLinear.concat, stack_problem, report)
    return report
