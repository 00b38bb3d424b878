"""Triton column-wise quantization with a transposed write: ``x [M, N] -> q [N, M], scale [N]``.

The operands a weight-gradient matmul reduces over tokens (dim 0) need a scale per column and the
reduction dim contiguous. Inductor's fused form of this (a reduction along the strided dim plus a
permuted store) ran at ~1/3 of the copy bandwidth on the H200, so it is two kernels here:

1. ``_col_amax_kernel``: partial absmax of row chunks, grid (M chunks, N blocks), fully parallel;
2. ``_quantize_t_kernel``: each tile combines the partials of its columns, quantizes (int8: round
   half to even, clamp to ±127; fp8: clamp to ±448, round half to even onto the e4m3 grid; or int8
   stochastic rounding, ``floor(y + u)`` with ``u`` from Philox in registers) and stores the tile
   transposed. The nearest paths match the plain-torch quantize functions bit for bit.

NaN in a column gives that column a NaN scale (as :func:`hf_lowbit.kernels.int8.quantize_int8` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_CHUNK_M = 1024  # rows per partial absmax


@triton.jit
def _rne(y):
    """Round fp32 ``|y| < 2**22`` to the nearest integer, ties to even (as ``torch.round``), exactly."""
    return (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: the fp32 add itself rounds half to even


@triton.jit
def _col_amax_kernel(x_ptr, part_ptr, mul_ptr, M, N, stride_xm, stride_xn, HAS_MUL: tl.constexpr,
                     CHUNK_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The running maximum is kept per element of the tile and reduced across rows once, after the loop: a
    # reduction along dim 0 per loaded tile (cross-thread shuffles through shared memory, twice with the NaN
    # flag) made this kernel run at ~1.2 TB/s on the H200, slower than the quantize kernel that also writes.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(pid_m * CHUNK_M, tl.minimum(M, (pid_m + 1) * CHUNK_M), BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_MUL:
            x = x * tl.load(mul_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
        a = tl.abs(x)
        acc = tl.where((a > acc) | (a != a), a, acc)  # a NaN, once in, stays (NaN > y is False)
    nan = tl.max((acc != acc).to(tl.int32), axis=0)
    amax = tl.where(nan > 0, float("nan"), tl.max(acc, axis=0))
    tl.store(part_ptr + pid_m * N + offs_n, amax, mask=offs_n < N)


@triton.jit
def _quantize_t_kernel(x_ptr, part_ptr, q_ptr, scale_ptr, seed_ptr, mul_ptr, qx_ptr, M, N, n_chunks, stride_xm,
                       stride_xn, QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr,
                       HAS_MUL: tl.constexpr, BOTH_LAYOUTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    amax = tl.load(part_ptr + offs_n, mask=mask_n, other=0.0)
    for c in range(1, n_chunks):
        part = tl.load(part_ptr + c * N + offs_n, mask=mask_n, other=0.0)
        amax = tl.where((part != part) | (part > amax), part, amax)  # keeps NaN
    # IEEE-rounded divisions (Triton's fp32 `/` is approximate on CUDA): bit-exact with torch's `x / scale`
    scale = tl.math.div_rn(tl.where(amax < 1e-30, 1e-30, amax), QMAX)  # NaN < x is False: NaN stays
    if pid_m == 0:
        tl.store(scale_ptr + offs_n, scale, mask=mask_n)
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_MUL:
        x = x * tl.load(mul_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[None, :]), -QMAX), QMAX)
    if STOCHASTIC:  # int8 only: floor(y + u), u ~ U[0, 1), so E[q] = y
        # Philox keyed by (seed, element index in x): counter-based, so the random numbers live in registers
        # (no random tensor) and an element's draw does not depend on the tiling. The clamp is needed although
        # |y| <= 127 and u < 1: float32's 127 + u rounds to 128.0 for u within 2**-18 of 1, and the int8 cast
        # may wrap 128 to -128 (Triton's interpreter does); as the plain-torch reference, clamp after the floor.
        u = tl.rand(tl.load(seed_ptr), offs_m[:, None].to(tl.int64) * N + offs_n[None, :])
        q = tl.minimum(tl.floor(y + u), QMAX).to(tl.int8)
    elif IS_INT8:
        q = _rne(y).to(tl.int8)
    else:
        # Round to the e4m3 grid in fp32 (spacing 2**(e-3) in binade e, 2**-9 below 2**-6), so the cast
        # is exact and the result equals torch's single round-to-nearest-even cast bit for bit.
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        q = (_rne(y / step) * step).to(tl.float8e4nv)
    q_ptrs = q_ptr + offs_n[:, None] * M + offs_m[None, :]
    tl.store(q_ptrs, tl.trans(q), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))
    if BOTH_LAYOUTS:  # the same codes in x's own layout, [M, N] contiguous, from the same registers
        tl.store(qx_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)


def _chunk_rows(M: int, N: int, block_n: int) -> int:
    """Rows per partial absmax: enough programs to fill an H200 (~4 per SM) even at 2048 tokens, where
    1024-row chunks gave 2 x N/64 programs (128 for N = 4096) and left most SMs idle."""
    col_blocks = triton.cdiv(N, block_n)
    chunk = _CHUNK_M
    while chunk > 128 and triton.cdiv(M, chunk) * col_blocks < 512:
        chunk //= 2
    return chunk


def quantize_t_triton(x: torch.Tensor, qdtype: torch.dtype, qmax: float, chunk_m: int | None = None,
                      out: tuple[torch.Tensor, ...] | None = None, stochastic: bool = False,
                      row_mul: torch.Tensor | None = None, both_layouts: bool = False) -> tuple[torch.Tensor, ...]:
    """``x`` [M, N] (any strides) -> ``q`` [N, M] contiguous in ``qdtype``, ``scale`` [N] float32.

    ``chunk_m``: rows per partial absmax (a multiple of the row tile; default: sized to the shape). ``out``:
    preallocated ``(q, scale)`` (``(q, scale, qx)`` with ``both_layouts``) to write into (the weight cache
    refreshes its buffers in place, so CUDA graphs that read them stay valid). Any ``x.T`` view works too:
    ``quantize_t_triton(w.T, ...)`` quantizes ``w`` per row and writes it ``[rows, cols]`` contiguous.
    ``both_layouts``: also return the same codes in ``x``'s own layout, ``qx`` [M, N] contiguous, stored from the
    same registers (the weight cache's two layouts from one pass, instead of a transposing copy after it).
    ``stochastic`` (int8): stochastic rounding; its seed is one int64 drawn with ``torch.randint`` on ``x``'s
    device, so it follows ``torch.manual_seed`` and, under ``torch.compile``, stays a device tensor in the graph
    (no host sync, CUDA-graph safe). ``row_mul`` [M] (float32): quantize ``x * row_mul[:, None]`` (product in
    float32) without writing that product anywhere."""
    if stochastic and qdtype != torch.int8:  # checked before anything is launched
        raise ValueError(f"quantize_t_triton: stochastic rounding is implemented for int8, not {qdtype}")
    M, N = x.shape
    small = x.device.type == "cpu"  # the interpreter: small tiles
    # 64x64 tiles, 4 warps: measured on the H200 at 0.13 ms mean per call in the bench; 32x256 with
    # 8 warps was 3x slower
    bm, bn = (16, 16) if small else (64, 64)
    if chunk_m is None:
        chunk_m = 64 if small else _chunk_rows(M, N, bn)
    n_chunks = triton.cdiv(M, chunk_m)
    part = torch.empty((n_chunks, N), dtype=torch.float32, device=x.device)
    if out is None:
        q = torch.empty((N, M), dtype=qdtype, device=x.device)
        scale = torch.empty((N,), dtype=torch.float32, device=x.device)
        qx = torch.empty((M, N), dtype=qdtype, device=x.device) if both_layouts else None
    else:
        q, scale, qx = (*out, None) if len(out) == 2 else out
        if q.shape != (N, M) or not q.is_contiguous() or q.dtype != qdtype or scale.shape != (N,) \
                or scale.dtype != torch.float32 or (qx is None) == both_layouts or (
                both_layouts and (qx.shape != (M, N) or not qx.is_contiguous() or qx.dtype != qdtype)):
            raise ValueError(f"quantize_t_triton: out must be ({N}x{M} contiguous {qdtype}, {N} float32"
                             + (f", {M}x{N} contiguous {qdtype})" if both_layouts else ")"))
    if row_mul is not None and (row_mul.shape != (M,) or row_mul.dtype != torch.float32):
        raise ValueError(f"quantize_t_triton: row_mul must be {M} float32 values, got {tuple(row_mul.shape)} {row_mul.dtype}")
    mul = part if row_mul is None else row_mul  # never read without HAS_MUL
    wrap_triton(_col_amax_kernel)[(n_chunks, triton.cdiv(N, bn))](
        x, part, mul, M, N, x.stride(0), x.stride(1), HAS_MUL=row_mul is not None, CHUNK_M=chunk_m,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    # the nearest path never reads seed_ptr (STOCHASTIC is a constexpr): any tensor will do there; nor qx_ptr
    # without BOTH_LAYOUTS
    seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=x.device) if stochastic else part
    bm, bn = (16, 16) if small else (128, 64)
    wrap_triton(_quantize_t_kernel)[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, part, q, scale, seed, mul, q if qx is None else qx, M, N, n_chunks, x.stride(0), x.stride(1), QMAX=qmax,
        IS_INT8=qdtype == torch.int8, STOCHASTIC=stochastic, HAS_MUL=row_mul is not None,
        BOTH_LAYOUTS=both_layouts, BLOCK_M=bm, BLOCK_N=bn, num_warps=4 if small else 8)
    return (q, scale, qx) if both_layouts else (q, scale)
