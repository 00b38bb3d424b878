"""Argument checks shared by the scaled-matmul ops (run eagerly, in fake implementations and traced)."""

import torch
from torch import Tensor


def check_scaled_mm_args(op: str, dtype: torch.dtype, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    """``a [M, K]`` and ``b [N, K]`` of ``dtype``, one scale per row of each.

    The messages close over shapes and dtypes only, never tensors: Dynamo traces ``torch._check`` only when
    its message closure holds constants, and breaks the graph otherwise (FP8's direct ``_scaled_mm`` path)."""
    a_shape, b_shape, a_dtype, b_dtype = tuple(a.shape), tuple(b.shape), a.dtype, b.dtype
    torch._check(len(a_shape) == 2 and len(b_shape) == 2, lambda: f"{op}: a and b must be 2-D")
    torch._check(a_dtype == dtype and b_dtype == dtype,
                 lambda: f"{op}: a and b must be {str(dtype).removeprefix('torch.')}, got {a_dtype} and {b_dtype}")
    torch._check(a_shape[1] == b_shape[1],
                 lambda: f"{op}: reduction dims differ: a {a_shape}, b {b_shape} (b is [N, K])")
    torch._check(a_scale.numel() == a_shape[0] and b_scale.numel() == b_shape[0],
                 lambda: f"{op}: a_scale needs one value per row of a, b_scale one per row of b")
