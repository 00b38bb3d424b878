"""Triton decode kernel for the row-wise FP8 linear: ``y = (q(x) @ w.T) * s_x[:, None] * s_w[None, :] (+ bias)``.

What torchao's ``Float8Tensor`` linear (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)
computes, for a few activation rows (M ≤ 16: decoding): each row of ``x`` quantized to e4m3 with
``s_x = amax(|x|) / 448`` (the division in ``x``'s dtype, as torchao's ``_choose_scale_float8``, held in float32),
codes ``e4m3(clamp(x / s_x, ±448))`` (torchao's ``_quantize_affine_float8``), products of codes summed in float32
(exact products: two e4m3 values multiply exactly in float32), scales and bias applied to the float32 sum, one
rounding to ``x``'s dtype. One departure: a row whose scale is 0 (all zeros) takes scale 1, codes 0 and gives the
bias, where torchao's 0/0 makes the row NaN (as :func:`hf_lowbit.kernels.fake_quant.fake_quant_fp8_rowwise`).

Two designs (``design=``, :data:`DESIGNS`; both memory bound on the fp8 weight, 16 MiB for a 4096² layer, 3.5 µs
at the H200's ~4.8 TB/s), both measured by benchmarks/benchmark_fp8_gemv.py in one run:

* ``"codes"`` (:data:`DEFAULT_DESIGN`): a row kernel quantizes the activation once (one program a row, the whole
  row in registers: one read of x, no loop; codes [M, K] e4m3 and scales [M] float32, 8-28 KiB) and the GEMV
  streams only the weight and reads the codes (from L2). At M = 1, no ``tl.dot``: the weight tile and the codes
  converted to float32 in registers, their products accumulated elementwise in a float32 tile, one row sum at the
  end; above, ``tl.dot`` on fp16 operands (``use_dot``). The loop is a ``tl.range(num_stages=...)``: Triton
  pipelines a loop without a dot only when asked (16-byte ``cp.async`` copies, ``num_stages - 1`` steps in
  flight), tiles chosen for registers (64 float32 accumulators a thread, 4 programs an SM) and bytes in flight
  (:data:`H200_CODES_TILES`, split K for :data:`CODES_TARGET_PROGRAMS`). The default because the ``fused``
  design measured 3-4x slower than ``torch._scaled_mm`` on the H200 (docs/results/fp8_gemv_h200.md) and its
  sm_90 code shows why (below); not measured yet on a GPU itself: the next run of the benchmark decides.
* ``"fused"`` (the first design): the activation quantized inside the GEMV, each program finding its rows' absmax
  over all of K itself (M <= ``FUSE_AMAX_MAX_M``; above, a scale kernel first) and dividing its slice of x by the
  scale in every step, ``tl.dot`` on fp16 operands at every M with BLOCK_M = 16 rows padded. Its sm_90 code (H200
  tiles 64 x 256, 4 warps, 4 stages): 255 registers (spills with the scale kernel), 32 ``div.rn.f32`` a thread a
  step (the padded rows too), the weight copied by 8-byte ``cp.async``, x by scalar 2-byte loads unless its
  stride 1 is specialized, the wgmma waited for in every step, and at M = 1 the serial absmax loop over K before
  the first weight byte moves.

Both: one program per (BLOCK_N weight rows, K slice) streams its ``[BLOCK_N, K/SPLIT_K]`` piece of the weight once;
``SPLIT_K`` > 1 (narrow layers: k/v projections) writes scaled float32 partials to a workspace that a second tiny
kernel sums in a fixed order, adds the bias and casts; with ``SPLIT_K = 1`` the epilogue is fused.

Exactness contract (what the tests check): the activation codes and scales are torch's bit for bit on the device
(:func:`_scale_of`: the scale's division as torch does it there; divisions of x by the scale IEEE, ``div_rn``; the
e4m3 cast round-to-nearest-even with saturation, ``clamp`` first, as torchao; :func:`act_quant_triton` writes
them for the tests). Every product of two e4m3 values is exact in float32 (and in the fp16 tensor cores' float32
accumulation), so the GEMV differs from the reference only by the order of its float32 sums (per lane over the
steps, then a tree; the dot's order): within ``(K + 8)`` float32 roundings of the products' magnitudes, then one
rounding to x's dtype. Not the fp8 tensor-core path, whose Hopper accumulator is not a full float32 one. Under
``TRITON_INTERPRET=1`` the dot runs on float32 operands (``input_precision="ieee"``): the same products, exactly.
Compiled torch (Inductor's Triton) divides x by the scale with the approximate ``div.full.f32`` unless
``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1``: a compiled torchao quantization can differ from these codes by
one e4m3 step where x / scale falls within 2 ulp of a rounding boundary (rare: ~2^-18 of the elements).

Tiles are constexprs: H200 defaults in :data:`H200_TILES`, small ones under the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import on_operand_device
from .triton_quant import SERVING_ADVICE, _check_32bit_offsets

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# FP8_MAX (448) is written literally in the jit functions: compiled Triton reads no non-constexpr global
BLOCK_M = 16  # rows of x a program holds (M <= 16; the dot's smallest tile)
MAX_M = 16  # the decode kernel's rows; more rows (prefill) go to torch._scaled_mm
FUSE_AMAX_MAX_M = 4  # up to this many rows each program finds the absmax itself; more: a scale kernel first
# (BLOCK_N, BLOCK_K, num_warps, num_stages): a 64 x 256 fp8 weight tile is 16 KiB a step, 4 stages in flight
H200_TILES = (64, 256, 4, 4)
INTERPRET_TILES = (16, 32, 1, 1)
TARGET_PROGRAMS = 264  # two per SM on the H200 (132 SMs)
# the "codes" design, (BLOCK_N, BLOCK_K, num_warps, num_stages) by rows: M = 1, the row sums: a 32 x 256 tile is
# 8 KiB a step, 3 steps in flight (16-byte cp.async), 64 float32 accumulators a thread (128 registers, no spills:
# 4 programs an SM); M > 1, the dot at 32 x 256 (mma.sync, 48 registers, 16-byte cp.async; a 64-row tile takes
# wgmma, 185 registers and 8-byte copies). sm_90 compile, tests/_triton_sm90_compile.py
H200_CODES_TILES = {1: (32, 256, 4, 4), 16: (32, 256, 4, 4)}
CODES_TARGET_PROGRAMS = 528  # four per SM (what the registers let run at once): more steps in flight
ROW_MAX_K = 32768  # the row quantization kernel holds a whole row (a power of two >= K) in registers
DESIGNS = ("fused", "codes")
DEFAULT_DESIGN = "codes"  # see the module docstring: "fused" is the design measured on the H200 first


@triton.jit
def _round_bf16(v):
    """float32 ``v`` rounded to the nearest bf16 (ties to even), as float32: by its bits, exact on a GPU and in the
    interpreter, whose float32 -> bf16 casts truncate (Triton 3.6)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_out(v, out_ptr, SOFT: tl.constexpr):
    """float32 ``v`` cast to the output's dtype, nearest (bf16 rounded by its bits first under ``SOFT``)."""
    if SOFT and out_ptr.dtype.element_ty == tl.bfloat16:
        v = _round_bf16(v)
    return v.to(out_ptr.dtype.element_ty)


