"""Triton SwiGLU with its row quantizations: a Llama MLP's activation and its gradient, each in one kernel.

In a low-bit decoder layer the SwiGLU's output ``h = silu(g) * u`` is the down projection's input, quantized per
token (row), and its gradients ``dg``, ``du`` are the gate / up projections' output gradients, quantized per token
times their weights' row scales (the input gradient's ``q(dY·diag(s))``, :func:`hf_lowbit.kernels.
scaled_matmul_input_grad`). Inductor fuses each of these into one kernel, but over 14,336-wide rows it generates a
looped reduction (``triton_red``) that reads and recomputes its inputs twice: on the H200 (``layers_b8_cast``'s
profile, 8x2048 tokens) the backward one took 1.40 ms a call against bf16's plain SwiGLU backward's 0.54 and a
traffic floor of 0.65, the forward one 0.69 against 0.32 / 0.38 (docs/benchmarks.md, "What the 8x2048 layers row
would still need"). Here one program owns ``BLOCK_R`` whole rows:

- pass 1 reads ``g``, ``u`` (and ``dh``) once, computes in float32, rounds the results to their dtype, stores them
  and keeps each row's absmax of the rounded values (times the row multiplier), as int32 bits (NaN above inf);
- pass 2 (skipped when a row fits one tile, ``BLOCK_N >= N``: the codes come from the registers) reads back the
  rounded values it stored, backwards, so that it starts on what pass 1 left in L2, and encodes them.

The codes are those of :func:`hf_lowbit.kernels.formats.Format.quantize` of the rounded results (per row: absmax
/ qmax, IEEE-rounded division as :func:`_div_rcp`, nearest rounding), bit for bit; FP8 by the hardware cast on a GPU
(``_encode_q``'s ``NATIVE``, the same bits). ``COL_AMAX``: also each column's absmax of the rounded results, merged
by an atomic integer max into a zeroed ``[N]`` int32 buffer (the weight gradient's column scales, which
:func:`hf_lowbit.kernels.triton_quant.quantize_t_triton` then takes as ``col_amax`` and reads its operand once).

The float32 SiLU is ``g * sigmoid(g)``; its derivative ``sigmoid(g) * (1 + g * (1 - sigmoid(g)))`` as
``aten.silu_backward``. These may differ from torch's own kernels in the last bit of float32 (``exp``), so a
rounded result can differ from torch's by one step of its dtype; the codes are exact given the rounded results
(tests/_triton_checks.py checks both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import on_operand_device
from .triton_int4 import _round_bf16
from .triton_quant import _abs_bits, _div_rcp, _encode_q, _rcp_of, _scale_of, _tiles, native_fp8_cast

# (BLOCK_R, BLOCK_N, num_warps) on CUDA: first guesses, to be swept (benchmarks/benchmark_swiglu.py). A row of a
# Llama-8B MLP is 14,336 wide: BLOCK_N = 16384 holds it in one tile (one pass, no re-read), 2048 loops over it.
# With the column absmax a program issues one atomic per column of each tile, so it owns many rows (one row a program
# would be one atomic an element): its own defaults
_FWD_TILES = (1, 2048, 8)
_BWD_TILES = (1, 2048, 8)
_COL_TILES = (16, 256, 8)
_CPU_TILES = (2, 16, 4)


@triton.jit
def _row_codes(y, offs_n, mask, scale, q_ptr, row_off, N, mul_ptr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
               NATIVE_FP8: tl.constexpr, HAS_MUL: tl.constexpr):
    """Encode the tile ``y`` (rounded values in float32; times ``mul [N]`` with ``HAS_MUL``) of rows whose scales
    are ``scale`` and store the codes at ``q_ptr + row_off + offs_n``."""
    if HAS_MUL:
        y = y * tl.load(mul_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    s, r, pre = _rcp_of(scale)
    q = _encode_q(_div_rcp(y, s[:, None], r[:, None], pre[:, None]), 0, 0, QMAX, IS_INT8, False, True, NATIVE_FP8)
    tl.store(q_ptr + row_off + offs_n[None, :], q, mask=mask)


@triton.jit
def _rounded(v, ty: tl.constexpr, SOFT: tl.constexpr):
    """float32 ``v`` rounded to ``ty`` (nearest even), returned in float32. ``SOFT`` (Triton's interpreter, whose
    cast to bf16 truncates): bf16 rounded by hand (:func:`hf_lowbit.kernels.triton_int4._round_bf16`)."""
    if SOFT and ty == tl.bfloat16:
        return _round_bf16(v, True)
    else:
        return v.to(ty).to(tl.float32)


@triton.jit
def _swiglu_tile(g_ptr, u_ptr, h_ptr, rows, offs_n, mask, stride_gm, stride_um, stride_hm, SOFT: tl.constexpr):
    """``h = silu(g) * u`` of one tile, rounded to ``h``'s dtype and stored; returned in float32."""
    g = tl.load(g_ptr + rows[:, None] * stride_gm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    h = _rounded(g * tl.sigmoid(g) * u, h_ptr.dtype.element_ty, SOFT)
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    return h


@triton.jit
def _row_block(M, BLOCK_R: tl.constexpr):
    """This program's rows: their indices, mask and 64-bit indices (row offsets past 2**31 elements)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return offs_r, offs_r < M, offs_r.to(tl.int64)


@triton.jit
def _columns(n0, N, mask_r, BLOCK_N: tl.constexpr):
    """The tile's columns from ``n0`` and the tile's mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return offs_n, mask_r[:, None] & (offs_n[None, :] < N)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, camax_ptr, M, N, stride_gm, stride_um, stride_hm,
                         QMAX: tl.constexpr, IS_INT8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                         COL_AMAX: tl.constexpr, ONE_TILE: tl.constexpr, SOFT: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward: ``h = silu(g) * u`` in ``h``'s dtype and its row codes ``q [M, N]`` (contiguous), scales ``s [M]``.
    ``ONE_TILE``: ``BLOCK_N >= N``, a row in one tile (encoded from the registers)."""
    offs_r, mask_r, rows = _row_block(M, BLOCK_R)
    if ONE_TILE:
        offs_n, mask = _columns(0, N, mask_r, BLOCK_N)
        h = _swiglu_tile(g_ptr, u_ptr, h_ptr, rows, offs_n, mask, stride_gm, stride_um, stride_hm, SOFT)
        bits = _abs_bits(h)
        if COL_AMAX:
            tl.atomic_max(camax_ptr + offs_n, tl.max(bits, axis=0), mask=offs_n < N, sem="relaxed")
        scale = _scale_of(tl.max(bits, axis=1).to(tl.float32, bitcast=True), QMAX)
        tl.store(s_ptr + offs_r, scale, mask=mask_r)
        _row_codes(h, offs_n, mask, scale, q_ptr, rows[:, None] * N, N, s_ptr, QMAX, IS_INT8, NATIVE_FP8, False)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.int32)
        for n0 in range(0, N, BLOCK_N):
            offs_n, mask = _columns(n0, N, mask_r, BLOCK_N)
            h = _swiglu_tile(g_ptr, u_ptr, h_ptr, rows, offs_n, mask, stride_gm, stride_um, stride_hm, SOFT)
            bits = _abs_bits(h)
            acc = tl.maximum(acc, bits)
            if COL_AMAX:
                tl.atomic_max(camax_ptr + offs_n, tl.max(bits, axis=0), mask=offs_n < N, sem="relaxed")
        scale = _scale_of(tl.max(acc, axis=1).to(tl.float32, bitcast=True), QMAX)
        tl.store(s_ptr + offs_r, scale, mask=mask_r)
        tl.debug_barrier()  # pass 1's stores seen by every thread of the program
        n_blocks = tl.cdiv(N, BLOCK_N)
        for i in range(0, n_blocks):  # backwards: the columns stored last are the likeliest in L2
            offs_n, mask = _columns((n_blocks - 1 - i) * BLOCK_N, N, mask_r, BLOCK_N)
            h = tl.load(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            _row_codes(h, offs_n, mask, scale, q_ptr, rows[:, None] * N, N, s_ptr, QMAX, IS_INT8, NATIVE_FP8, False)


@triton.jit
def _swiglu_backward_tile(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, rows, offs_n, mask, stride_dhm, stride_gm,
                          stride_um, stride_dgm, stride_dum, SOFT: tl.constexpr):
    """``dg``, ``du`` of one tile, rounded to their dtypes and stored; returned in float32."""
    dh = tl.load(dh_ptr + rows[:, None] * stride_dhm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_gm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = _rounded(dh * u * (sig * (1.0 + g * (1.0 - sig))), dg_ptr.dtype.element_ty, SOFT)
    du = _rounded(dh * (g * sig), du_ptr.dtype.element_ty, SOFT)
    tl.store(dg_ptr + rows[:, None] * stride_dgm + offs_n[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows[:, None] * stride_dum + offs_n[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)
    return dg, du


@triton.jit
def _scaled_bits(y, offs_n, N, mul_ptr, HAS_MUL: tl.constexpr):
    """``|y * mul|`` (or ``|y|``) as int32 bits (:func:`_abs_bits`)."""
    if HAS_MUL:
        y = y * tl.load(mul_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    return _abs_bits(y)


@triton.jit
def _swiglu_backward_quant_kernel(dh_ptr, g_ptr, u_ptr, mg_ptr, mu_ptr, dg_ptr, du_ptr, qg_ptr, qu_ptr, sg_ptr,
                                  su_ptr, cg_ptr, cu_ptr, M, N, stride_dhm, stride_gm, stride_um, stride_dgm,
                                  stride_dum, QMAX: tl.constexpr, IS_INT8: tl.constexpr, NATIVE_FP8: tl.constexpr,
                                  HAS_MUL: tl.constexpr, COL_AMAX: tl.constexpr, ONE_TILE: tl.constexpr,
                                  SOFT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Backward of ``h = silu(g) * u`` given ``dh``: ``dg``, ``du`` in their dtype and the row codes of
    ``dg * mg``, ``du * mu`` (``mg``, ``mu`` [N] float32, the gate / up weights' row scales, with ``HAS_MUL``);
    ``COL_AMAX``: the column absmax of ``dg``, ``du`` themselves (the weight gradients' operands)."""
    offs_r, mask_r, rows = _row_block(M, BLOCK_R)
    if ONE_TILE:
        offs_n, mask = _columns(0, N, mask_r, BLOCK_N)
        dg, du = _swiglu_backward_tile(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, rows, offs_n, mask, stride_dhm,
                                       stride_gm, stride_um, stride_dgm, stride_dum, SOFT)
        if COL_AMAX:
            tl.atomic_max(cg_ptr + offs_n, tl.max(_abs_bits(dg), axis=0), mask=offs_n < N, sem="relaxed")
            tl.atomic_max(cu_ptr + offs_n, tl.max(_abs_bits(du), axis=0), mask=offs_n < N, sem="relaxed")
        scale_g = _scale_of(tl.max(_scaled_bits(dg, offs_n, N, mg_ptr, HAS_MUL), axis=1).to(tl.float32,
                                                                                              bitcast=True), QMAX)
        scale_u = _scale_of(tl.max(_scaled_bits(du, offs_n, N, mu_ptr, HAS_MUL), axis=1).to(tl.float32,
                                                                                              bitcast=True), QMAX)
        tl.store(sg_ptr + offs_r, scale_g, mask=mask_r)
        tl.store(su_ptr + offs_r, scale_u, mask=mask_r)
        _row_codes(dg, offs_n, mask, scale_g, qg_ptr, rows[:, None] * N, N, mg_ptr, QMAX, IS_INT8, NATIVE_FP8, HAS_MUL)
        _row_codes(du, offs_n, mask, scale_u, qu_ptr, rows[:, None] * N, N, mu_ptr, QMAX, IS_INT8, NATIVE_FP8, HAS_MUL)
    else:
        acc_g = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.int32)
        acc_u = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.int32)
        for n0 in range(0, N, BLOCK_N):
            offs_n, mask = _columns(n0, N, mask_r, BLOCK_N)
            dg, du = _swiglu_backward_tile(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, rows, offs_n, mask, stride_dhm,
                                           stride_gm, stride_um, stride_dgm, stride_dum, SOFT)
            if COL_AMAX:
                tl.atomic_max(cg_ptr + offs_n, tl.max(_abs_bits(dg), axis=0), mask=offs_n < N, sem="relaxed")
                tl.atomic_max(cu_ptr + offs_n, tl.max(_abs_bits(du), axis=0), mask=offs_n < N, sem="relaxed")
            acc_g = tl.maximum(acc_g, _scaled_bits(dg, offs_n, N, mg_ptr, HAS_MUL))
            acc_u = tl.maximum(acc_u, _scaled_bits(du, offs_n, N, mu_ptr, HAS_MUL))
        scale_g = _scale_of(tl.max(acc_g, axis=1).to(tl.float32, bitcast=True), QMAX)
        scale_u = _scale_of(tl.max(acc_u, axis=1).to(tl.float32, bitcast=True), QMAX)
        tl.store(sg_ptr + offs_r, scale_g, mask=mask_r)
        tl.store(su_ptr + offs_r, scale_u, mask=mask_r)
        tl.debug_barrier()
        n_blocks = tl.cdiv(N, BLOCK_N)
        for i in range(0, n_blocks):
            offs_n, mask = _columns((n_blocks - 1 - i) * BLOCK_N, N, mask_r, BLOCK_N)
            dg = tl.load(dg_ptr + rows[:, None] * stride_dgm + offs_n[None, :], mask=mask, other=0.0)
            du = tl.load(du_ptr + rows[:, None] * stride_dum + offs_n[None, :], mask=mask, other=0.0)
            _row_codes(dg.to(tl.float32), offs_n, mask, scale_g, qg_ptr, rows[:, None] * N, N, mg_ptr, QMAX, IS_INT8,
                       NATIVE_FP8, HAS_MUL)
            _row_codes(du.to(tl.float32), offs_n, mask, scale_u, qu_ptr, rows[:, None] * N, N, mu_ptr, QMAX, IS_INT8,
                       NATIVE_FP8, HAS_MUL)


