"""``hf_lowbit::swiglu_quant`` / ``hf_lowbit::swiglu_backward_quant``: a SwiGLU and its row quantizations, one op each.

A Llama MLP's ``h = silu(g) * u`` is the down projection's input, quantized per token; its gradients ``dg``, ``du``
are the gate / up projections' output gradients, quantized per token times those weights' row scales (the input
gradient's operand). Inductor fuses each into one looped-reduction kernel that runs at ~2x its traffic floor over
14,336-wide rows on the H200 (docs/benchmarks.md, "What the 8x2048 layers row would still need"); these ops are the
Triton kernels of :mod:`hf_lowbit.kernels.triton_swiglu` on CUDA and their plain-torch references elsewhere (the
same bits given the rounded SwiGLU values; those may differ from torch's by a step of their dtype where the GPU's
``exp`` does, see that module). Measured against Inductor's fusion by ``benchmarks/benchmark_swiglu.py`` before any
recipe uses them. Nearest rounding, row-scaled formats (INT8, FP8 row-wise) only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS


def _format(fmt: str, op: str):
    f = FORMATS.get(fmt)
    if f is None or f.tensorwise:
        raise ValueError(f"{op}: fmt must be one of {sorted(k for k, v in FORMATS.items() if not v.tensorwise)} "
                         f"(scaled per row), got {fmt!r}")
    return f


def _amax_bits(x: Tensor) -> Tensor:
    """Each column's absmax of ``x`` as int32 float bits (NaN above inf, as the kernels' atomic max)."""
    return (x.float().view(torch.int32) & 0x7FFFFFFF).amax(0)


def swiglu_quant_reference(g: Tensor, u: Tensor, fmt: str, col_amax: bool = False) -> tuple[Tensor, ...]:
    """What :func:`swiglu_quant` computes, in plain torch."""
    f = _format(fmt, "swiglu_quant")
    g32 = g.float()
    h = (g32 * torch.sigmoid(g32) * u.float()).to(g.dtype)
    q, s = f.quantize(h, dim=1)
    amax = _amax_bits(h) if col_amax else torch.zeros(0, dtype=torch.int32, device=g.device)
    return h, q, s.reshape(-1).contiguous(), amax


def swiglu_backward_quant_reference(dh: Tensor, g: Tensor, u: Tensor, fmt: str, mul_g: Tensor | None = None,
                                    mul_u: Tensor | None = None, col_amax: bool = False) -> tuple[Tensor, ...]:
    """What :func:`swiglu_backward_quant` computes, in plain torch (``aten.silu_backward``'s formula in float32)."""
    f = _format(fmt, "swiglu_backward_quant")
    g32, dh32 = g.float(), dh.float()
    sig = torch.sigmoid(g32)
    dg = (dh32 * u.float() * (sig * (1 + g32 * (1 - sig)))).to(g.dtype)
    du = (dh32 * (g32 * sig)).to(g.dtype)
    out = [dg, du]
    for d, mul in ((dg, mul_g), (du, mul_u)):
        q, s = f.quantize(d.float() if mul is None else d.float() * mul.reshape(1, -1), dim=1)
        out += [q, s.reshape(-1).contiguous()]
    if col_amax:
        return (*out, _amax_bits(dg), _amax_bits(du))
    # two empties, not one twice: a custom op's outputs may not alias each other (torch checks it eagerly)
    return (*out, *(torch.zeros(0, dtype=torch.int32, device=g.device) for _ in range(2)))


@torch.library.triton_op("hf_lowbit::swiglu_quant", mutates_args=())
def swiglu_quant(g: Tensor, u: Tensor, fmt: str, col_amax: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(h, q, scale, amax_bits)``: ``h = silu(g) * u`` in ``g``'s dtype, its codes per row ``q [M, N]`` and
    ``scale [M]`` (``fmt``'s :meth:`~hf_lowbit.kernels.formats.Format.quantize` of ``h`` along dim 1, bit for bit),
    and with ``col_amax`` each column's absmax of ``h`` as int32 float bits ``[N]`` (else empty). ``g``, ``u``:
    ``[M, N]``, rows contiguous."""
    f = _format(fmt, "swiglu_quant")
    if g.device.type == "cuda":
        from .triton_swiglu import swiglu_quant_triton

        return swiglu_quant_triton(g, u, f.dtype, f.qmax, col_amax=col_amax)
    return swiglu_quant_reference(g, u, fmt, col_amax)


@torch.library.triton_op("hf_lowbit::swiglu_backward_quant", mutates_args=())
def swiglu_backward_quant(dh: Tensor, g: Tensor, u: Tensor, fmt: str, mul_g: Tensor | None = None,
                          mul_u: Tensor | None = None, col_amax: bool = False
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward of :func:`swiglu_quant`'s ``h`` given ``dh``: ``(dg, du, qg, sg, qu, su, amax_g, amax_u)``:
    ``dg``, ``du`` in ``g``'s dtype; the row codes and scales of ``dg * mul_g`` and ``du * mul_u`` (float32
    ``[N]``: the gate / up weights' row scales, the input gradients' ``dY·diag(s)``; ``dg``, ``du`` themselves
    without them); with ``col_amax`` the column absmax of ``dg``, ``du`` as int32 float bits (else empty)."""
    f = _format(fmt, "swiglu_backward_quant")
    if g.device.type == "cuda":
        from .triton_swiglu import swiglu_backward_quant_triton

        return swiglu_backward_quant_triton(dh, g, u, f.dtype, f.qmax, mul_g, mul_u, col_amax=col_amax)
    return swiglu_backward_quant_reference(dh, g, u, fmt, mul_g, mul_u, col_amax)
