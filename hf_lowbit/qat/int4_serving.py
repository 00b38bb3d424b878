"""Serving ``int4_tinygemm`` exports with hf_lowbit's int4 kernels instead of tinygemm (issue 26).

    model = AutoModelForCausalLM.from_pretrained(export_dir, device_map="cuda")
    report = use_int4_kernels(model)          # every Int4TilePackedTo4dTensor linear -> Int4ServingLinear
    compile_config = prepare_for_serving(model)
    model.generate(ids, cache_implementation="static", compile_config=compile_config, ...)

:class:`Int4ServingLinear` holds the weight as three plain buffers (``packed`` codes, ``scales``, ``zeros``: the
layout of :mod:`hf_lowbit.kernels.int4`) and calls ``hf_lowbit::int4_linear``: batch ≤ 16 rows a split-K GEMV
built to stream the weight, more rows (prefill) the weight dequantized to bf16 once and cuBLAS. Same numerics as
tinygemm (``bf16((q - 8)·scale + zero)``, float32 accumulation); the repack from torchao's tile-packed layout is
exact (:func:`hf_lowbit.kernels.int4.repack_tinygemm_weight`: the codes, scales and zeros as stored, nothing
requantized). Plain buffers: no tensor subclass for Dynamo to guard or AOTAutograd to flatten per call.

Needs torch, Triton (on CUDA) and :mod:`hf_lowbit.kernels.int4` / :mod:`hf_lowbit.swap`; the repack needs a CUDA
device (tinygemm unpacks its own layout) and torchao's ``Int4TilePackedTo4dTensor`` (recognised by type name, not
imported). Not yet measured on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.int4 import int4_linear, repack_tinygemm_weight
from ..swap import SERVING_FILTER, SwapReport, swap_linears

__all__ = ["Int4ServingLinear", "int4_serving_problem", "use_int4_kernels"]

TINYGEMM_WEIGHT = "Int4TilePackedTo4dTensor"


class Int4ServingLinear(nn.Module):
    """``y = x @ Wᵀ (+ bias)``, ``W`` int4 in hf_lowbit's layout (buffers ``packed [N, K/2]`` uint8, ``scales``,
    ``zeros`` ``[N, K/group_size]`` bf16). Inputs of any leading shape and floating dtype: computed in bf16 (as
    tinygemm's linear does), returned in the input's dtype."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = int(group_size)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4ServingLinear:
        """From an ``nn.Linear`` whose weight is torchao's ``Int4TilePackedTo4dTensor`` (CUDA), exactly
        (:func:`int4_serving_problem` says why not otherwise)."""
        problem = int4_serving_problem(linear)
        if problem:
            raise ValueError(f"Int4ServingLinear.from_linear: {problem}")
        packed, scales, zeros, group_size = repack_tinygemm_weight(linear.weight)
        return cls(packed, scales, zeros, group_size, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = int4_linear(x.reshape(-1, self.in_features).to(torch.bfloat16), self.packed, self.scales, self.zeros,
                        self.group_size)
        y = y.reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


def int4_serving_problem(module: nn.Module) -> str | None:
    """Why ``module`` (an ``nn.Linear``) cannot become an :class:`Int4ServingLinear` (one line), or None when it can
    (as :func:`hf_lowbit.qat.fp8_serving.fp8_serving_problem` for FP8)."""
    weight = module.weight
    wtype = type(weight).__name__
    if wtype != TINYGEMM_WEIGHT:
        return f"weight is {wtype}, not {TINYGEMM_WEIGHT}"
    if weight.device.type != "cuda":
        return f"weight on {weight.device}: the repack runs tinygemm (CUDA)"
    if getattr(weight, "act_pre_scale", None) is not None:
        return "weight has an act_pre_scale"
    gs = int(weight.block_size[-1])
    if module.in_features % gs:
        return f"in_features {module.in_features} is not a multiple of group_size {gs}"
    if gs < 32 or gs & (gs - 1):
        return f"group_size {gs} is not a power of 2 >= 32"
    return None


def use_int4_kernels(model: nn.Module) -> SwapReport:
    """Replace every ``nn.Linear`` of ``model`` whose weight is an ``Int4TilePackedTo4dTensor`` (the LM head too) by
    an :class:`Int4ServingLinear`, in place; the report lists what was swapped and, for the other linears, why not
    (a parametrized one is a subclass: call this before :func:`hf_lowbit.qat.prepare_for_serving`, whose unwrap
    then finds no subclass weights left). Each old weight is freed as its replacement is built."""
    return swap_linears(model, lambda name, linear: Int4ServingLinear.from_linear(linear), recipe="int4_kernels",
                        target="Int4ServingLinear", filter=SERVING_FILTER, check=int4_serving_problem)
