"""Triton column-wise quantization with a transposed write: ``x [M, N] -> q [N, M], scale [N]``.

The operands a weight-gradient matmul reduces over tokens (dim 0) need a scale per column and the
reduction dim contiguous. Inductor's fused form of this (a reduction along the strided dim plus a
permuted store) ran at ~1/3 of the copy bandwidth on the H200, so it is two kernels here:

1. ``_col_amax_kernel``: partial absmax of row chunks, grid (M chunks, N blocks), fully parallel;
2. ``_quantize_t_kernel``: each tile combines the partials of its columns, quantizes (int8: round
   half to even, clamp to ±127; fp8: clamp to ±448, round half to even onto the e4m3 grid; or int8
   stochastic rounding, ``floor(y + u)`` with ``u`` from Philox in registers) and stores the tile
   transposed. The nearest paths match the plain-torch quantize functions bit for bit.

Two single-kernel variants (``variant=``; issue 25: the two-kernel path ran at ~1.35 TB/s on activations and
~0.9 TB/s on the weight refresh, far from the H200's 4.8) own whole columns of ``x`` per program and read them
twice, absmax then encode, the second pass backwards so that it starts on what the first left in L2:

- ``"fused"``: a strip of ``BLOCK_N`` columns of a row-major ``x`` (activations), tiles ``[BLOCK_M, BLOCK_N]``
  (FP8 with ``both_layouts`` where ``M``, ``N`` are multiples of 16: its sm_90 SASS stores 4 of 8 transposed pairs
  from the previous iteration, as the rows kernel's did, ``tools/quant_t_sass.py --rows``; nothing uses it so);
- ``"rows"``: ``BLOCK_R`` rows of ``w = x.T`` (the weight cache's refresh, ``x = w.T`` with ``w [N, K]``
  row-major), tiles ``[BLOCK_R, BLOCK_K]`` with contiguous loads, codes stored in ``w``'s layout (and transposed).
  Its FP8 transposed codes (``both_layouts``) came out wrong inside the Trainer on the H200 at a Llama layer's
  shapes while INT8's were exact and the tests' small shapes pass (session 14, ``trainer_grad_check``): ptxas's
  SASS of the fp32 -> e4m3 conversion's transposed store reads 4 of each thread's 16 codes from the previous loop
  iteration (``_quantize_rows_kernel``'s docstring, ``tools/quant_t_sass.py --rows``); its FP8 codes are now built
  with integer ops, and the Llama-shape CUDA tests pass for it on the H200 (cc5925f): the weight cache refreshes both
  formats through it (``hf_lowbit.kernels.WEIGHT_VARIANT``).

All three share the jit helpers below (absmax with NaN, scale, rounding), so they give the same bits, stochastic
rounding included (Philox keyed by the element's index in ``x``, whatever the tiling).

NaN in a column gives that column a NaN scale (as :func:`hf_lowbit.kernels.int8.quantize_int8` does).

Why the two-kernel path runs at ~1/3 of the H200's bandwidth, from its sm_90 code (``tools/quant_t_sass.py``: bf16
``x`` 16384 x 4096 launched contiguous, Triton 3.6, ptxas of Triton's wheel; per thread, 32 elements a tile or loop
iteration in every config below). Least traffic, X read twice and codes written once, is ~0.08 ms at 4.2 TB/s;
measured 0.155 ms (0.139 at the sweep's best tiles).

- Memory instructions are not it: every load of ``x`` is 16 B a thread (``ld.global.v4.b32``), the transposed store
  of the codes is 16 B a thread along M (``st.global.v4.b32`` x2 a tile: a warp writes 4 columns x 128 contiguous
  bytes at BLOCK_M = 128, 8 x 64 at 64); the transpose goes through shared memory on the bf16 tile (4 ``STS.128`` +
  4 ``LDSM.16.MT88.4``, ldmatrix's transposing load: vector accesses only), 16 KB of smem at 128x64 (8 KB at 64x64),
  no spills (48 registers).
- ``_quantize_t_kernel`` is bound by instruction issue: ~31.7 SASS instructions an element (int8; static count of
  the main body up to its EXIT, prologue and epilogue included) and ~45.4 (fp8), of which the IEEE division
  ``div_rn(x, scale)`` is ~14 an element (MUFU.RCP, its Newton steps, FCHK and a slow-path branch, per element
  although the scale is per column) and fp8's rounding step ``y / step`` another approximate division (MUFU.RCP, 32
  a thread). 67M elements x 31.7 / 32 lanes at 132 SMs x 4 warp-instructions a clock x ~1.98 GHz is ~0.064 ms (fp8
  ~0.091), above the 0.048 ms its 201 MB take at 4.2 TB/s.
- Its load of ``x`` waits behind a serial prologue: a loop over the ``n_chunks`` partials (16 here, 4-way unrolled,
  each thread 1 scalar ``LDG.E`` an iteration: 4 KB of L2 reads a 16 KB tile, 32 MB over the call), then the scale's
  IEEE division and its store; the tile's 4 ``LDG.E.128`` are instruction 187 of the kernel.
- ``_col_amax_kernel`` keeps only 2 of its 4 16-B loads in flight (the 3rd and 4th reuse the first two's registers),
  the loop is not pipelined (no cp.async), 235 SASS instructions an iteration (7.3 an element: bf16 unpack, abs,
  compare, NaN test, select); 74 registers at 64x64 (6 CTAs a SM: <= 24 KB in flight a SM, below the ~29 KB Little's
  law asks of 4.8 TB/s at ~0.8 us) and its 1024 CTAs are 1.3 waves of 792; 32x128 spills 36 B at 64 registers. Its
  partials: 16 x N floats written, the reduction at the end 40 shfl + 22 st.shared + 20 ld.shared + 7 bar.sync (PTX)
  a CTA (the NaN flag doubles the float max's).

The two candidates against that (``variant="atomic"``, ``"atomic_rcp"``; same bits, checked in the interpreter and
gated again in the sweep), same tools, same figures:

- absmax (``_col_amax_atomic_kernel``): int32 bits of ``|x|``, one integer max an element (NaN above inf), loop
  171-188 instructions (5.3-5.9 an element, 4.6 without pipelining), a ``tl.range`` of 3 stages: 8 16-B cp.async
  (``LDGSTS.128``) in flight a thread (2 tiles ahead), 16 KB smem, 56-59 registers (9 CTAs a SM at 64x64: the 1024
  CTAs in one wave, ~127 KB in flight a SM), no spills; the chunks merged by one ``red.global.max.s32`` a column a
  CTA, 20 shfl + 12 st.shared + 10 ld.shared + 4 bar.sync at the end (PTX, the pipeline's own left out); no partials
  buffer.
- quantize (``_quantize_t_amax_kernel``): the tile's 4 ``LDG.E.128`` are the kernel's first loads (instruction 48),
  the scales one 4-B load a column; ``atomic``: 29.1 instructions an element int8, 42.1 fp8 (the division
  unchanged); ``atomic_rcp``: 21.5 int8 (20.5 at 64x64) and 28.4 fp8 (27.4), MUFU.RCP 3 and FCHK 5 a thread instead
  of 33-65 and 33, stores unchanged; 64 registers int8, 80 fp8 (3 CTAs of 8 warps a SM at 128x64 instead of 5, still
  48 KB of x in flight a SM: the one figure that got worse). Issue time at 21.5 / 28.4 an element: ~0.043 / ~0.057
  ms, under or near the 0.048 ms of memory.

Measured on the H200 (5600f0c, docs/results/quant_sweep_h200_t2048.md): over a Llama-8B layer's activation
quantizations at 2048 tokens ``atomic_rcp`` is 1.21x the two kernels for int8, 1.28x for fp8 (``atomic`` 1.16x /
1.18x). Which variant ``hf_lowbit::quantize_t`` launches is ``hf_lowbit.kernels.quantize_t.ACTIVATION_VARIANT``
(``atomic_rcp`` for both formats since 222d22a; FP8's codes there by the hardware cast on CUDA, ``fp8_cast``: with it
the kernel's body is 19.4 SASS instructions an element at 128x64, 18.3 at 64x64, against 28.4 / 27.4 for the float32
rounding, registers unchanged, ``tools/quant_t_sass.py``; on the H200 at 8x2048 the kernel's 88 calls a step took
10.76 ms against 14.31 rounding first and INT8's 10.11, 4a4f0d0, docs/benchmarks.md "FP8's hardware cast").

:func:`quantize_dual_triton` (the op ``hf_lowbit::quantize_dual``) quantizes an output gradient both ways at once, per
row times the weight's scales (dX) and per column transposed (dW), from two reads instead of three (issue 25).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.library import wrap_triton

from ._launch import on_operand_device

_CHUNK_M = 1024  # rows per partial absmax
VARIANTS = ("two_kernel", "fused", "rows", "atomic", "atomic_rcp")
_TWO_PASS = ("two_kernel", "atomic", "atomic_rcp")  # take amax_tiles, quant_tiles, chunk_m
FP8_CAST_VARIANTS = ("atomic", "atomic_rcp")  # take fp8_cast (the others round FP8 in float32)
# (BLOCK_M, BLOCK_N, num_warps) defaults on CUDA; the interpreter (CPU) uses 16x16 tiles
_AMAX_TILES = (64, 64, 4)  # 64x64 with 4 warps: 0.13 ms mean per call in the bench; 32x256 with 8 warps was 3x slower
_QUANT_TILES = (128, 64, 8)
_FUSED_TILES = (64, 32, 4)  # (BLOCK_M, BLOCK_N, num_warps): a first guess, to be swept (benchmark_mm --quant_sweep)
# (BLOCK_R, BLOCK_K, num_warps): the least time summed over a Llama-8B layer's weights in the H200 sweep (608b2b4,
# docs/results/quant_sweep_h200_t2048.md): 1.45x the two-kernel refresh (4096x4096 1.72x, 14336x4096 1.96x)
_ROWS_TILES = (16, 256, 8)
_CPU_TILES = (16, 16, 4)
_AMAX_STAGES = 3  # the atomic variants' absmax loop: tiles in flight (tl.range num_stages)


@triton.jit
def _rne(y):
    """Round fp32 ``|y| < 2**22`` to the nearest integer, ties to even (as ``torch.round``), exactly."""
    return (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: the fp32 add itself rounds half to even


@triton.jit
def _max_keep_nan(acc, a):
    """Elementwise running maximum that keeps a NaN once one came in (``NaN > y`` is False)."""
    return tl.where((a > acc) | (a != a), a, acc)


@triton.jit
def _amax_reduce(acc, AXIS: tl.constexpr):
    """``acc``'s maximum along ``AXIS``, NaN where that line holds one (``tl.max`` would drop it)."""
    nan = tl.max((acc != acc).to(tl.int32), axis=AXIS)
    return tl.where(nan > 0, float("nan"), tl.max(acc, axis=AXIS))


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    # IEEE-rounded divisions (Triton's fp32 `/` is approximate on CUDA): bit-exact with torch's `x / scale`
    return tl.math.div_rn(tl.where(amax < 1e-30, 1e-30, amax), QMAX)  # NaN < x is False: NaN stays


