"""``hf_lowbit::scaled_mm_accumulate_``: a weight gradient's scaled low-bit matmul added into its accumulator in place.

With gradient accumulation autograd writes each micro-batch's weight gradient to a new tensor and then adds it to
``.grad`` in a separate kernel: for a bf16 weight 2 bytes written by the matmul, then 6 more read and written by the
add, per weight element and micro-batch (on the H200, 8 Llama-8B-shaped layers at 1x2048 tokens with accumulation 8:
~20 ms of a ~300-400 ms step in every recipe, bf16 included; docs/benchmarks.md). Here the matmul's epilogue reads the
accumulator and writes the sum, 4 bytes an element in all, and rounds once (the product and the running sum added in
float32). :class:`hf_lowbit.mixed_precision.FusedGradAccumulation` says where it is used and how ``.grad`` stays the
accumulator.

CUDA runs :func:`hf_lowbit.kernels.triton_int8.scaled_mm_accumulate_triton` (INT8 or FP8 codes); other devices the
plain-torch reference below, which is the arithmetic the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE
from .int8 import int8_mm_reference

_CODES = (torch.int8, FP8_DTYPE)


def _check(acc: Tensor, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    op = "scaled_mm_accumulate_"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise RuntimeError(f"{op}: a [M, K] and b [N, K] expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in _CODES:
        raise RuntimeError(f"{op}: a and b must both be int8 or both float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if tuple(acc.shape) != (a.shape[0], b.shape[0]) or not acc.is_floating_point():
        raise RuntimeError(f"{op}: acc must be a floating [M={a.shape[0]}, N={b.shape[0]}] tensor, got "
                           f"{tuple(acc.shape)} {acc.dtype}")
    if a_scale.numel() != a.shape[0] or b_scale.numel() != b.shape[0]:
        raise RuntimeError(f"{op}: a_scale needs one value per row of a ({a.shape[0]}), b_scale one per row of b "
                           f"({b.shape[0]}); got {a_scale.numel()} and {b_scale.numel()}")


def scaled_mm_accumulate_reference(acc: Tensor, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> Tensor:
    """What the op writes into ``acc``, as a new tensor: ``acc`` plus the scaled product, added in float32 and
    rounded to ``acc``'s dtype once. The product is exact (INT8: int32 sums; FP8: e4m3 products
    are exact in float32, summed in float32)."""
    prod = int8_mm_reference(a, b).float() if a.dtype == torch.int8 else a.float() @ b.float().T
    out = prod * a_scale.reshape(-1, 1).float() * b_scale.reshape(1, -1).float()
    return (acc.float() + out).to(acc.dtype)


@torch.library.triton_op("hf_lowbit::scaled_mm_accumulate_", mutates_args=("acc",))
def scaled_mm_accumulate_(acc: Tensor, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    """``acc += (a @ b.T) * a_scale[:, None] * b_scale[None, :]``, in place, the sum in float32 rounded once.

    ``a [M, K]``, ``b [N, K]``: int8 or float8_e4m3fn codes, any strides; scales float32, one per row; ``acc [M, N]``
    floating (the gradient's dtype), any strides. A ``triton_op`` that mutates ``acc``: under ``torch.compile`` its
    kernel writes straight into the accumulator, a graph input (AOTAutograd keeps mutations of forward inputs made in
    the backward in the graph; Inductor writes in place instead of copying)."""
    _check(acc, a, b, a_scale, b_scale)
    if a.device.type == "cuda":
        from .triton_int8 import scaled_mm_accumulate_triton

        scaled_mm_accumulate_triton(acc, a, b, a_scale, b_scale)
        return
    acc.copy_(scaled_mm_accumulate_reference(acc, a, b, a_scale, b_scale))
