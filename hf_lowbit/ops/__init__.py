"""Low-bit kernels: one quantize function and one scaled-matmul op per number format.

The formats themselves are records in :mod:`hf_lowbit.ops.formats` (``FORMATS``, ``get_format``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS, Format, get_format
from .quantize_t import quantize_t


def scaled_matmul(fmt: str, x: Tensor, x_dim: int, w: Tensor, w_dim: int, out_dtype: torch.dtype,
                  stochastic: tuple[bool, bool] = (False, False)) -> Tensor:
    """Quantize two 2-D operands to ``fmt`` along their reduction dims and multiply them.

    ``x`` is reduced over ``x_dim`` and ``w`` over ``w_dim``; the result has ``x``'s other dim as
    rows and ``w``'s other dim as columns. Operands reduced over dim 1 are quantized in plain torch
    (Inductor fuses that with its neighbours); operands reduced over dim 0 go through
    ``hf_lowbit::quantize_t``, which writes them transposed (reduction dim contiguous, the layout
    low-bit tensor cores need).
    """
    qw, sw = quantize_operand(fmt, w, w_dim, stochastic[1])
    return scaled_matmul_quantized(fmt, x, x_dim, qw, sw, out_dtype, stochastic[0])


def quantize_operand(fmt: str, x: Tensor, dim: int, stochastic: bool = False) -> tuple[Tensor, Tensor]:
    """``x`` quantized along ``dim`` with its reduction dim contiguous: ``(q [other, dim], scale [other])``.

    ``stochastic`` (INT8 only): stochastic rounding. The row layout is plain torch (under ``torch.compile``
    Inductor draws the random numbers inside its fused quantization kernel); the column layout is
    ``hf_lowbit::quantize_t``, whose Triton kernel draws them in registers. Neither materializes a random
    tensor when compiled."""
    if stochastic and fmt != "int8":
        raise ValueError(f"stochastic rounding is implemented for INT8, not {fmt!r}")
    if dim == 0:
        return quantize_t(x, fmt, stochastic)
    q, s = FORMATS[fmt].quantize(x, dim=1, stochastic=True) if stochastic else FORMATS[fmt].quantize(x, dim=1)
    return q, s.reshape(-1)


def scaled_matmul_quantized(fmt: str, x: Tensor, x_dim: int, qw: Tensor, sw: Tensor, out_dtype: torch.dtype,
                            stochastic: bool = False) -> Tensor:
    """:func:`scaled_matmul` with the second operand already quantized (``qw [N, K]``, ``sw [N]``)."""
    qx, sx = quantize_operand(fmt, x, x_dim, stochastic)
    return FORMATS[fmt].scaled_mm(qx, qw, sx, sw, out_dtype)


@torch.no_grad()
def quantize_weight(fmt: str, w: Tensor, out: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
    """Both layouts a linear's weight ``w [N, K]`` takes part in, from one call:
    ``(q [N, K], scale [N])`` per output channel (forward) and ``(qt [K, N], scale_t [K])`` per input
    channel (input gradient), the same bits as :func:`quantize_operand` gives each. ``out``: four
    preallocated tensors to write into (in place, so CUDA graphs that read them stay valid)."""
    if w.is_cuda:
        from torch._library.triton import set_wrap_triton_enabled

        from .triton_quant import quantize_t_triton

        f = FORMATS[fmt]
        # eagerly (this runs outside compiled graphs, after optimizer steps) launch the kernels directly:
        # wrap_triton's dispatch costs ~1 ms a launch, which made a refresh of 8 Llama-8B layers ~70 ms
        with set_wrap_triton_enabled(False):
            q, s = quantize_t_triton(w.T, f.dtype, f.qmax, out=None if out is None else out[:2])
            qt, st = quantize_t_triton(w, f.dtype, f.qmax, out=None if out is None else out[2:])
        return q, s, qt, st
    got = (*quantize_operand(fmt, w, 1), *quantize_operand(fmt, w, 0))
    if out is None:
        return got
    for dst, src in zip(out, got):
        dst.copy_(src)
    return out


__all__ = ["FORMATS", "Format", "get_format", "scaled_matmul", "scaled_matmul_quantized", "quantize_operand",
           "quantize_weight", "quantize_t"]