def _check(fn: str, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """One shape, one device, floating dtypes, rows of any stride with contiguous columns (the kernels' layout)."""
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.dim() != 2 or t.shape != first.shape or t.device != first.device:
            raise ValueError(f"{fn}: {name} must be 2-D, shaped and placed like the others "
                             f"({tuple(first.shape)} on {first.device}), got {tuple(t.shape)} on {t.device}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{fn}: {name}'s rows must be contiguous (stride 1 along dim 1), got strides "
                             f"{t.stride()}; pass .contiguous()")
    return first.shape


@on_operand_device
def swiglu_quant_triton(g: torch.Tensor, u: torch.Tensor, qdtype: torch.dtype, qmax: float, *, col_amax: bool = False,
                        tiles: tuple[int, int, int] | None = None,
                        fp8_cast: str | None = None) -> tuple[torch.Tensor, ...]:
    """``(h, q, scale, amax_bits)``: ``h = silu(g) * u`` in ``g``'s dtype ``[M, N]`` contiguous, its codes per row
    ``q [M, N]`` in ``qdtype`` (largest code ``qmax``), ``scale [M]`` float32 with ``h ≈ q * scale[:, None]``, and
    with ``col_amax`` each column's absmax of ``h`` as int32 float bits ``[N]`` (else an empty tensor). ``tiles``:
    ``(BLOCK_R, BLOCK_N, num_warps)``, all giving the same bits (``BLOCK_N >= N``: a row in one tile, one pass);
    ``fp8_cast`` as :func:`hf_lowbit.kernels.triton_quant.quantize_t_triton`'s."""
    M, N = _check("swiglu_quant_triton", {"g": g, "u": u})
    if u.dtype != g.dtype:
        raise ValueError(f"swiglu_quant_triton: g and u must have one dtype, got {g.dtype} and {u.dtype}")
    native = native_fp8_cast("swiglu_quant_triton", qdtype, g.device, fp8_cast)
    default = _CPU_TILES if g.device.type == "cpu" else _COL_TILES if col_amax else _FWD_TILES
    br, bn, warps = _tiles(tiles, default, "tiles", "swiglu_quant_triton")
    h = torch.empty((M, N), dtype=g.dtype, device=g.device)
    q = torch.empty((M, N), dtype=qdtype, device=g.device)
    scale = torch.empty((M,), dtype=torch.float32, device=g.device)
    amax = torch.zeros((N if col_amax else 0,), dtype=torch.int32, device=g.device)
    if M and N:
        wrap_triton(_swiglu_quant_kernel)[(triton.cdiv(M, br),)](
            g, u, h, q, scale, amax if col_amax else scale, M, N, g.stride(0), u.stride(0), h.stride(0), QMAX=qmax,
            IS_INT8=qdtype == torch.int8, NATIVE_FP8=native, COL_AMAX=col_amax, ONE_TILE=bn >= N,
            SOFT=g.device.type == "cpu", BLOCK_R=br, BLOCK_N=bn, num_warps=warps)
    return h, q, scale, amax


@on_operand_device
def swiglu_backward_quant_triton(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, qdtype: torch.dtype,
                                 qmax: float, mul_g: torch.Tensor | None = None, mul_u: torch.Tensor | None = None, *,
                                 col_amax: bool = False, tiles: tuple[int, int, int] | None = None,
                                 fp8_cast: str | None = None) -> tuple[torch.Tensor, ...]:
    """The backward of ``h = silu(g) * u`` given ``dh``: ``(dg, du, qg, sg, qu, su, amax_g, amax_u)``. ``dg``,
    ``du`` in ``g``'s dtype ``[M, N]`` contiguous; ``qg``, ``sg`` the row codes and scales of ``dg * mul_g`` (float32
    ``[N]``, the gate weight's row scales: the input gradient's operand, :func:`hf_lowbit.kernels.
    scaled_matmul_input_grad`; ``dg`` itself without one), ``qu``, ``su`` of ``du * mul_u``; with ``col_amax`` the
    column absmax of ``dg`` and ``du`` as int32 float bits ``[N]`` (else empty). ``tiles``, ``fp8_cast`` as
    :func:`swiglu_quant_triton`'s."""
    M, N = _check("swiglu_backward_quant_triton", {"dh": dh, "g": g, "u": u})
    if (mul_g is None) != (mul_u is None):
        raise ValueError("swiglu_backward_quant_triton: give both mul_g and mul_u or neither")
    for name, m in (("mul_g", mul_g), ("mul_u", mul_u)):
        if m is not None and (m.shape != (N,) or m.dtype != torch.float32 or m.device != g.device
                              or (N > 1 and m.stride(0) != 1)):
            raise ValueError(f"swiglu_backward_quant_triton: {name} must be {N} contiguous float32 values on "
                             f"{g.device}, got {tuple(m.shape)} {m.dtype} on {m.device}")
    native = native_fp8_cast("swiglu_backward_quant_triton", qdtype, g.device, fp8_cast)
    default = _CPU_TILES if g.device.type == "cpu" else _COL_TILES if col_amax else _BWD_TILES
    br, bn, warps = _tiles(tiles, default, "tiles", "swiglu_backward_quant_triton")
    dev = g.device
    dg, du = (torch.empty((M, N), dtype=g.dtype, device=dev) for _ in range(2))
    qg, qu = (torch.empty((M, N), dtype=qdtype, device=dev) for _ in range(2))
    sg, su = (torch.empty((M,), dtype=torch.float32, device=dev) for _ in range(2))
    ag, au = (torch.zeros((N if col_amax else 0,), dtype=torch.int32, device=dev) for _ in range(2))
    has_mul = mul_g is not None
    if M and N:
        wrap_triton(_swiglu_backward_quant_kernel)[(triton.cdiv(M, br),)](
            dh, g, u, mul_g if has_mul else sg, mul_u if has_mul else su, dg, du, qg, qu, sg, su,
            ag if col_amax else sg, au if col_amax else su, M, N, dh.stride(0), g.stride(0), u.stride(0),
            dg.stride(0), du.stride(0), QMAX=qmax, IS_INT8=qdtype == torch.int8, NATIVE_FP8=native, HAS_MUL=has_mul,
            COL_AMAX=col_amax, ONE_TILE=bn >= N, SOFT=dev.type == "cpu", BLOCK_R=br, BLOCK_N=bn,
            num_warps=warps)
    return dg, du, qg, sg, qu, su, ag, au