@triton.jit
def _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               RECIP: tl.constexpr):
    """float32 scales of rows ``offs_m`` of x: amax(|x|)/448 rounded to x's dtype (torchao, :func:`_scale_of`)."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return _scale_of(amax, x_ptr, RECIP)


@triton.jit
def _scale_of(amax, x_ptr, RECIP: tl.constexpr):
    """float32 scales ``amax / 448`` as torch computes torchao's ``max_abs / quant_max`` on the device, rounded to
    x's dtype, 0 -> 1. ``RECIP`` (CUDA): ``amax * fl32(1/448)``, one rounding: a division of a CUDA tensor by a
    Python scalar is a multiplication by the scalar's float32 reciprocal, eagerly (ATen's ``div_true_kernel_cuda``)
    and compiled (Inductor's ``div_prim`` on a non-CPU device); it differs from the quotient in the last bit of
    some float32 scales. Otherwise (CPU, eager and Inductor): the correctly rounded quotient."""
    if RECIP:
        scale = amax * 0.0022321429569274187  # fl32(1/448) = 0x3B124925, exactly
    else:
        scale = tl.math.div_rn(amax, 448.0)  # FP8_MAX
    # torchao divides in x's dtype: the float32 result rounded to it (nearest, ties to even). bf16 by its bits
    # (the interpreter's float32 -> bf16 casts do not round to nearest, Triton 3.6); fp16 by the cast
    if x_ptr.dtype.element_ty == tl.bfloat16:
        scale = _round_bf16(scale)
    elif x_ptr.dtype.element_ty == tl.float16:
        scale = scale.to(tl.float16).to(tl.float32)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _encode(x, scale, SOFT: tl.constexpr):
    """e4m3 codes of float32 ``x`` [BLOCK_M, BLOCK_K] for row scales ``scale`` [BLOCK_M]: ``e4m3(clamp(x / scale,
    ±448))``, nearest, ties to even. Native: the hardware cast (``cvt.rn.satfinite``), an fp8 tensor. ``SOFT``: the
    same rounding in float32 arithmetic, the code's value as float32 (exact): the interpreter's float32 -> fp8 cast
    rounds ties up and drops the carry into the exponent (Triton 3.6's ``_convert_float``)."""
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)  # ±FP8_MAX
    if SOFT:
        # the e4m3 step at y: 2^(e - 3) for y's exponent e, e >= -6 (below: the subnormals' fixed step 2^-9)
        e = ((y.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.maximum(e, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
        r = y * inv  # exact (a power of two), |r| < 16
        r = (r + 12582912.0) - 12582912.0  # to an integer, ties to even (1.5 * 2^23)
        v = r * step
        return tl.where(v == 0.0, y * 0.0, v)  # keep the sign of a value that rounds to zero (-0 has its code)
    else:  # not after the if: compiled Triton then sees both returns and refuses their different types
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _act_quant_kernel(x_ptr, scale_ptr, q_ptr, M, K, stride_xm, stride_xk,
                      WRITE_CODES: tl.constexpr, SOFT: tl.constexpr, RECIP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """One program per BLOCK_M rows: their scales, and (``WRITE_CODES``) their codes ``q`` [M, K] contiguous."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M, BLOCK_K, RECIP)
    tl.store(scale_ptr + offs_m, scale, mask=offs_m < M)
    if WRITE_CODES:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(tl.cdiv(K, BLOCK_K)):
            kk = k0 * BLOCK_K + offs_k
            mask = (offs_m[:, None] < M) & (kk[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mask, other=0.0)
            q = _encode(x.to(tl.float32), scale, SOFT).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + offs_m[:, None] * K + kk[None, :], q, mask=mask)


@triton.jit
def _dot_codes(w, q, acc, SOFT: tl.constexpr):
    """``acc + w @ q.T`` for e4m3 weight ``w`` [BLOCK_N, BLOCK_K] and activation codes ``q`` [BLOCK_M, BLOCK_K]:
    fp16 tensor cores (every e4m3 value is exact in fp16) accumulating in float32; under ``SOFT`` (the interpreter)
    float32 operands, IEEE products (exact) and sums."""
    if SOFT:
        return tl.dot(w.to(tl.float32), tl.trans(q.to(tl.float32)), acc, input_precision="ieee", out_dtype=tl.float32)
    else:  # not after the if: compiled Triton then sees both returns
        return tl.dot(w.to(tl.float16), tl.trans(q.to(tl.float16)), acc, out_dtype=tl.float32)


@triton.jit
def _store_tile(acc, sx, sw, offs_m, offs_n, mask_m, mask_n, bias_ptr, out_ptr, ws_ptr, pid_k, M, N, stride_om,
                stride_on, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr):
    """The GEMVs' epilogue for a ``[BLOCK_N, BLOCK_M]`` float32 sum ``acc``: ``(sum * s_x) * s_w`` as the reference,
    then (``SPLIT_K = 1``) the bias and one rounding into ``out``, or the split's float32 partial into
    ``ws [SPLIT_K, M, N]``."""
    out = acc * sx[None, :] * sw[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on,
                 _to_out(out, out_ptr, SOFT), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], out, mask=mask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_om, stride_on,
    PRE_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr,
    RECIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if PRE_SCALE:
        sx = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=1.0)
    else:
        sx = _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M, BLOCK_K, RECIP)

    k_start = pid_k * K_PER_SPLIT  # K_PER_SPLIT: a multiple of BLOCK_K
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the weight is [N, K] with K contiguous (the layout of torchao's qdata): each row streams BLOCK_K bytes a step
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    for k0 in range(k_start, k_end, BLOCK_K):
        kmask = (k0 + offs_k) < k_end
        w = tl.load(w_ptrs, mask=mask_n[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & kmask[None, :], other=0.0)
        q = _encode(x.to(tl.float32), sx, SOFT)
        acc = _dot_codes(w, q, acc, SOFT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk

    sw = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    _store_tile(acc, sx, sw, offs_m, offs_n, mask_m, mask_n, bias_ptr, out_ptr, ws_ptr, pid_k, M, N, stride_om,
                stride_on, HAS_BIAS, SPLIT_K, SOFT)


@triton.jit
def _act_quant_rows_kernel(x_ptr, scale_ptr, q_ptr, K, stride_xm, stride_xk,
                           SOFT: tl.constexpr, RECIP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``codes`` design's activation quantization: one program per row, the whole row in registers
    (``BLOCK_K >= K``): one read of x, its scale, its codes ``q`` [M, K] contiguous. No loop: at decode a chain
    of dependent loads over K would be pure latency before the GEMV can start."""
    row = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    mask = offs_k < K
    x = tl.load(x_ptr + row * stride_xm + offs_k * stride_xk, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=0), x_ptr, RECIP)
    tl.store(scale_ptr + row, scale)
    q = _encode(x[None, :], tl.full((1,), 1.0, tl.float32) * scale, SOFT).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * K + offs_k[None, :], q, mask=mask[None, :])


@triton.jit
def _fp8_gemv_codes_kernel(
    q_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_wn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The ``codes`` design's GEMV: the activation codes ``q`` [M, K] e4m3 and scales [M] come from
    :func:`_act_quant_rows_kernel`; the program streams its ``[BLOCK_N, K/SPLIT_K]`` piece of the weight.
    ``USE_DOT=False`` (M = 1): each step's weight tile and the step's codes converted to float32 in registers,
    their exact products accumulated elementwise in a [BLOCK_N, BLOCK_K] float32 tile, one row sum at the end.
    ``USE_DOT=True`` (M > 1): ``tl.dot`` of fp16 operands (every e4m3 value is exact in fp16) with float32
    accumulation, ``BLOCK_M`` = 16 rows of codes, the missing ones masked to 0. The loop is a ``tl.range`` with
    ``NUM_STAGES``: Triton pipelines a loop without a dot only when asked, with 16-byte ``cp.async`` copies of
    NUM_STAGES - 1 steps ahead into shared memory (1: plain ``ld.global.v4`` loads, no shared memory)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT  # K_PER_SPLIT: a multiple of BLOCK_K
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # the weight is [N, K] with K contiguous (the layout of torchao's qdata): each row streams BLOCK_K bytes a step
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    sw = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    offs_m = tl.arange(0, BLOCK_M)  # BLOCK_M = 1 without the dot
    mask_m = offs_m < M
    if USE_DOT:
        q_ptrs = q_ptr + offs_m[:, None] * K + (k_start + offs_k)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            kmask = (k0 + offs_k) < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None] & kmask[None, :], other=0.0)
            q = tl.load(q_ptrs, mask=mask_m[:, None] & kmask[None, :], other=0.0)
            acc = _dot_codes(w, q, acc, SOFT)
            w_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
    else:  # M = 1
        q_ptrs = q_ptr + k_start + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            kmask = (k0 + offs_k) < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None] & kmask[None, :], other=0.0)
            q = tl.load(q_ptrs, mask=kmask, other=0.0)
            acc2 += w.to(tl.float32) * q.to(tl.float32)[None, :]  # exact products (an FMA changes nothing)
            w_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
    sx = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=1.0)
    _store_tile(acc, sx, sw, offs_m, offs_n, mask_m, mask_n, bias_ptr, out_ptr, ws_ptr, pid_k, M, N, stride_om,
                stride_on, HAS_BIAS, SPLIT_K, SOFT)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_on,
                           HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index m * N + n
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n * stride_on, _to_out(acc, out_ptr, SOFT), mask=mask)


