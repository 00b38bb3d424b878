"""Argument checks shared by the scaled-matmul custom ops (run in real and fake implementations)."""

import torch
from torch import Tensor


def check_scaled_mm_args(op: str, dtype: torch.dtype, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    """``a [M, K]`` and ``b [N, K]`` of ``dtype``, one scale per row of each."""
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"{op}: a and b must be 2-D")
    torch._check(a.dtype == dtype and b.dtype == dtype,
                 lambda: f"{op}: a and b must be {str(dtype).removeprefix('torch.')}, got {a.dtype} and {b.dtype}")
    torch._check(a.shape[1] == b.shape[1],
                 lambda: f"{op}: reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b is [N, K])")
    torch._check(a_scale.numel() == a.shape[0] and b_scale.numel() == b.shape[0],
                 lambda: f"{op}: a_scale needs one value per row of a, b_scale one per row of b")
