"""``hf_lowbit::quantize_t``: quantize per column (along dim 0) and write the result transposed.

The operands a matmul reduces over their dim 0 (both weight-gradient operands, the weight of the
input-gradient matmul) need one scale per column and the reduction dim contiguous. CUDA runs the
Triton kernels in :mod:`hf_lowbit.ops.triton_quant`; other devices the plain-torch quantize
functions followed by a transposed copy (the reference the kernels are tested against).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS


def _check(x: Tensor, fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantize_t: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if x.dim() != 2:
        raise ValueError(f"quantize_t: x must be 2-D, got shape {tuple(x.shape)}")


@torch.library.custom_op("hf_lowbit::quantize_t", mutates_args=())
def quantize_t(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``x`` [M, N] -> (``q`` [N, M] contiguous, ``scale`` [N] float32) with ``x.T ≈ q * scale[:, None]``."""
    _check(x, fmt)
    q, scale = FORMATS[fmt].quantize(x, dim=0)
    return q.T.contiguous(), scale.reshape(-1)


@quantize_t.register_fake
def _(x, fmt):
    _check(x, fmt)
    return (x.new_empty((x.shape[1], x.shape[0]), dtype=FORMATS[fmt].dtype),
            x.new_empty((x.shape[1],), dtype=torch.float32))


@quantize_t.register_kernel("cuda")
def _(x, fmt):
    from .triton_quant import quantize_t_triton

    _check(x, fmt)
    f = FORMATS[fmt]
    return quantize_t_triton(x, f.dtype, f.qmax)
