"""Argument checks shared by the scaled-matmul ops (run eagerly, in fake implementations and traced)."""

import torch
from torch import Tensor


def check_scaled_mm_args(op: str, dtype: torch.dtype, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    """``a [M, K]`` and ``b [N, K]`` of ``dtype``, one scale per row of each.

    Plain ``if``/``raise`` on shapes and dtypes, not ``torch._check``: Dynamo evaluates these at trace time
    (static shapes; dynamic ones become guards) without a graph break, where torch 2.11's Dynamo broke the
    graph at every ``torch._check`` whose message is a closure ("Can't extract message from torch._check()",
    FP8's direct ``_scaled_mm`` path: 10 breaks per linear)."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"{op}: a and b must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    if a.dtype != dtype or b.dtype != dtype:
        raise RuntimeError(f"{op}: a and b must be {str(dtype).removeprefix('torch.')}, got {a.dtype} and {b.dtype}")
    if a.shape[1] != b.shape[1]:
        raise RuntimeError(f"{op}: reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b is [N, K])")
    if a_scale.numel() != a.shape[0] or b_scale.numel() != b.shape[0]:
        raise RuntimeError(f"{op}: a_scale needs one value per row of a, b_scale one per row of b")
