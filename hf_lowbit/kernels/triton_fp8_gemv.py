"""Triton decode kernel for the row-wise FP8 linear: ``y = (q(x) @ w.T) * s_x[:, None] * s_w[None, :] (+ bias)``.

What torchao's ``Float8Tensor`` linear (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)
computes, for a few activation rows (M ≤ 16: decoding): each row of ``x`` quantized to e4m3 with
``s_x = amax(|x|) / 448`` (the division in ``x``'s dtype, as torchao's ``_choose_scale_float8``, held in float32),
codes ``e4m3(clamp(x / s_x, ±448))`` (torchao's ``_quantize_affine_float8``), products of codes summed in float32
(exact products: two e4m3 values multiply exactly in float32), scales and bias applied to the float32 sum, one
rounding to ``x``'s dtype. One departure: a row whose scale is 0 (all zeros) takes scale 1, codes 0 and gives the
bias, where torchao's 0/0 makes the row NaN (as :func:`hf_lowbit.kernels.fake_quant.fake_quant_fp8_rowwise`).

Design, for bandwidth at M = 1..16 (the fp8 weight is the whole traffic: 16 MiB for a 4096² layer, 3.5 µs at the
H200's ~4.8 TB/s):

* **One program per (BLOCK_N weight rows, K slice)**: it streams its ``[BLOCK_N, K/SPLIT_K]`` piece of the weight
  (K contiguous, ``BLOCK_K`` bytes a row a step, pipelined by ``num_stages``) once; nothing else of size N·K moves.
  ``SPLIT_K`` (chosen so that about two programs run per SM) keeps all SMs busy on narrow layers (k/v projections:
  N = 1024 is 16 tiles of 64 rows): each split writes its scaled float32 partial to a workspace and a second tiny
  kernel sums the splits, adds the bias and casts. With ``SPLIT_K = 1`` (wide layers: MLP, LM head) the epilogue
  is fused and the kernel is the only launch.
* **The activation is quantized inside the GEMV**: each program reads its rows of ``x`` (bf16, ``[M, K]``: 8-28 KiB
  a row, from L2 after the first program) for the absmax over all of K, then quantizes its K slice on the fly
  (``PRE_SCALE=False``). No codes tensor, no quantization kernel, no extra launch: at M = 1 the per-program absmax
  re-reads of ``x`` are a few per cent of the weight's bytes. For larger M (> ``FUSE_AMAX_MAX_M`` rows) those
  re-reads grow with M × programs, so a tiny first kernel (one program per row) computes the M scales once and the
  GEMV reads them (``PRE_SCALE=True``); it still quantizes its slice itself.
* **The dot**: codes are converted to fp16 (every e4m3 value is exact in fp16) and multiplied on the tensor cores
  with float32 accumulation (``tl.dot``, the weight tile as the left operand: ``[BLOCK_N, BLOCK_K] @ [BLOCK_K,
  BLOCK_M]``, BLOCK_M = 16 rows with the missing ones masked to 0: free, the kernel is memory bound). Not the fp8
  tensor-core path, whose Hopper accumulator is not a full float32 one. Under ``TRITON_INTERPRET=1`` the dot runs on
  float32 operands (``input_precision="ieee"``): the same products, exactly, summed in float32.
* Divisions are IEEE (``div_rn``), the scale is rounded to ``x``'s dtype round-to-nearest-even and the e4m3 cast is
  round-to-nearest-even with saturation (``clamp`` first, as torchao): the codes are torchao's bit for bit
  (:func:`act_quant_triton` writes them, for the tests).

Tiles are constexprs: H200 defaults in :data:`H200_TILES`, small ones under the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# FP8_MAX (448) is written literally in the jit functions: compiled Triton reads no non-constexpr global
BLOCK_M = 16  # rows of x a program holds (M <= 16; the dot's smallest tile)
MAX_M = 16  # the decode kernel's rows; more rows (prefill) go to torch._scaled_mm
FUSE_AMAX_MAX_M = 4  # up to this many rows each program finds the absmax itself; more: a scale kernel first
# (BLOCK_N, BLOCK_K, num_warps, num_stages): a 64 x 256 fp8 weight tile is 16 KiB a step, 4 stages in flight
H200_TILES = (64, 256, 4, 4)
INTERPRET_TILES = (16, 32, 1, 1)
TARGET_PROGRAMS = 264  # two per SM on the H200 (132 SMs)


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
def _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 scales of rows ``offs_m`` of x: amax(|x|)/448 rounded to x's dtype (torchao), 0 -> 1."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    scale = tl.math.div_rn(amax, 448.0)  # FP8_MAX
    # torchao divides in x's dtype: the float32 quotient rounded to it (nearest, ties to even). bf16 by its bits
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
                      WRITE_CODES: tl.constexpr, SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per BLOCK_M rows: their scales, and (``WRITE_CODES``) their codes ``q`` [M, K] contiguous."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M, BLOCK_K)
    tl.store(scale_ptr + offs_m, scale, mask=offs_m < M)
    if WRITE_CODES:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            kk = k0 * BLOCK_K + offs_k
            mask = (offs_m[:, None] < M) & (kk[None, :] < K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk, mask=mask, other=0.0)
            q = _encode(x.to(tl.float32), scale, SOFT).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + offs_m[:, None] * K + kk[None, :], q, mask=mask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_om, stride_on,
    PRE_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        sx = _row_scale(x_ptr, stride_xm, stride_xk, offs_m, M, K, BLOCK_M, BLOCK_K)

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
        if SOFT:  # the interpreter: float32 operands, IEEE products (exact) and sums
            acc = tl.dot(w.to(tl.float32), tl.trans(q.to(tl.float32)), acc, input_precision="ieee",
                         out_dtype=tl.float32)
        else:  # e4m3 values are exact in fp16; fp16 tensor cores accumulate in float32
            acc = tl.dot(w.to(tl.float16), tl.trans(q.to(tl.float16)), acc, out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk

    sw = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc * sx[None, :] * sw[:, None]  # [BLOCK_N, BLOCK_M]: (sum * s_x) * s_w, as the reference
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on,
                 _to_out(out, out_ptr, SOFT), mask=mask)
    else:  # the split's float32 partial: ws [SPLIT_K, M, N]
        tl.store(ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], out, mask=mask)


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


def act_quant_triton(x: torch.Tensor, write_codes: bool = True, block_k: int | None = None,
                     soft: bool | None = None):
    """``(codes [M, K] e4m3 or None, scales [M] float32)`` of the rows of ``x`` [M, K] (any strides): the
    quantization the GEMV applies in its programs (the same jit functions)."""
    M, K = x.shape
    block_k = block_k or _tiles()[1]
    scale = torch.empty(M, dtype=torch.float32, device=x.device)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device) if write_codes else scale
    wrap_triton(_act_quant_kernel)[(triton.cdiv(M, BLOCK_M),)](
        x, scale, q, M, K, x.stride(0), x.stride(1), WRITE_CODES=write_codes, SOFT=_soft(soft), BLOCK_M=BLOCK_M, BLOCK_K=block_k)
    return (q if write_codes else None), scale


def fp8_gemv_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                    block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                    pre_scale: bool | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, soft: bool | None = None) -> torch.Tensor:
    """Launch the decode GEMV: ``x`` [M <= 16, K] (bf16/fp16/fp32, any strides), ``w`` [N, K] e4m3 with K
    contiguous, ``w_scale`` [N] float32, ``bias`` [N] or None; ``[M, N]`` in ``x``'s dtype. Keyword arguments
    override the tiles and the choices (defaults: :data:`H200_TILES`, :func:`choose_split_k`,
    ``pre_scale = M > FUSE_AMAX_MAX_M``; ``soft``: the e4m3 rounding in float32 arithmetic and float32 dot
    operands, the interpreter's way, also on a GPU for the tests)."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M:
        raise ValueError(f"fp8_gemv_triton: at most {MAX_M} rows, got {M}")
    if w.stride(1) != 1:
        raise ValueError("fp8_gemv_triton: the weight must have K contiguous")
    bn, bk, warps, stages = _tiles()
    bn, bk = block_n or bn, block_k or bk
    warps, stages = num_warps or warps, num_stages or stages
    split = split_k or choose_split_k(N, K, bn, bk)
    pre = M > FUSE_AMAX_MAX_M if pre_scale is None else pre_scale
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)  # no empty splits
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    w_scale = w_scale.reshape(-1)
    x_scale = act_quant_triton(x, write_codes=False, block_k=bk, soft=soft)[1] if pre else w_scale  # never read without PRE
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else w_scale
    has_bias = bias is not None
    bias_ = bias if has_bias else w_scale  # never read without HAS_BIAS
    wrap_triton(_fp8_gemv_kernel)[(triton.cdiv(N, bn), split)](
        x, w, x_scale, w_scale, bias_, out, ws, M, N, K, k_per_split,
        x.stride(0), x.stride(1), w.stride(0), out.stride(0), out.stride(1),
        PRE_SCALE=pre, HAS_BIAS=has_bias, SPLIT_K=split, SOFT=_soft(soft),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if split > 1:
        block = 1024 if not _INTERPRET else 64
        wrap_triton(_split_k_reduce_kernel)[(triton.cdiv(M * N, block),)](
            ws, bias_, out, M, N, out.stride(0), out.stride(1), HAS_BIAS=has_bias, SPLIT_K=split, SOFT=_soft(soft), BLOCK=block)
    return out
