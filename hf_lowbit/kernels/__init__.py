"""Low-bit kernels: one quantize function and one scaled-matmul op per number format.

The formats themselves are records in :mod:`hf_lowbit.kernels.formats` (``FORMATS``, ``get_format``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import analysis_cache
from .accumulate import scaled_mm_accumulate_
from .formats import FORMATS, Format, get_format
from .quantize_dual import quantize_dual
from .quantize_t import quantize_t, quantize_t_shared, shares_codes

analysis_cache.install()  # one TTIR analysis per distinct Triton launch when torch.compile traces ours


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


def quantize_operand(fmt: str, x: Tensor, dim: int, stochastic: bool = False,
                     shared: bool = False) -> tuple[Tensor, Tensor]:
    """``x`` quantized along ``dim`` with its reduction dim contiguous: ``(q [other, dim], scale [other])``.

    ``stochastic`` (INT8 only): stochastic rounding. The column layout is ``hf_lowbit::quantize_t``, whose
    Triton kernel draws the random numbers in registers; the row layout is plain torch (``torch.rand_like``,
    which in a compiled layer cost memory on the H200 — the layer's own input gradient therefore rounds
    through ``quantize_t`` instead, :func:`scaled_matmul_input_grad`). ``shared``: sibling layers quantize
    this same tensor the same way (a layer's input X, per column, for the weight gradient): on CUDA the column
    layout then goes through ``hf_lowbit::quantize_t_shared``, which a compiled graph computes once for all of
    them (nearest rounding only: stochastic codes are drawn per layer). A tensorwise format's column layout is plain
    torch on every device (the row codes transposed; CSE merges the siblings' identical ones)."""
    if stochastic and fmt != "int8":
        raise ValueError(f"stochastic rounding is implemented for INT8, not {fmt!r}")
    if dim == 0 and FORMATS[fmt].tensorwise:  # the same codes in both layouts: a cast + transpose Inductor fuses
        q, s = FORMATS[fmt].quantize(x, dim=0)
        return q.T.contiguous(), s.reshape(-1).contiguous()
    if dim == 0:
        if shared and not stochastic and shares_codes(x):
            return quantize_t_shared(x, fmt)
        return quantize_t(x, fmt, stochastic)
    q, s = FORMATS[fmt].quantize(x, dim=1, stochastic=True) if stochastic else FORMATS[fmt].quantize(x, dim=1)
    return q, s.reshape(-1).contiguous()  # a tensorwise scale is an expanded view: callers store and write into it


def scaled_matmul_quantized(fmt: str, x: Tensor, x_dim: int, qw: Tensor, sw: Tensor, out_dtype: torch.dtype,
                            stochastic: bool = False, add: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """:func:`scaled_matmul` with the second operand already quantized (``qw [N, K]``, ``sw [N]``). ``add``:
    ``(c [M, R], d [N, R])``, a low-rank ``c @ d.T`` added in the matmul's epilogue (INT8 only: a LoRA branch)."""
    qx, sx = quantize_operand(fmt, x, x_dim, stochastic)
    if add is None:
        return FORMATS[fmt].scaled_mm(qx, qw, sx, sw, out_dtype)
    if fmt != "int8":
        raise ValueError(f"scaled_matmul_quantized: a low-rank addend is implemented for INT8, not {fmt!r}")
    return FORMATS[fmt].scaled_mm(qx, qw, sx, sw, out_dtype, *add)


def scaled_matmul_accumulate(fmt: str, acc: Tensor, x: Tensor, x_dim: int, qw: Tensor, sw: Tensor,
                             stochastic: bool = False) -> None:
    """:func:`scaled_matmul_quantized` added into ``acc`` in place (the sum in float32, rounded once):
    ``hf_lowbit::scaled_mm_accumulate_``, a weight gradient accumulated across micro-batches in the matmul's
    epilogue instead of by a separate add."""
    qx, sx = quantize_operand(fmt, x, x_dim, stochastic)
    scaled_mm_accumulate_(acc, qx, qw, sx, sw)


def quantize_weight_t(fmt: str, w: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``w [N, K]`` quantized per output row (the forward's quantization) and written transposed:
    ``(qt [K, N] contiguous, scale [N])`` with ``w ≈ diag(scale) · qt.T``, the operand of
    :func:`scaled_matmul_input_grad`. ``scale``: the row scales already computed (the forward's), so the
    codes are re-encoded in one read of ``w`` with no absmax pass; plain torch, fused by Inductor."""
    f = FORMATS[fmt]
    if scale is None:
        q, scale = f.quantize(w, dim=1)
    else:
        q = f.encode(w, scale.reshape(-1, 1))
    return q.T.contiguous(), scale.reshape(-1)


def scaled_matmul_input_grad(fmt: str, g: Tensor, qw_t: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
                             stochastic: bool = False, add: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The input gradient ``dX = dY · W`` of ``Y = X · Wᵀ`` with the weight in its forward quantization,
    ``W ≈ diag(s) · Wq`` (per output row): ``dX = q(dY · diag(s)) · Wq``.

    The weight's row scales lie along this matmul's reduction dim, so they cannot go in the epilogue; folded
    into ``dY`` before its per-token quantization they cost nothing (Inductor fuses the multiply), and the
    weight needs no second, per-input-channel quantization: only its codes transposed (``qw_t [K, N]``, from
    :func:`quantize_weight_t`). ``g [M, N]``; ``stochastic``: stochastic rounding of the scaled ``dY``, through
    ``hf_lowbit::quantize_t`` on ``g``'s transposed view (row-wise quantization, the product and the random
    numbers in registers; the plain-torch form measured 144 MiB more peak memory than nearest rounding in a
    compiled 8192×2048→5632 linear on the H200). ``add``: a low-rank addend for the epilogue, as in
    :func:`scaled_matmul_quantized` (a LoRA branch's ``dH · A``)."""
    ones = torch.ones(qw_t.shape[0], dtype=torch.float32, device=qw_t.device)
    if stochastic:  # the Triton kernel forms dY·diag(s) and draws the random numbers in registers
        if add is not None:
            raise ValueError("scaled_matmul_input_grad: the addend is not implemented with stochastic rounding")
        qg, sg = quantize_t(g.T, fmt, True, w_scale.reshape(-1).float())
        return FORMATS[fmt].scaled_mm(qg, qw_t, sg, ones, out_dtype)
    return scaled_matmul_quantized(fmt, g.float() * w_scale.reshape(1, -1), 1, qw_t, ones, out_dtype, add=add)


def scaled_matmul_grads(fmt: str, g: Tensor, qw_t: Tensor, w_scale: Tensor, x: Tensor | tuple[Tensor, Tensor],
                        dx_dtype: torch.dtype, dw_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Both gradients of ``Y = X · Wᵀ`` with ``g = dY [M, N]`` quantized once for the two of them by
    ``hf_lowbit::quantize_dual`` (two reads of ``g`` instead of three): ``(dX [M, K], dW [N, K])``, the bits of
    :func:`scaled_matmul_input_grad` ``(fmt, g, qw_t, w_scale, dx_dtype)`` and of :func:`scaled_matmul`
    ``(fmt, g, 0, x, 0, dw_dtype)`` (nearest rounding only). ``qw_t [K, N]``, ``w_scale [N]``: the weight's
    forward codes transposed and its row scales (:func:`quantize_weight_t`); ``x [M, K]``, or already quantized
    per column (``quantize_operand(fmt, x, 0)``: ``(codes [K, M], scales [K])``). The codes of ``g`` in
    both layouts are alive together (``M·N`` bytes more than the split path at the input gradient's matmul)."""
    f = FORMATS[fmt]
    qr, sr, qc, sc = quantize_dual(g, fmt, w_scale.reshape(-1).float())  # tensorwise: its plain-torch reference
    ones = torch.ones(qw_t.shape[0], dtype=torch.float32, device=qw_t.device)
    dx = f.scaled_mm(qr, qw_t, sr, ones, dx_dtype)
    qx, sx = x if isinstance(x, tuple) else quantize_operand(fmt, x, 0, shared=True)
    return dx, f.scaled_mm(qc, qx, sc, sx, dw_dtype)


# quantize_weight's kernels on CUDA, per format: the rows kernel for both. Its FP8 transposed codes once came out
# wrong on the H200 (Triton 3.6) at a Llama layer's shapes (trainer_grad_check at 47a45b8: ~107M of 436M of the
# cache's transposed codes differing, FP8 through the Trainer with accumulation diverging), from a ptxas miscompile
# of the fp32 -> e4m3 conversion's transposed store (see _quantize_rows_kernel). Its FP8 codes are built with integer
# ops since; at cc5925f test_weight_refresh_llama_shapes_cuda and test_quantize_t_llama_shapes_cuda pass for it on the
# H200 and trainer_grad_check's rows refresh leaves no code differing. "two_kernel" stays selectable here
WEIGHT_VARIANT = {"int8": "rows", "fp8": "rows"}


@torch.no_grad()
def quantize_weight(fmt: str, w: Tensor, out: tuple[Tensor, ...] | None = None, row_amax: Tensor | None = None,
                    **kernel: object) -> tuple[Tensor, ...]:
    """Everything a linear's weight ``w [N, K]`` takes part in, from one call: ``(q [N, K], scale [N])`` per
    output row (the forward's operand, the same bits as :func:`quantize_operand` ``(w, 1)``) and the same codes
    transposed, ``qt [K, N]`` (the input gradient's, :func:`scaled_matmul_input_grad`). ``out``: three
    preallocated tensors to write into (in place, so CUDA graphs that read them stay valid). ``kernel``: on CUDA,
    which Triton kernels and tiles (``variant``, ``tiles``, ... of
    :func:`hf_lowbit.kernels.triton_quant.quantize_t_triton`), all meant to give the same bits; default:
    ``WEIGHT_VARIANT[fmt]`` (the row-wise kernel, ``variant="rows"``: contiguous loads along each weight row,
    1.45x the two-kernel path over a Llama-8B layer on the H200 for INT8; see ``WEIGHT_VARIANT``); unused off
    CUDA (plain torch). A tensorwise format takes the rows kernel with one scale (``tensorwise=True``): in plain
    torch, run eagerly here, its refresh was ~6 unfused kernels a weight (~30 ms a step for 8 Llama-8B layers at
    1x2048 with accumulation 8 on the H200, session 17's profile, against the rows kernel's ~5 ms).
    ``row_amax``: each row's absmax of ``w`` as it is now, int32 float bits ``[N]`` (left by
    :func:`hf_lowbit.kernels.adamw.adamw_rows_`, the optimizer pass that wrote ``w``): on CUDA the rows kernel then
    reads ``w`` once; per-row formats only; the plain-torch path computes the same absmax itself."""
    if w.is_cuda:
        from torch._library.triton import set_wrap_triton_enabled

        from .triton_quant import quantize_t_triton

        f = FORMATS[fmt]
        if f.tensorwise:
            if kernel.get("variant", "rows") != "rows":
                raise ValueError(f"quantize_weight: {fmt} (one scale per tensor) is refreshed by the rows kernel "
                                 f"only, got variant={kernel['variant']!r}")
            kernel = {**kernel, "variant": "rows", "tensorwise": True}
        if row_amax is not None:
            if f.tensorwise:
                raise ValueError(f"quantize_weight: row_amax is for formats scaled per row, not {fmt!r}")
            kernel = {"variant": "rows", **kernel, "row_amax": row_amax}
        # eagerly (this runs outside compiled graphs, after optimizer steps) launch the kernels directly:
        # wrap_triton's dispatch costs ~1 ms a launch, which made a refresh of 8 Llama-8B layers ~70 ms. Both
        # layouts come from one pass (the transposed codes are stored from the same registers)
        with set_wrap_triton_enabled(False):
            return quantize_t_triton(w.T, f.dtype, f.qmax, out=out, both_layouts=True,
                                     **(kernel or {"variant": WEIGHT_VARIANT[fmt]}))
    q, s = quantize_operand(fmt, w, 1)
    if out is not None:
        q, s = out[0].copy_(q), out[1].copy_(s)
    return q, s, (q.T.contiguous() if out is None else out[2].copy_(q.T))


__all__ = ["FORMATS", "Format", "get_format", "scaled_matmul", "scaled_matmul_quantized", "quantize_operand",
           "quantize_weight", "quantize_weight_t", "scaled_matmul_accumulate", "scaled_mm_accumulate_",
           "scaled_matmul_input_grad", "scaled_matmul_grads", "quantize_t", "quantize_t_shared", "quantize_dual"]
