"""Low-bit kernels: one quantize function and one scaled-matmul custom op per number format."""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import fp8_scaled_mm, quantize_fp8
from .int8 import int8_scaled_mm, quantize_int8
from .quantize_t import quantize_t

FORMATS = {"int8": (quantize_int8, int8_scaled_mm), "fp8": (quantize_fp8, fp8_scaled_mm)}


def scaled_matmul(fmt: str, x: Tensor, x_dim: int, w: Tensor, w_dim: int, out_dtype: torch.dtype) -> Tensor:
    """Quantize two 2-D operands to ``fmt`` along their reduction dims and multiply them.

    ``x`` is reduced over ``x_dim`` and ``w`` over ``w_dim``; the result has ``x``'s other dim as
    rows and ``w``'s other dim as columns. Operands reduced over dim 1 are quantized in plain torch
    (Inductor fuses that with its neighbours); operands reduced over dim 0 go through
    ``hf_lowbit::quantize_t``, which writes them transposed (reduction dim contiguous, the layout
    low-bit tensor cores need).
    """
    quantize, mm = FORMATS[fmt]
    qx, sx = quantize_t(x, fmt) if x_dim == 0 else quantize(x, dim=1)
    qw, sw = quantize_t(w, fmt) if w_dim == 0 else quantize(w, dim=1)
    return mm(qx, qw, sx.reshape(-1), sw.reshape(-1), out_dtype)