def _tiles():
    return INTERPRET_TILES if _INTERPRET else H200_TILES


def codes_tiles(m: int) -> tuple[int, int, int, int]:
    """The ``codes`` design's ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``m`` rows (under the interpreter:
    small ones)."""
    if _INTERPRET:
        return INTERPRET_TILES
    return H200_CODES_TILES[1 if m == 1 else 16]


def choose_split_k(N: int, K: int, block_n: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """Splits of K so that about ``target`` programs run (a power of two, at least one BLOCK_K step a split)."""
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split * 2 <= target and triton.cdiv(K, block_k) >= split * 2:
        split *= 2
    return split


def _soft(soft: bool | None) -> bool:
    if soft is None:
        return _INTERPRET
    if _INTERPRET and not soft:
        raise ValueError("the interpreter's float32 -> fp8 cast is wrong (Triton 3.6): soft=False only on a GPU")
    return soft


def _recip(x: torch.Tensor, recip: bool | None) -> bool:
    """The scale's formula: torch's on ``x``'s device (:func:`_scale_of`) unless ``recip`` says otherwise."""
    return x.device.type == "cuda" if recip is None else recip


@on_operand_device
def act_quant_triton(x: torch.Tensor, write_codes: bool = True, block_k: int | None = None,
                     soft: bool | None = None, recip: bool | None = None, rows: bool | None = None):
    """``(codes [M, K] e4m3 or None, scales [M] float32)`` of the rows of ``x`` [M, K] (any strides): the
    quantization the GEMVs apply (the same jit functions). ``rows``: the ``codes`` design's kernel (one program
    a row, the whole row at once; default when writing codes and K <= :data:`ROW_MAX_K`), else the looped one
    (BLOCK_M rows a program, K in ``block_k`` steps: the ``fused`` design's scale kernel). ``recip``: the scale
    as torch computes it on CUDA (default: on CUDA tensors), see :func:`_scale_of`. Offsets are 32-bit: an ``x``
    spanning 2**31 elements or more is refused, before any launch (the codes are ``x``'s size)."""
    _check_32bit_offsets("act_quant_triton", x, SERVING_ADVICE)
    M, K = x.shape
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device) if write_codes else scale
    if rows is None:
        rows = write_codes and K <= ROW_MAX_K
    if rows:
        if not write_codes:
            raise ValueError("act_quant_triton: the row kernel always writes codes")
        bk = triton.next_power_of_2(K)
        wrap_triton(_act_quant_rows_kernel)[(M,)](
            x, scale, q, K, x.stride(0), x.stride(1), SOFT=_soft(soft), RECIP=_recip(x, recip), BLOCK_K=bk,
            num_warps=4 if bk <= 4096 else 8)
    else:
        block_k = block_k or _tiles()[1]
        wrap_triton(_act_quant_kernel)[(triton.cdiv(M, BLOCK_M),)](
            x, scale, q, M, K, x.stride(0), x.stride(1), WRITE_CODES=write_codes, SOFT=_soft(soft),
            RECIP=_recip(x, recip), BLOCK_M=BLOCK_M, BLOCK_K=block_k)
    return (q if write_codes else None), scale