@triton.jit
def _encode(x, scale, seed, rand_offs, QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Codes of ``x / scale`` (``scale`` broadcast to ``x``'s shape by the caller). ``rand_offs`` (int64): each
    element's index in ``x`` [M, N], ``m * N + n``, the Philox counter of stochastic rounding, so an element's
    draw depends on the seed and its place only, not on the kernel or its tiles."""
    return _encode_q(tl.math.div_rn(x, scale), seed, rand_offs, QMAX, IS_INT8, STOCHASTIC, False, False)


@triton.jit
def _encode_q(y, seed, rand_offs, QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr,
              POW2: tl.constexpr, NATIVE: tl.constexpr):
    """Codes of the quotient ``y = x / scale`` (IEEE-rounded), as :func:`_encode`. ``POW2`` (fp8): ``y / step``
    as ``y * (1 / step)``, the reciprocal of the power of two built from its exponent bits: the same value (both
    exact), one multiply instead of an approximate division (MUFU.RCP and its fixups) an element. ``NATIVE``
    (fp8, compiled only): the clamped quotient cast by the hardware (``cvt.rn.satfinite``: nearest, ties to even,
    torch's cast on ``[-448, 448]``) instead of rounded first in float32 arithmetic (:func:`_round_e4m3`, ~7
    instructions an element more); the interpreter's cast rounds ties up, so the CPU keeps the arithmetic."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if STOCHASTIC:  # int8 only: floor(y + u), u ~ U[0, 1), so E[q] = y
        # counter-based, so the random numbers live in registers (no random tensor). The clamp is needed although
        # |y| <= 127 and u < 1: float32's 127 + u rounds to 128.0 for u within 2**-18 of 1, and the int8 cast
        # may wrap 128 to -128 (Triton's interpreter does); as the plain-torch reference, clamp after the floor.
        u = tl.rand(seed, rand_offs)
        q = tl.minimum(tl.floor(y + u), QMAX).to(tl.int8)
    elif IS_INT8:
        q = _rne(y).to(tl.int8)
    elif NATIVE:
        q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = _round_e4m3(y, POW2).to(tl.float32, bitcast=True).to(tl.float8e4nv)
    return q


@triton.jit
def _round_e4m3(y, POW2: tl.constexpr):
    """The float32 bits (int32) of ``y`` (clamped to ±448) rounded to the nearest e4m3 value, ties to even, in
    fp32: on the e4m3 grid, so the cast to e4m3 is exact and equals torch's single round-to-nearest-even cast bit
    for bit. ``POW2`` as :func:`_encode_q`'s."""
    # spacing 2**(e-3) in binade e, 2**-9 below 2**-6
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    if POW2:  # 1 / step = 2**-(max(e, -6) - 3): exponent field 127 - (max(e, -6) - 3), in [2, 136]
        inv = ((127 - (tl.maximum(e, -6) - 3)) << 23).to(tl.float32, bitcast=True)
        r = (_rne(y * inv) * step).to(tl.int32, bitcast=True)
    else:
        r = (_rne(y / step) * step).to(tl.int32, bitcast=True)
    # a negative y (or -0) that rounds to zero is -0 in torch's cast (code 0x80) but +0 in the rounding above:
    # y's sign bit copied by hand (Triton's negation is 0 - x, which gives +0 as well)
    return r | (y.to(tl.int32, bitcast=True) & -2147483648)


@triton.jit
def _e4m3_byte(b):
    """The e4m3 code (int8 bits) of the float32 with bits ``b`` (int32) from :func:`_round_e4m3`, built with
    integer ops only (and one fp32 add): no fp32 -> e4m3 conversion instruction (see ``_quantize_rows_kernel``).
    The value ``v`` lies on the e4m3 grid, ``|v| <= 448``. Normal (``|v| >= 2**-6``, exponent field ``E >= 121``):
    ``a >> 20`` is ``E << 3 | m`` (``m`` its top 3 mantissa bits, the rest 0) and the code ``(E - 120) << 3 | m``;
    below, ``|v| = m * 2**-9`` (``m`` = 0..7) and ``|v| + 2**-6`` (exact) is normal with mantissa ``m``, so
    ``E = 121``. Zero keeps its sign (-0: 0x80); NaN (which the interpreter's clamp keeps) is 0x7F | sign, as
    torch's cast."""
    a = b & 0x7FFFFFFF
    sub = ((a.to(tl.float32, bitcast=True) + 0.015625).to(tl.int32, bitcast=True) >> 20) - (121 << 3)
    code = tl.where(a >= 121 << 23, (a >> 20) - (120 << 3), sub)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | ((b >> 24) & 0x80)).to(tl.int8)


@triton.jit
def _load_x(x_ptr, offs_m, offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL: tl.constexpr):
    """The ``[len(offs_m), len(offs_n)]`` tile of ``x`` in float32 (0 outside), times ``row_mul`` if any."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_MUL:
        x = x * tl.load(mul_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    return x


@triton.jit
def _load_w(w_ptr, offs_r, offs_k, R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL: tl.constexpr):
    """The ``[len(offs_r), len(offs_k)]`` tile of ``w = x.T`` in float32 (0 outside), times ``row_mul`` (of
    ``x``: ``w``'s columns) if any."""
    mask = (offs_r[:, None] < R) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_r[:, None] * stride_wr + offs_k[None, :] * stride_wk, mask=mask, other=0.0)
    w = w.to(tl.float32)
    if HAS_MUL:
        w = w * tl.load(mul_ptr + offs_k, mask=offs_k < K, other=0.0)[None, :]
    return w


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
        x = _load_x(x_ptr, m0 + tl.arange(0, BLOCK_M), offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
        acc = _max_keep_nan(acc, tl.abs(x))
    tl.store(part_ptr + pid_m * N + offs_n, _amax_reduce(acc, 0), mask=offs_n < N)


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
        amax = _max_keep_nan(amax, tl.load(part_ptr + c * N + offs_n, mask=mask_n, other=0.0))
    scale = _scale_of(amax, QMAX)
    if pid_m == 0:
        tl.store(scale_ptr + offs_n, scale, mask=mask_n)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0  # the nearest paths never read seed_ptr
    x = _load_x(x_ptr, offs_m, offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
    q = _encode(x, scale[None, :], seed, offs_m[:, None].to(tl.int64) * N + offs_n[None, :], QMAX, IS_INT8,
                STOCHASTIC)
    _store_col_tile(q, q_ptr, qx_ptr, offs_m, offs_n, M, N, BOTH_LAYOUTS)


@triton.jit
def _store_col_tile(q, q_ptr, qx_ptr, offs_m, offs_n, M, N, BOTH_LAYOUTS: tl.constexpr):
    """Store the codes of the ``x`` tile ``[offs_m, offs_n]`` transposed into ``q [N, M]`` and, with
    ``BOTH_LAYOUTS``, as they are into ``qx [M, N]`` (from the same registers)."""
    q_ptrs = q_ptr + offs_n[:, None] * M + offs_m[None, :]
    tl.store(q_ptrs, tl.trans(q), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))
    if BOTH_LAYOUTS:
        tl.store(qx_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _abs_bits(x):
    """``|x|`` (float32) as int32 bits. For non-negative floats the bits order as the values do and every NaN lies
    above inf, so one integer maximum is an absmax that keeps NaN (the float form needs a NaN flag beside it)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _col_amax_atomic_kernel(x_ptr, amax_ptr, mul_ptr, M, N, stride_xm, stride_xn, HAS_MUL: tl.constexpr,
                            CHUNK_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
    """``variant="atomic"`` / ``"atomic_rcp"``, pass 1: the absmax of a row chunk as int32 bits (:func:`_abs_bits`:
    one integer max per element instead of compare, NaN test and select), reduced across the tile's rows once and
    merged into ``amax_bits [N]`` (zeroed by the launcher) by an atomic integer max: no partials buffer, so the
    quantize pass reads one word per column instead of one per chunk. The loop is a ``tl.range`` with
    ``NUM_STAGES`` so Triton can keep the next tiles' loads in flight (cp.async) while this one is reduced."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for m0 in tl.range(pid_m * CHUNK_M, tl.minimum(M, (pid_m + 1) * CHUNK_M), BLOCK_M, num_stages=NUM_STAGES):
        x = _load_x(x_ptr, m0 + tl.arange(0, BLOCK_M), offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.atomic_max(amax_ptr + offs_n, tl.max(acc, axis=0), mask=offs_n < N, sem="relaxed")


@triton.jit
def _div_rcp(x, scale, rcp, pre):
    """``x / scale`` correctly rounded (the bits of ``tl.math.div_rn``) from the column's reciprocal: ``q0 = x * r``
    is within an ulp of the quotient, its remainder ``x - q0 * scale`` is exact in one fma, and (Markstein's
    theorem) ``fma(rem, r, q0)`` with ``r = RN(1 / scale)`` is the correctly rounded quotient, as long as nothing
    underflows. ``pre`` (a power of two per column, see :func:`_rcp_of`) scales ``x`` and ``scale`` alike (exact)
    so that the remainder of a column of tiny values stays a normal float. A zero remainder (``q0`` exact, ``x``
    = ±0 included: it keeps the sign of zero that the fma would drop) or a NaN one (``scale`` = inf: ``r`` = 0 and
    ``q0`` = ±0, what the division gives) returns ``q0``. ~5 instructions an element instead of div_rn's ~14
    (MUFU.RCP, its refinement, FCHK and the slow-path branch, per element)."""
    xs = x * pre
    q0 = xs * rcp
    rem = tl.fma(-q0, scale, xs)
    return tl.where((rem == 0) | (rem != rem), q0, tl.fma(rem, rcp, q0))  # noqa: PLR0124 - a NaN test


@triton.jit
def _rcp_of(scale):
    """``(scale * pre, RN(1 / (scale * pre)), pre)`` of a column for :func:`_div_rcp`: ``pre`` = 2**64 where
    ``scale < 2**-60`` (columns of tiny values), else 1."""
    pre = tl.where(scale < 8.673617379884035e-19, 1.8446744073709552e19, 1.0)
    s = scale * pre
    return s, tl.math.div_rn(1.0, s), pre


@triton.jit
def _quantize_t_amax_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, seed_ptr, mul_ptr, qx_ptr, M, N, stride_xm,
                            stride_xn, QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr,
                            HAS_MUL: tl.constexpr, BOTH_LAYOUTS: tl.constexpr, RCP: tl.constexpr,
                            NATIVE_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``variant="atomic"`` / ``"atomic_rcp"``, pass 2: as ``_quantize_t_kernel`` but the tile of ``x`` is loaded
    first (its latency overlaps the scale's, which ``_quantize_t_kernel`` computes before its load from a loop over
    the partials) and the scales come from one load of ``amax_bits``. ``RCP``: the quotients by
    :func:`_div_rcp` (one IEEE division per column, not per element) and fp8's rounding step by a multiply
    (``_encode_q``'s ``POW2``); the same bits. ``NATIVE_FP8``: fp8 codes by the hardware cast (``_encode_q``'s
    ``NATIVE``); the same bits."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x = _load_x(x_ptr, offs_m, offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
    amax = tl.load(amax_ptr + offs_n, mask=mask_n, other=0).to(tl.float32, bitcast=True)
    scale = _scale_of(amax, QMAX)
    if pid_m == 0:
        tl.store(scale_ptr + offs_n, scale, mask=mask_n)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    if RCP:
        s, r, pre = _rcp_of(scale)
        y = _div_rcp(x, s[None, :], r[None, :], pre[None, :])
    else:
        y = tl.math.div_rn(x, scale[None, :])
    q = _encode_q(y, seed, offs_m[:, None].to(tl.int64) * N + offs_n[None, :], QMAX, IS_INT8, STOCHASTIC, RCP,
                  NATIVE_FP8)
    _store_col_tile(q, q_ptr, qx_ptr, offs_m, offs_n, M, N, BOTH_LAYOUTS)


@triton.jit
def _quantize_t_fused_kernel(x_ptr, q_ptr, scale_ptr, seed_ptr, mul_ptr, qx_ptr, M, N, stride_xm, stride_xn,
                             QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr,
                             HAS_MUL: tl.constexpr, BOTH_LAYOUTS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    """``variant="fused"``: one program per strip of ``BLOCK_N`` columns, all ``M`` rows read twice (absmax, then
    encode + store); no partials in memory and one launch per operand."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        x = _load_x(x_ptr, m0 + tl.arange(0, BLOCK_M), offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
        acc = _max_keep_nan(acc, tl.abs(x))
    scale = _scale_of(_amax_reduce(acc, 0), QMAX)
    tl.store(scale_ptr + offs_n, scale, mask=offs_n < N)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    n_blocks = tl.cdiv(M, BLOCK_M)
    for i in range(0, n_blocks):  # backwards: the rows read last in the first pass are the likeliest in L2
        offs_m = (n_blocks - 1 - i) * BLOCK_M + tl.arange(0, BLOCK_M)
        x = _load_x(x_ptr, offs_m, offs_n, M, N, stride_xm, stride_xn, mul_ptr, HAS_MUL)
        q = _encode(x, scale[None, :], seed, offs_m[:, None].to(tl.int64) * N + offs_n[None, :], QMAX, IS_INT8,
                    STOCHASTIC)
        _store_col_tile(q, q_ptr, qx_ptr, offs_m, offs_n, M, N, BOTH_LAYOUTS)


@triton.jit
def _tensor_amax_kernel(w_ptr, amax_ptr, R, K, stride_wr, stride_wk, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``tensorwise=True``, pass 1: the absmax of all of ``w [R, K]`` as int32 bits (:func:`_abs_bits`, so a NaN
    anywhere wins), one program per ``BLOCK_R`` rows reading along them, merged into ``amax_bits [1]`` (zeroed by the
    launcher) by one atomic integer max a program."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        w = _load_w(w_ptr, offs_r, k0 + tl.arange(0, BLOCK_K), R, K, stride_wr, stride_wk, w_ptr, False)
        acc = tl.maximum(acc, _abs_bits(w))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0), sem="relaxed")


@triton.jit
def _quantize_rows_kernel(w_ptr, q_ptr, scale_ptr, seed_ptr, mul_ptr, qt_ptr, amax_ptr, R, K, stride_wr, stride_wk,
                          QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_MUL: tl.constexpr,
                          BOTH_LAYOUTS: tl.constexpr, TENSORWISE: tl.constexpr, ROW_AMAX: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``variant="rows"``: ``w [R, K]`` (``= x.T``) quantized per row, one program per ``BLOCK_R`` rows, ``K`` read
    twice with loads along ``w``'s rows; codes stored in ``w``'s layout ``q [R, K]`` (row-major: no transpose)
    and, with ``BOTH_LAYOUTS``, transposed into ``qt [K, R]``. In ``x``'s terms ``M = K``, ``N = R``, so the
    Philox counter of ``w[r, k]`` is ``k * R + r``, as the column kernels'.

    FP8 codes are built as int8 bits with integer ops (:func:`_e4m3_byte`) and stored through int8 views: after
    the encode, the INT8 kernel's code path (the same TTGIR ops and layouts; no fp32 -> e4m3 conversion). With the
    conversion (``cvt.rn.satfinite.e4m3x2.f32``: two codes in a 16-bit register, each byte then stored to shared
    memory for the transpose, the odd one by ``shr.u16``) ptxas (12.8, Triton 3.6's, and 12.9) miscompiles the
    transposed store at the CUDA tiles when ``R``, ``K`` are divisible by 16 (a Llama layer's shapes; the tests' odd
    shapes get another layout): each thread holds 16 codes along ``k`` and the odd code of the low pair of each
    32-bit word (``k`` = 1, 5, 9, 13 mod 16) is shifted out of a register (``SHF.R.U32.HI R16, RZ, 0x8, R35``)
    before the ``PRMT`` that copies this iteration's ``F2FP.PACK_AB_MERGE_C`` pair into it: those 4 of 16 bytes of
    ``qt`` are the previous iteration's codes (``k + BLOCK_K``; the first iteration's, whatever the register held),
    ``q`` is right. Session 14 measured 107.6M of 436M (24.7%) transposed codes wrong. Found in the SASS
    (``tools/quant_t_sass.py --rows``), not yet on the GPU.

    ``TENSORWISE``: one scale for all of ``w``, from ``amax_ptr`` (:func:`_tensor_amax_kernel`'s bits) instead of
    each row's absmax, stored once a row (``w`` is then read once here). Triton then encodes each tile twice, once
    in each store's layout, instead of transposing the codes through shared memory (80 SASS instructions an element
    against the per-row kernel's 42 at Llama shapes, ``tools/quant_t_sass.py --rows``; deriving the scale through a
    row reduction kept the duplicate and made the tool flag a stale store, so it stays this way).

    ``ROW_AMAX``: each row's absmax given, as int32 bits in ``amax_ptr [R]`` (:func:`_abs_bits`; made by the pass
    that last wrote ``w``, e.g. :func:`hf_lowbit.kernels.adamw.adamw_rows_`), so ``w`` is read once here (its first
    ``BLOCK_K`` columns twice: see the branch)."""
    q8_ptr, qt8_ptr = q_ptr.to(tl.pointer_type(tl.int8)), qt_ptr.to(tl.pointer_type(tl.int8))  # int8: the same
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if TENSORWISE:
        amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        scale = _scale_of(tl.zeros((BLOCK_R,), dtype=tl.float32) + amax, QMAX)
    elif ROW_AMAX:
        # merged with the absmax of the rows' first tile (at most theirs: the same bits), so that the scale comes
        # out of a reduction over a tile of w as the computed one does: loaded as a plain vector alone, Triton gave
        # the encode the tensorwise path's layouts (each tile encoded twice, ~82 SASS instructions an element, and
        # tools/quant_t_sass.py --rows flagged FP8 transposed stores of the previous iteration's codes)
        w = _load_w(w_ptr, offs_r, tl.arange(0, BLOCK_K), R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL)
        bits = tl.maximum(tl.load(amax_ptr + offs_r, mask=mask_r, other=0), tl.max(_abs_bits(w), axis=1))
        scale = _scale_of(bits.to(tl.float32, bitcast=True), QMAX)
    else:
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = _load_w(w_ptr, offs_r, k0 + tl.arange(0, BLOCK_K), R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL)
            acc = _max_keep_nan(acc, tl.abs(w))
        scale = _scale_of(_amax_reduce(acc, 1), QMAX)
    tl.store(scale_ptr + offs_r, scale, mask=mask_r)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    n_blocks = tl.cdiv(K, BLOCK_K)
    for i in range(0, n_blocks):  # backwards: the columns read last in the first pass are the likeliest in L2
        offs_k = (n_blocks - 1 - i) * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _load_w(w_ptr, offs_r, offs_k, R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL)
        if IS_INT8:
            q = _encode(w, scale[:, None], seed, offs_k[None, :].to(tl.int64) * R + offs_r[:, None], QMAX, IS_INT8,
                        STOCHASTIC)
        else:  # FP8: int8 bits from integer ops (no cvt...e4m3x2: see the docstring), stored through int8 views;
            # the rounding step's reciprocal from its exponent bits (POW2: the same bits, a multiply a code instead
            # of MUFU.RCP and its fixups), which keeps the encode loop at the conversion's instruction count
            y = tl.minimum(tl.maximum(tl.math.div_rn(w, scale[:, None]), -QMAX), QMAX)
            q = _e4m3_byte(_round_e4m3(y, True))
        mask = mask_r[:, None] & (offs_k[None, :] < K)
        tl.store(q8_ptr + offs_r[:, None] * K + offs_k[None, :], q, mask=mask)
        if BOTH_LAYOUTS:
            tl.store(qt8_ptr + offs_k[:, None] * R + offs_r[None, :], tl.trans(q),
                     mask=(offs_k[:, None] < K) & mask_r[None, :])


def _chunk_rows(M: int, N: int, block_n: int, block_m: int = 64) -> int:
    """Rows per partial absmax: enough programs to fill an H200 (~4 per SM) even at 2048 tokens, where
    1024-row chunks gave 2 x N/64 programs (128 for N = 4096) and left most SMs idle. A multiple of the row
    tile (so no two chunks read the same rows)."""
    col_blocks = triton.cdiv(N, block_n)
    chunk = _CHUNK_M
    while chunk > 128 and triton.cdiv(M, chunk) * col_blocks < 512:
        chunk //= 2
    return max(chunk, block_m)


def _tiles(tiles, default, what: str, fn: str = "quantize_t_triton") -> tuple[int, int, int]:
    if tiles is None:
        return default
    ok = len(tiles) == 3 and all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in tiles) and tiles[2] <= 32
    if not ok:
        raise ValueError(f"{fn}: {what} must be (block, block, num_warps), powers of two, got {tiles}")
    return tuple(tiles)


# what to do about an operand past 2**31 elements, by where the kernel runs (``_check_32bit_offsets``'s ``advice``)
TRAINING_ADVICE = ("use fewer tokens per micro-batch (more gradient_accumulation_steps), or leave this layer out of "
                   "the low-bit recipe")
SERVING_ADVICE = "serve fewer rows at once (a smaller batch or prompt chunk), or leave this layer unquantized"


def _check_32bit_offsets(fn: str, x: torch.Tensor, advice: str = TRAINING_ADVICE) -> None:
    """These kernels address their operand and codes with 32-bit element offsets (as Triton does by default): refuse,
    in one line, an operand that spans 2**31 elements or more (a 14336-wide activation at ~150k tokens, a weight of
    2**31 elements), whose offsets would wrap and read and write outside it. The INT8 matmul's are 64-bit."""
    # under torch.compile sizes may be symbols: a backed one gets a guard here, a data-dependent one (tokens routed at
    # run time) cannot be decided while tracing and is let through rather than failing the trace
    span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    if guard_or_false(x.numel() >= 2 ** 31) or guard_or_false(span >= 2 ** 31):
        raise ValueError(f"{fn}: an operand of shape {tuple(x.shape)} spans {max(int(span), x.numel()):,} elements, "
                         f"past the 2**31 these Triton kernels address in 32 bits; {advice}")


def native_fp8_cast(fn: str, qdtype: torch.dtype, device: torch.device, fp8_cast: str | None) -> bool:
    """Whether ``fn``'s FP8 codes come from the hardware cast (``fp8_cast``: None, the default, on CUDA; "native";
    "soft": rounded in float32 first, the interpreter's only way); refuses a bad value in one line."""
    if fp8_cast not in (None, "native", "soft"):
        raise ValueError(f"{fn}: fp8_cast must be 'native', 'soft' or None, got {fp8_cast!r}")
    if fp8_cast == "native" and device.type == "cpu":
        raise ValueError(f"{fn}: fp8_cast='native' needs a GPU: Triton's interpreter casts float32 to e4m3 with ties "
                         "rounded up (not torch's cast); use 'soft' or None on the CPU")
    return qdtype != torch.int8 and (fp8_cast or ("soft" if device.type == "cpu" else "native")) == "native"


@on_operand_device
def quantize_t_triton(x: torch.Tensor, qdtype: torch.dtype, qmax: float, chunk_m: int | None = None,
                      out: tuple[torch.Tensor, ...] | None = None, stochastic: bool = False,
                      row_mul: torch.Tensor | None = None, both_layouts: bool = False, *, variant: str = "two_kernel",
                      amax_tiles: tuple[int, int, int] | None = None, quant_tiles: tuple[int, int, int] | None = None,
                      tiles: tuple[int, int, int] | None = None, tensorwise: bool = False,
                      fp8_cast: str | None = None, row_amax: torch.Tensor | None = None,
                      col_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
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
    float32) without writing that product anywhere.

    Which kernels, all giving the same bits (the stochastic ones too, for the same seed): ``variant`` one of
    ``VARIANTS``: ``"two_kernel"`` (this function's default: partial absmax, then quantize; ``amax_tiles`` and
    ``quant_tiles`` override their ``(BLOCK_M, BLOCK_N, num_warps)``, ``chunk_m`` the rows per partial), ``"fused"``
    (one kernel, column strips; meant for a row-major ``x``) or ``"rows"`` (one kernel, rows of ``x.T``; meant for
    ``x = w.T`` with ``w`` row-major, the weight refresh), ``"atomic"`` (two passes as ``"two_kernel"``, the absmax
    merged by an atomic max instead of a partials buffer) or ``"atomic_rcp"`` (that, with one IEEE division per column
    instead of per element; nearest rounding only: ``stochastic`` raises), both taking ``amax_tiles``, ``quant_tiles``
    and ``chunk_m`` (``hf_lowbit::quantize_t`` picks one per format: ``quantize_t.ACTIVATION_VARIANT``); ``tiles``
    overrides the single kernel's ``(BLOCK_M, BLOCK_N, num_warps)`` (``"rows"``: ``(BLOCK_R, BLOCK_K, num_warps)``,
    ``R`` along ``N``, ``K`` along ``M``). Block sizes and warps are powers of two; on the CPU (Triton's interpreter)
    the defaults are 16x16 tiles.

    ``tensorwise`` (``variant="rows"`` only, nearest rounding, no ``row_mul``): one scale for all of ``x``, its
    absmax / ``qmax`` correctly rounded, written to each of the ``N`` entries of ``scale`` (the bits of
    ``quantize_fp8_tensorwise`` on the CPU; eager CUDA torch multiplies by ``1 / qmax`` instead, up to 1 ulp off).
    It refreshes the weight cache of an ``fp8_tensorwise`` layer, which was ~6 unfused eager torch kernels a
    weight, ~30 ms a step for 8 Llama-8B layers on the H200. Two launches: an absmax pass merged by an atomic max,
    then the rows kernel reading the scale instead of computing one a row.

    ``row_amax`` (``variant="rows"`` only, nearest rounding, no ``row_mul``, not ``tensorwise``): the absmax of each
    of ``x``'s columns (``w``'s rows) already known, as int32 bits ``[N]`` (``|x|``'s float32 bits, NaN above inf:
    what :func:`hf_lowbit.kernels.adamw.adamw_rows_` leaves from the optimizer's own pass over the weight), so the
    rows kernel reads ``x`` once instead of twice (but for its first tile of each row). The same bits as computing
    it here, given the true absmax.

    ``col_amax`` (``"atomic"`` / ``"atomic_rcp"`` only, no ``row_mul``): each column's absmax of ``x`` already known,
    int32 float bits ``[N]`` (e.g. left by :func:`hf_lowbit.kernels.triton_swiglu.swiglu_backward_quant_triton`, the
    pass that wrote ``x``): the absmax pass is skipped and ``x`` read once. The same bits, given the true absmax.

    ``fp8_cast`` (``"atomic"`` / ``"atomic_rcp"``, fp8): how the quotients become e4m3 codes, the same bits either
    way: ``"native"`` (the default on CUDA) the hardware's round-to-nearest-even cast, ``"soft"`` (the default and
    the only choice in the interpreter, whose cast rounds ties up) rounding in float32 arithmetic first. On the
    H200 (55d8bf8, 8x2048) FP8's quantize pass took 14.2 ms a step against INT8's 10.0 for the same calls, the
    arithmetic rounding's instructions and registers being the difference; with the native cast 10.8 (4a4f0d0, the
    same run as 14.3 rounding first). The other variants round softly."""
    if stochastic and qdtype != torch.int8:  # checked before anything is launched
        raise ValueError(f"quantize_t_triton: stochastic rounding is implemented for int8, not {qdtype}")
    _check_32bit_offsets("quantize_t_triton", x)
    if variant not in VARIANTS:
        raise ValueError(f"quantize_t_triton: variant must be one of {VARIANTS}, got {variant!r}")
    if variant in _TWO_PASS and tiles is not None:
        raise ValueError(f"quantize_t_triton: tiles is for the single-kernel variants; {variant} takes amax_tiles, "
                         "quant_tiles and chunk_m")
    if variant == "atomic_rcp" and stochastic:
        raise ValueError("quantize_t_triton: variant 'atomic_rcp' rounds to nearest only (its division is exact "
                         "for normal quotients; stochastic rounding's floor(y + u) can see a subnormal one's last "
                         "bit): use 'atomic' or 'two_kernel'")
    if tensorwise and (variant != "rows" or stochastic or row_mul is not None):
        raise ValueError("quantize_t_triton: tensorwise=True is implemented for variant 'rows' with nearest rounding "
                         f"and no row_mul, got variant={variant!r}, stochastic={stochastic}, "
                         f"row_mul={'given' if row_mul is not None else None}")
    if row_amax is not None and (variant != "rows" or stochastic or row_mul is not None or tensorwise):
        raise ValueError("quantize_t_triton: row_amax is implemented for variant 'rows' with nearest rounding, no "
                         f"row_mul and not tensorwise, got variant={variant!r}, stochastic={stochastic}, "
                         f"row_mul={'given' if row_mul is not None else None}, tensorwise={tensorwise}")
    if col_amax is not None and (variant not in FP8_CAST_VARIANTS or row_mul is not None):
        raise ValueError(f"quantize_t_triton: col_amax is implemented for the 'atomic' and 'atomic_rcp' variants "
                         f"without row_mul, got variant={variant!r}, "
                         f"row_mul={'given' if row_mul is not None else None}")
    native_fp8 = native_fp8_cast("quantize_t_triton", qdtype, x.device, fp8_cast)
    if fp8_cast is not None and variant not in FP8_CAST_VARIANTS:
        raise ValueError(f"quantize_t_triton: fp8_cast is the 'atomic' and 'atomic_rcp' variants' choice, not "
                         f"{variant!r}'s (they round in float32 arithmetic)")
    if variant not in _TWO_PASS and (amax_tiles, quant_tiles, chunk_m) != (None, None, None):
        raise ValueError(f"quantize_t_triton: amax_tiles, quant_tiles and chunk_m are the two-kernel path's, not "
                         f"{variant!r}'s (it takes tiles)")
    M, N = x.shape
    if row_amax is not None and (row_amax.shape != (N,) or row_amax.dtype != torch.int32
                                 or row_amax.device != x.device):
        raise ValueError(f"quantize_t_triton: row_amax must be {N} int32 values (float32 bits) on {x.device}, got "
                         f"{tuple(row_amax.shape)} {row_amax.dtype} on {row_amax.device}")
    if col_amax is not None and (col_amax.shape != (N,) or col_amax.dtype != torch.int32
                                 or col_amax.device != x.device):
        raise ValueError(f"quantize_t_triton: col_amax must be {N} int32 values (float32 bits) on {x.device}, got "
                         f"{tuple(col_amax.shape)} {col_amax.dtype} on {col_amax.device}")
    small = x.device.type == "cpu"  # the interpreter: small tiles
    if out is None:
        q = torch.empty((N, M), dtype=qdtype, device=x.device)
        scale = torch.empty((N,), dtype=torch.float32, device=x.device)
        qx = torch.empty((M, N), dtype=qdtype, device=x.device) if both_layouts else None
    else:
        q, scale, qx = (*out, None) if len(out) == 2 else out
        if q.shape != (N, M) or not q.is_contiguous() or q.dtype != qdtype or scale.shape != (N,) \
                or not scale.is_contiguous() or scale.dtype != torch.float32 or (qx is None) == both_layouts or (
                both_layouts and (qx.shape != (M, N) or not qx.is_contiguous() or qx.dtype != qdtype)):
            raise ValueError(f"quantize_t_triton: out must be ({N}x{M} contiguous {qdtype}, {N} contiguous float32"
                             + (f", {M}x{N} contiguous {qdtype})" if both_layouts else ")"))
    if row_mul is not None and (row_mul.shape != (M,) or row_mul.dtype != torch.float32):
        raise ValueError(f"quantize_t_triton: row_mul must be {M} float32 values, got {tuple(row_mul.shape)} "
                         f"{row_mul.dtype}")
    # the kernels read row_mul, row_amax and col_amax as contiguous vectors: strided views are copied (small)
    row_mul, row_amax, col_amax = (None if t is None else t.contiguous() for t in (row_mul, row_amax, col_amax))
    consts = dict(QMAX=qmax, IS_INT8=qdtype == torch.int8, STOCHASTIC=stochastic, HAS_MUL=row_mul is not None,
                  BOTH_LAYOUTS=both_layouts)
    # the nearest path never reads seed_ptr (STOCHASTIC is a constexpr): any tensor will do there; nor mul_ptr
    # without HAS_MUL, nor qx_ptr without BOTH_LAYOUTS
    seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=x.device) if stochastic else scale
    mul = scale if row_mul is None else row_mul
    qx_arg = q if qx is None else qx
    if variant == "fused":
        bm, bn, warps = _tiles(tiles, _CPU_TILES if small else _FUSED_TILES, "tiles")
        wrap_triton(_quantize_t_fused_kernel)[(triton.cdiv(N, bn),)](
            x, q, scale, seed, mul, qx_arg, M, N, x.stride(0), x.stride(1), **consts, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=warps)
    elif variant == "rows":  # w = x.T: [R, K] = [N, M]; q [N, M] is w's layout, qx [M, N] its transpose
        br, bk, warps = _tiles(tiles, _CPU_TILES if small else _ROWS_TILES, "tiles")
        amax_bits = scale if row_amax is None else row_amax  # read only with TENSORWISE or ROW_AMAX
        if tensorwise:
            amax_bits = torch.zeros((1,), dtype=torch.int32, device=x.device)  # |x| >= +0: the max's identity
            wrap_triton(_tensor_amax_kernel)[(triton.cdiv(N, br),)](
                x, amax_bits, N, M, x.stride(1), x.stride(0), BLOCK_R=br, BLOCK_K=bk, num_warps=warps)
        wrap_triton(_quantize_rows_kernel)[(triton.cdiv(N, br),)](
            x, q, scale, seed, mul, qx_arg, amax_bits, N, M, x.stride(1), x.stride(0), **consts,
            TENSORWISE=tensorwise, ROW_AMAX=row_amax is not None, BLOCK_R=br, BLOCK_K=bk, num_warps=warps)
    else:  # _TWO_PASS: column absmax, then quantize; the tiles and row chunks chosen alike
        bm, bn, warps = _tiles(amax_tiles, _CPU_TILES if small else _AMAX_TILES, "amax_tiles")
        if chunk_m is None:
            chunk_m = 64 if small and amax_tiles is None else _chunk_rows(M, N, bn, bm)
        # at least one chunk and one row of quantize programs: those of the first row write the scales, and with no
        # rows (M = 0) the absmax of no element is 0 (an all-zero column's scale, as the other variants give)
        n_chunks = max(1, triton.cdiv(M, chunk_m))
        qbm, qbn, qwarps = _tiles(quant_tiles, _CPU_TILES if small else _QUANT_TILES, "quant_tiles")
        if variant == "two_kernel":
            part = torch.empty((n_chunks, N), dtype=torch.float32, device=x.device)
            wrap_triton(_col_amax_kernel)[(n_chunks, triton.cdiv(N, bn))](
                x, part, row_mul if row_mul is not None else part, M, N, x.stride(0), x.stride(1),
                HAS_MUL=row_mul is not None, CHUNK_M=chunk_m, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
            wrap_triton(_quantize_t_kernel)[(max(1, triton.cdiv(M, qbm)), triton.cdiv(N, qbn))](
                x, part, q, scale, seed, mul, qx_arg, M, N, n_chunks, x.stride(0), x.stride(1), **consts,
                BLOCK_M=qbm, BLOCK_N=qbn, num_warps=qwarps)
        else:  # atomic, atomic_rcp; with col_amax given, the encode pass alone
            amax_bits = col_amax
            if amax_bits is None:
                amax_bits = torch.zeros((N,), dtype=torch.int32, device=x.device)  # |x| >= +0: the max's identity
                wrap_triton(_col_amax_atomic_kernel)[(n_chunks, triton.cdiv(N, bn))](
                    x, amax_bits, mul, M, N, x.stride(0), x.stride(1), HAS_MUL=row_mul is not None, CHUNK_M=chunk_m,
                    BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=1 if small else _AMAX_STAGES, num_warps=warps)
            wrap_triton(_quantize_t_amax_kernel)[(max(1, triton.cdiv(M, qbm)), triton.cdiv(N, qbn))](
                x, amax_bits, q, scale, seed, mul, qx_arg, M, N, x.stride(0), x.stride(1), **consts,
                RCP=variant == "atomic_rcp", NATIVE_FP8=native_fp8, BLOCK_M=qbm, BLOCK_N=qbn, num_warps=qwarps)
    return (q, scale, qx) if both_layouts else (q, scale)


# ---------------------------------------------------------------------------------------------------------------------
# Dual quantization of an output gradient (issue 25): the backward quantizes ``g = dY [M, N]`` twice, per row (times
# the weight's scales, for dX) and per column (for dW), three reads of ``g`` at ~1.3-1.5 TB/s on the H200. Here ``g``
# is read twice: one pass for both absmaxes, one that stores both codes from the same registers.

# (BLOCK_M, BLOCK_N, num_warps) defaults on CUDA of the absmax pass and of the encode pass: first guesses, to be swept
# (benchmark_mm.py --dual); (BLOCK_P, BLOCK_L) of the partials' reduction
_DUAL_AMAX_TILES = (64, 64, 4)
_DUAL_QUANT_TILES = (64, 64, 4)
_DUAL_REDUCE = (8, 256)


@triton.jit
def _dual_amax_kernel(x_ptr, mul_ptr, rpart_ptr, cpart_ptr, M, N, stride_xm, stride_xn, HAS_MUL: tl.constexpr,
                      CHUNK_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (row chunks, column blocks). Columns: the running maximum of ``|x|`` per tile element over the chunk,
    reduced across rows once (as ``_col_amax_kernel``) into ``cpart [chunk, N]``. Rows: each tile's maximum of
    ``|x * mul|`` along its columns (a reduction along the contiguous dim, within warps) into ``rpart [block, M]``."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mul = tl.full((BLOCK_N,), 1.0, tl.float32)  # x * 1.0 is x, NaN included
    if HAS_MUL:
        mul = tl.load(mul_ptr + offs_n, mask=mask_n, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for m0 in range(pid_m * CHUNK_M, tl.minimum(M, (pid_m + 1) * CHUNK_M), BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask = (offs_m[:, None] < M) & mask_n[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
        tl.store(rpart_ptr + pid_n * M + offs_m, tl.max(_abs_bits(x * mul[None, :]), axis=1), mask=offs_m < M)
    tl.store(cpart_ptr + pid_m * N + offs_n, tl.max(acc, axis=0), mask=mask_n)


@triton.jit
def _reduce_scales(part_ptr, scale_ptr, pid, L, P, QMAX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr):
    """``scale[l]`` from the absmax bits ``part [P, L]`` of ``BLOCK_L`` lines."""
    offs_l = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    acc = tl.zeros((BLOCK_P, BLOCK_L), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        part = tl.load(part_ptr + offs_p[:, None] * L + offs_l[None, :],
                       mask=(offs_p[:, None] < P) & (offs_l[None, :] < L), other=0)
        acc = tl.maximum(acc, part)
    amax = tl.max(acc, axis=0).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + offs_l, _scale_of(amax, QMAX), mask=offs_l < L)


@triton.jit
def _dual_scales_kernel(rpart_ptr, cpart_ptr, sr_ptr, sc_ptr, M, N, n_rparts, n_cparts, QMAX: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr):
    """One launch for both scale vectors: the first ``cdiv(M, BLOCK_L)`` programs reduce the row partials, the
    others the column partials."""
    pid = tl.program_id(0)
    row_programs = tl.cdiv(M, BLOCK_L)
    if pid < row_programs:
        _reduce_scales(rpart_ptr, sr_ptr, pid, M, n_rparts, QMAX, BLOCK_P, BLOCK_L)
    else:
        _reduce_scales(cpart_ptr, sc_ptr, pid - row_programs, N, n_cparts, QMAX, BLOCK_P, BLOCK_L)


@triton.jit
def _dual_quantize_kernel(x_ptr, mul_ptr, sr_ptr, sc_ptr, qr_ptr, qc_ptr, M, N, stride_xm, stride_xn,
                          QMAX: tl.constexpr, IS_INT8: tl.constexpr, HAS_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """One tile of ``x``, read once: ``x * mul`` encoded with the row scales into ``qr [M, N]`` and ``x`` with the
    column scales into ``qc [N, M]`` (stored transposed)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    mul = tl.full((BLOCK_N,), 1.0, tl.float32)
    if HAS_MUL:
        mul = tl.load(mul_ptr + offs_n, mask=mask_n, other=0.0)
    sr = tl.load(sr_ptr + offs_m, mask=mask_m, other=1.0)
    sc = tl.load(sc_ptr + offs_n, mask=mask_n, other=1.0)
    qr = _encode(x * mul[None, :], sr[:, None], 0, 0, QMAX, IS_INT8, False)
    qc = _encode(x, sc[None, :], 0, 0, QMAX, IS_INT8, False)
    tl.store(qr_ptr + offs_m[:, None] * N + offs_n[None, :], qr, mask=mask_m[:, None] & mask_n[None, :])
    tl.store(qc_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(qc), mask=mask_n[:, None] & mask_m[None, :])


@on_operand_device
def quantize_dual_triton(g: torch.Tensor, qdtype: torch.dtype, qmax: float, col_mul: torch.Tensor | None = None,
                         stochastic: bool = False, *, chunk_m: int | None = None,
                         amax_tiles: tuple[int, int, int] | None = None,
                         quant_tiles: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """``g [M, N]`` (any strides) quantized both ways from two reads: ``(qr [M, N], sr [M], qc [N, M], sc [N])``.

    ``qr, sr``: ``g * col_mul[None, :]`` (product in float32; ``col_mul`` [N] float32, None: ones) per row, the bits of
    ``FORMATS[fmt].quantize(g.float() * col_mul, dim=1)`` (the input gradient's operand). ``qc, sc``: ``g`` per
    column, written transposed, the bits of :func:`quantize_t_triton` (the weight gradient's operand). NaN in a row
    (column) makes its scale NaN; inf makes it inf, as the references. Three kernels: both absmaxes as partials
    (one read of ``g``), their reduction to scales (tiny), both encodes from one more read. ``chunk_m``: rows per
    column partial (a multiple of the absmax tile's rows); ``amax_tiles``, ``quant_tiles``: ``(BLOCK_M, BLOCK_N,
    num_warps)`` of the two passes over ``g``, powers of two (CPU, Triton's interpreter: 16x16 by default).

    Nearest rounding only: ``stochastic=True`` raises (stochastic rounding keeps the ``quantize_t`` path)."""
    if stochastic:
        raise ValueError("quantize_dual_triton: nearest rounding only; stochastic rounding goes through quantize_t")
    if g.dim() != 2:
        raise ValueError(f"quantize_dual_triton: g must be 2-D, got shape {tuple(g.shape)}")
    _check_32bit_offsets("quantize_dual_triton", g)
    M, N = g.shape
    if col_mul is not None and (col_mul.shape != (N,) or col_mul.dtype != torch.float32 or col_mul.stride(0) != 1):
        raise ValueError(f"quantize_dual_triton: col_mul must be {N} contiguous float32 values, got "
                         f"{tuple(col_mul.shape)} {col_mul.dtype}")
    small = g.device.type == "cpu"  # the interpreter: small tiles
    dev = g.device
    qr = torch.empty((M, N), dtype=qdtype, device=dev)
    qc = torch.empty((N, M), dtype=qdtype, device=dev)
    sr = torch.empty((M,), dtype=torch.float32, device=dev)
    sc = torch.empty((N,), dtype=torch.float32, device=dev)
    has_mul = col_mul is not None
    mul = col_mul if has_mul else sr  # never read without HAS_MUL
    name = "quantize_dual_triton"
    bm, bn, warps = _tiles(amax_tiles, _CPU_TILES if small else _DUAL_AMAX_TILES, "amax_tiles", name)
    if chunk_m is None:
        chunk_m = 32 if small and amax_tiles is None else _chunk_rows(M, N, bn, bm)
    if chunk_m % bm:
        raise ValueError(f"quantize_dual_triton: chunk_m ({chunk_m}) must be a multiple of the absmax tile's rows "
                         f"({bm})")
    n_chunks, n_blocks = triton.cdiv(M, chunk_m), triton.cdiv(N, bn)
    rpart = torch.empty((n_blocks, M), dtype=torch.int32, device=dev)  # absmax bits (see _abs_bits)
    cpart = torch.empty((n_chunks, N), dtype=torch.int32, device=dev)
    wrap_triton(_dual_amax_kernel)[(n_chunks, n_blocks)](
        g, mul, rpart, cpart, M, N, g.stride(0), g.stride(1), HAS_MUL=has_mul, CHUNK_M=chunk_m, BLOCK_M=bm,
        BLOCK_N=bn, num_warps=warps)
    bp, bl = (4, 16) if small else _DUAL_REDUCE
    wrap_triton(_dual_scales_kernel)[(triton.cdiv(M, bl) + triton.cdiv(N, bl),)](
        rpart, cpart, sr, sc, M, N, n_blocks, n_chunks, QMAX=qmax, BLOCK_P=bp, BLOCK_L=bl, num_warps=4)
    bm, bn, warps = _tiles(quant_tiles, _CPU_TILES if small else _DUAL_QUANT_TILES, "quant_tiles", name)
    wrap_triton(_dual_quantize_kernel)[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        g, mul, sr, sc, qr, qc, M, N, g.stride(0), g.stride(1), QMAX=qmax, IS_INT8=qdtype == torch.int8,
        HAS_MUL=has_mul, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return qr, sr, qc, sc
