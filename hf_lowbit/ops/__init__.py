"""Low-bit kernels: one quantize function and one scaled-matmul custom op per number format.

The formats themselves are records in :mod:`hf_lowbit.ops.formats` (``FORMATS``, ``get_format``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS, Format, get_format
from .quantize_t import quantize_t


def scaled_matmul(fmt: str, x: Tensor, x_dim: int, w: Tensor, w_dim: int, out_dtype: torch.dtype) -> Tensor:
    """Quantize two 2-D operands to ``fmt`` along their reduction dims and multiply them.

    ``x`` is reduced over ``x_dim`` and ``w`` over ``w_dim``; the result has ``x``'s other dim as
    rows and ``w``'s other dim as columns. Operands reduced over dim 1 are quantized in plain torch
    (Inductor fuses that with its neighbours); operands reduced over dim 0 go through
    ``hf_lowbit::quantize_t``, which writes them transposed (reduction dim contiguous, the layout
    low-bit tensor cores need).
    """
    f = FORMATS[fmt]
    qx, sx = quantize_t(x, fmt) if x_dim == 0 else f.quantize(x, dim=1)
    qw, sw = quantize_t(w, fmt) if w_dim == 0 else f.quantize(w, dim=1)
    return f.scaled_mm(qx, qw, sx.reshape(-1), sw.reshape(-1), out_dtype)


__all__ = ["FORMATS", "Format", "get_format", "scaled_matmul", "quantize_t"]