@on_operand_device
def _split_k_reduce(ws, bias, out, split, soft):
    M, N = out.shape
    block = 1024 if not _INTERPRET else 64
    has_bias = bias is not None
    wrap_triton(_split_k_reduce_kernel)[(triton.cdiv(M * N, block),)](
        ws, bias if has_bias else ws, out, M, N, out.stride(0), out.stride(1), HAS_BIAS=has_bias, SPLIT_K=split,
        SOFT=soft, BLOCK=block)


@on_operand_device
def fp8_gemv_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                    design: str | None = None, block_n: int | None = None, block_k: int | None = None,
                    split_k: int | None = None, pre_scale: bool | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, use_dot: bool | None = None, soft: bool | None = None,
                    recip: bool | None = None) -> torch.Tensor:
    """Launch the decode GEMV: ``x`` [M <= 16, K] (bf16/fp16/fp32, any strides), ``w`` [N, K] e4m3 with K
    contiguous, ``w_scale`` [N] float32, ``bias`` [N] or None; ``[M, N]`` in ``x``'s dtype.

    ``design`` (:data:`DESIGNS`, default :data:`DEFAULT_DESIGN`): ``"fused"``, the activation quantized inside the
    GEMV; ``"codes"``, quantized once by a row kernel, the GEMV streaming the weight (row sums at M = 1, the dot
    above; ``use_dot`` overrides). Keyword arguments override the tiles and the choices (defaults:
    :data:`H200_TILES` / :data:`H200_CODES_TILES`, :func:`choose_split_k`, ``pre_scale = M > FUSE_AMAX_MAX_M``
    (``fused`` only); ``soft``: the e4m3 rounding in float32 arithmetic and float32 dot operands, the
    interpreter's way, also on a GPU for the tests; ``recip``: the scale's formula, :func:`_scale_of`).

    Offsets are 32-bit (a decode's operands are far below 2**31 elements): an ``x`` or ``w`` past that is refused,
    before any launch."""
    for t in (x, w):
        _check_32bit_offsets("fp8_gemv_triton", t, SERVING_ADVICE)
    M, K = x.shape
    N = w.shape[0]
    design = design or DEFAULT_DESIGN
    if design not in DESIGNS:
        raise ValueError(f"fp8_gemv_triton: design must be one of {DESIGNS}, got {design!r}")
    if M > MAX_M:
        raise ValueError(f"fp8_gemv_triton: at most {MAX_M} rows, got {M}")
    if w.stride(1) != 1:
        raise ValueError("fp8_gemv_triton: the weight must have K contiguous")
    if use_dot is False and design == "codes" and M > 1:  # (BLOCK_M = 1: the first row alone)
        raise ValueError(f"fp8_gemv_triton: use_dot=False is the one-row GEMV, got {M} rows")
    if M == 0:  # nothing to compute; the one-row kernels read x's (codes') first row without a row mask
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    soft_, recip_ = _soft(soft), _recip(x, recip)
    bn, bk, warps, stages = _tiles() if design == "fused" else codes_tiles(M)
    bn, bk = block_n or bn, block_k or bk
    warps, stages = num_warps or warps, num_stages or stages
    split = split_k or choose_split_k(N, K, bn, bk, TARGET_PROGRAMS if design == "fused" else CODES_TARGET_PROGRAMS)
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)  # no empty splits
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # the kernels read the scales and the bias as contiguous vectors: strided views are copied (N values)
    w_scale = w_scale.reshape(-1).contiguous()
    bias = None if bias is None else bias.reshape(-1).contiguous()
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else w_scale
    _check_32bit_offsets("fp8_gemv_triton", ws, SERVING_ADVICE)  # (the split-K partials; out is [M, N], fewer)
    has_bias = bias is not None
    bias_ = bias if has_bias else w_scale  # never read without HAS_BIAS
    if design == "fused":
        pre = M > FUSE_AMAX_MAX_M if pre_scale is None else pre_scale
        x_scale = act_quant_triton(x, write_codes=False, block_k=bk, soft=soft, recip=recip)[1] if pre else w_scale
        wrap_triton(_fp8_gemv_kernel)[(triton.cdiv(N, bn), split)](
            x, w, x_scale, w_scale, bias_, out, ws, M, N, K, k_per_split,
            x.stride(0), x.stride(1), w.stride(0), out.stride(0), out.stride(1),
            PRE_SCALE=pre, HAS_BIAS=has_bias, SPLIT_K=split, SOFT=soft_, RECIP=recip_,
            BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    else:
        q, x_scale = act_quant_triton(x, soft=soft, recip=recip)
        dot = M > 1 if use_dot is None else use_dot
        wrap_triton(_fp8_gemv_codes_kernel)[(triton.cdiv(N, bn), split)](
            q, w, x_scale, w_scale, bias_, out, ws, M, N, K, k_per_split,
            w.stride(0), out.stride(0), out.stride(1),
            HAS_BIAS=has_bias, SPLIT_K=split, SOFT=soft_, USE_DOT=dot,
            BLOCK_M=BLOCK_M if dot else 1, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    if split > 1:
        _split_k_reduce(ws, bias, out, split, soft_)
    return out
