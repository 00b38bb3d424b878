"""Low-bit kernels: one quantize function and one scaled-matmul custom op per number format."""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import fp8_scaled_mm, quantize_fp8
from .int8 import int8_scaled_mm, quantize_int8

FORMATS = {"int8": (quantize_int8, int8_scaled_mm), "fp8": (quantize_fp8, fp8_scaled_mm)}


def scaled_matmul(fmt: str, x: Tensor, x_dim: int, w: Tensor, w_dim: int, out_dtype: torch.dtype) -> Tensor:
    """Quantize two 2-D operands to ``fmt`` along their reduction dims and multiply them.

    ``x`` is reduced over ``x_dim`` and ``w`` over ``w_dim``; the result has ``x``'s other dim as
    rows and ``w``'s other dim as columns. Operands reduced over dim 0 are written transposed
    (reduction dim contiguous), the layout low-bit tensor cores need; under ``torch.compile`` the
    transpose is fused into the quantization kernel.
    """
    quantize, mm = FORMATS[fmt]
    qx, sx = quantize(x, dim=x_dim)
    qw, sw = quantize(w, dim=w_dim)
    if x_dim == 0:
        qx, sx = qx.T.contiguous(), sx.T
    if w_dim == 0:
        qw, sw = qw.T.contiguous(), sw.T
    return mm(qx, qw, sx.reshape(-1), sw.reshape(-1), out_dtype)
