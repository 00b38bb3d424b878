"""``hf_lowbit::quantize_dual``: an output gradient quantized per row (times the weight's scales) and per column.

The backward of a low-bit linear needs ``g = dY [M, N]`` twice: per token, as ``g · diag(w_scale)`` (the input
gradient's operand, :func:`hf_lowbit.kernels.scaled_matmul_input_grad`) and per output feature, transposed (the
weight gradient's, ``hf_lowbit::quantize_t``). Done apart that is three reads of ``g``; this op gives both from two
(issue 25). Opt-in: training does not call it yet. CUDA runs the Triton kernels in
:mod:`hf_lowbit.kernels.triton_quant`; other devices the two plain-torch references, which the kernels match bit for
bit (nearest rounding only: stochastic rounding stays with ``quantize_t``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS


def _check(g: Tensor, fmt: str, col_mul: Tensor | None, stochastic: bool) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantize_dual: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if stochastic:
        raise ValueError("quantize_dual: nearest rounding only; stochastic rounding goes through quantize_t")
    if g.dim() != 2:
        raise ValueError(f"quantize_dual: g must be 2-D, got shape {tuple(g.shape)}")
    if col_mul is not None and (col_mul.numel() != g.shape[1] or col_mul.dtype != torch.float32):
        raise ValueError(f"quantize_dual: col_mul must be {g.shape[1]} float32 values, got {tuple(col_mul.shape)} "
                         f"{col_mul.dtype}")


def quantize_dual_reference(g: Tensor, fmt: str,
                            col_mul: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the op computes, in plain torch: the row quantization of the input gradient (Inductor fuses it) and
    ``quantize_t``'s reference, one after the other."""
    f = FORMATS[fmt]
    x = g.float() if col_mul is None else g.float() * col_mul.reshape(1, -1)
    qr, sr = f.quantize(x, dim=1)
    qc, sc = f.quantize(g, dim=0)
    return qr, sr.reshape(-1).contiguous(), qc.T.contiguous(), sc.reshape(-1).contiguous()


@torch.library.triton_op("hf_lowbit::quantize_dual", mutates_args=())
def quantize_dual(g: Tensor, fmt: str, col_mul: Tensor | None = None,
                  stochastic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``g`` [M, N] -> ``(qr [M, N], sr [M], qc [N, M], sc [N])``, codes contiguous, scales float32.

    ``qr, sr``: ``g * col_mul[None, :]`` (product in float32; ``col_mul``: N float32 values, e.g. a weight's row
    scales ``[N, 1]``; None: ones) quantized per row, the bits of ``FORMATS[fmt].quantize(.., dim=1)``. ``qc, sc``:
    ``g`` quantized per column and written transposed, the bits of ``quantize_t(g, fmt)``. A ``triton_op``
    (Inductor launches the kernels from its generated code, no graph break). ``stochastic=True`` raises: nearest
    rounding only."""
    _check(g, fmt, col_mul, stochastic)
    if g.device.type == "cuda" and not FORMATS[fmt].tensorwise:  # the kernels compute one scale per row / column
        from .triton_quant import quantize_dual_triton

        f = FORMATS[fmt]
        mul = None if col_mul is None else col_mul.reshape(-1).contiguous()
        return quantize_dual_triton(g, f.dtype, f.qmax, mul)
    return quantize_dual_reference(g, fmt, col_mul)
