"""Serving ``int4_tinygemm`` exports with hf_lowbit's int4 op (issue 26): tinygemm for decode, ours for prefill.

    model = AutoModelForCausalLM.from_pretrained(export_dir, device_map="cuda")
    report = use_int4_kernels(model)          # every Int4TilePackedTo4dTensor linear -> Int4ServingLinear,
                                              # q/k/v and gate/up stacked (stack_siblings=False: not)
    compile_config = prepare_for_serving(model)
    model.generate(ids, cache_implementation="static", compile_config=compile_config, ...)

:class:`Int4ServingLinear` keeps torchao's tile-packed weight as it is (buffers ``qdata`` and ``scale_and_zero``:
ONE copy of the weight, nothing repacked, no extra memory) and calls ``hf_lowbit::int4_tile_linear``
(:func:`hf_lowbit.kernels.int4.int4_tile_linear`): up to 16 rows (decode) ``decode="tinygemm"`` (the default:
``aten._weight_int4pack_mm``, what torchao runs, 3-4x faster than our first GEMV on the H200), ``"triton"`` (our
tile-layout GEMV: 0.45-0.75x tinygemm at one row on the H200), ``"triton_factored"`` (at one row the tile layout's
GEMV with the scale and zero out of the sum, ~4.3 instructions a code against 7.9) or ``"triton_mma"`` (those sums on
tensor cores, up to 16 rows, ~2.5 a code: on the H200 1.7-3.6x tinygemm at 8 rows on the MLP and head shapes, level
with it serving at batch 1);
more rows (prefill) a Triton kernel dequantizes the tile layout to bf16 and cuBLAS multiplies (20-24x tinygemm's
prefill on the H200 with the first layout). Numerics: tinygemm's weight ``bf16((q - 8)·scale + zero)`` (ours forms it
in float32 and rounds once; the two differ only on rare ties; the factored GEMVs do not round it), float32
accumulation in all. Plain buffers: no tensor subclass for Dynamo to guard or AOTAutograd to flatten per call.

Needs torch, Triton (on CUDA) and :mod:`hf_lowbit.kernels.int4` / :mod:`hf_lowbit.swap`; torchao's
``Int4TilePackedTo4dTensor`` is recognised by type name, not imported. Measured on the H200 per linear
(docs/results/int4_mm_h200.md) and served stacked on 32 layers (docs/qat.md § Serving).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.int4 import (
    DECODE_KERNELS,
    TILE_GROUP_SIZES,
    TILE_INNER_K,
    int4_tile_linear,
)
from ..swap import SERVING_FILTER, SwapReport, swap_linears
from .siblings import fuse_siblings, shared_problem

__all__ = ["Int4ServingLinear", "int4_serving_problem", "stack_problem", "use_int4_kernels"]

TINYGEMM_WEIGHT = "Int4TilePackedTo4dTensor"


class Int4ServingLinear(nn.Module):
    """``y = x @ Wᵀ (+ bias)``, ``W`` int4 in tinygemm's tile-packed layout (buffers ``qdata`` int32
    ``[N_pad/8, K_pad/128, 32, 4]`` and ``scale_and_zero`` bf16 ``[K_pad/group_size, N_pad, 2]``, torchao's
    ``Int4TilePackedTo4dTensor`` fields as stored; N padded to a multiple of 8, K of 1024). Inputs of any leading
    shape and floating dtype: computed in bf16 (as tinygemm's linear does), returned in the input's dtype.
    ``decode``: what runs up to 16 rows on CUDA, one of ``DECODE_KERNELS`` (settable after construction)."""

    def __init__(self, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int, in_features: int,
                 out_features: int, bias: torch.Tensor | None = None, decode: str = "tinygemm"):
        super().__init__()
        if decode not in DECODE_KERNELS:
            raise ValueError(f"Int4ServingLinear: decode {decode!r} is not one of {DECODE_KERNELS}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.group_size = int(group_size)
        self.decode = decode
        self.register_buffer("qdata", qdata.contiguous())
        self.register_buffer("scale_and_zero", scale_and_zero.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, decode: str = "tinygemm") -> Int4ServingLinear:
        """From an ``nn.Linear`` whose weight is torchao's ``Int4TilePackedTo4dTensor``: its ``qdata`` and
        ``scale_and_zero`` taken as they are (:func:`int4_serving_problem` says when it cannot)."""
        problem = int4_serving_problem(linear)
        if problem:
            raise ValueError(f"Int4ServingLinear.from_linear: {problem}")
        w = linear.weight
        N, K = w.shape
        return cls(w.qdata, w.scale_and_zero, int(w.block_size[-1]), K, N, linear.bias, decode)

    @classmethod
    def concat(cls, modules: list[Int4ServingLinear]) -> Int4ServingLinear:
        """One linear computing ``modules``' outputs side by side: the tile layout's rows (``qdata``'s first dim, 8
        weight rows a tile row) and ``scale_and_zero``'s columns stacked, so every weight row keeps its codes,
        scale and zero (:func:`stack_problem` says when it cannot)."""
        problem = stack_problem(modules)
        if problem:
            raise ValueError(f"Int4ServingLinear.concat: {problem}")
        first = modules[0]
        bias = None if first.bias is None else torch.cat([m.bias for m in modules])
        return cls(torch.cat([m.qdata for m in modules]), torch.cat([m.scale_and_zero for m in modules], dim=1),
                   first.group_size, first.in_features, sum(m.out_features for m in modules), bias, first.decode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.qdata, self.scale_and_zero, self.out_features, self.bias)

    def forward_rows(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The output features ``start:end`` alone (multiples of 8: whole tile rows), from those rows of the tile
        layout (a view) and a copy of their scales and zeros (columns of ``scale_and_zero``, small): a stacked
        sibling's own product (:mod:`hf_lowbit.qat.siblings`)."""
        if start % 8 or end % 8:
            raise ValueError(f"Int4ServingLinear.forward_rows: rows {start}:{end} are not whole 8-row tiles")
        bias = None if self.bias is None else self.bias[start:end]
        return self._forward(x, self.qdata[start // 8:end // 8], self.scale_and_zero[:, start:end].contiguous(),
                             end - start, bias)

    def _forward(self, x, qdata, scale_and_zero, n, bias):
        shape = x.shape
        y = int4_tile_linear(x.reshape(-1, self.in_features).to(torch.bfloat16), qdata, scale_and_zero,
                             self.group_size, n, self.decode)
        y = y.reshape(*shape[:-1], n)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"decode={self.decode}, bias={self.bias is not None}")


def int4_serving_problem(module: nn.Module) -> str | None:
    """Why ``module`` (an ``nn.Linear``) cannot become an :class:`Int4ServingLinear` (one line), or None when it can
    (as :func:`hf_lowbit.qat.fp8_serving.fp8_serving_problem` for FP8)."""
    weight = module.weight
    wtype = type(weight).__name__
    if wtype != TINYGEMM_WEIGHT:
        return f"weight is {wtype}, not {TINYGEMM_WEIGHT}"
    if weight.device.type != "cuda":
        return f"weight on {weight.device}: tinygemm's tile layout serves on CUDA"
    if weight.qdata.dim() != 4 or weight.qdata.shape[-1] != TILE_INNER_K // 2:
        return f"qdata of shape {tuple(weight.qdata.shape)}, not [N/8, K/128, 32, 4] (inner k tiles 8)"
    if getattr(weight, "act_pre_scale", None) is not None:
        return "weight has an act_pre_scale"
    gs = int(weight.block_size[-1])
    if module.in_features % gs:
        return f"in_features {module.in_features} is not a multiple of group_size {gs}"
    if gs not in TILE_GROUP_SIZES:
        return f"group_size {gs} is not one of tinygemm's {TILE_GROUP_SIZES}"
    return None


def stack_problem(modules: list[Int4ServingLinear]) -> str | None:
    """Why ``modules`` cannot be stacked into one :class:`Int4ServingLinear` (one line), or None: no padded rows
    (``out_features`` a multiple of 8, the tile layout's row block: padding inside the stack would shift the next
    module's rows), then the checks every kind shares (:func:`hf_lowbit.qat.siblings.shared_problem`) with the same
    group size and decode kernel, and one tile shape (torchao's inner k tiles)."""
    for m in modules:
        if m.out_features % 8 or m.qdata.shape[0] * 8 != m.out_features:
            return f"out_features {m.out_features} padded in the tile layout (not a multiple of 8)"
    problem = shared_problem(modules, ("in_features", "group_size", "decode"))
    tiles = {tuple(m.qdata.shape[1:]) for m in modules}  # with one K, only the packing's inner k tiles can differ
    if problem is None and len(tiles) > 1:
        return f"tile layouts differ (qdata tiles {sorted(tiles)})"
    return problem


def use_int4_kernels(model: nn.Module, decode: str = "tinygemm", stack_siblings: bool = True) -> SwapReport:
    """Replace every ``nn.Linear`` of ``model`` whose weight is an ``Int4TilePackedTo4dTensor`` (the LM head too) by
    an :class:`Int4ServingLinear`, in place; the report lists what was swapped and, for the other linears, why not
    (a parametrized one is a subclass: call this before :func:`hf_lowbit.qat.prepare_for_serving`, whose unwrap
    then finds no subclass weights left). The replacement holds the old weight's own ``qdata`` and
    ``scale_and_zero`` (no copy). ``decode``: :class:`Int4ServingLinear`'s. ``stack_siblings`` (default): q/k/v and
    gate/up each served by one call over their stacked weights (:mod:`hf_lowbit.qat.siblings`; the stacked buffers
    replace the siblings' own); ``False``: one linear per module. Stacked is the default because it measured faster
    in the same run on the H200 (32 Llama-8B layers, batch 1, 55d8bf8: 3.06 against 3.34 ms of GPU time a token,
    bf16 5.16; docs/results/serve_int4k_l32_h200.md)."""
    report = swap_linears(model, lambda name, linear: Int4ServingLinear.from_linear(linear, decode),
                          recipe="int4_kernels",
                          target="Int4ServingLinear", filter=SERVING_FILTER, check=int4_serving_problem)
    if stack_siblings:
        fuse_siblings(model, Int4ServingLinear, Int4ServingLinear.concat, stack_problem, report)
    return report
