"""Triton kernels for a W4A16 linear with tinygemm's numerics: ``y = x @ W.T``, ``W`` stored as int4 codes.

Layout (:mod:`hf_lowbit.kernels.int4`): ``packed [N, K/2]`` uint8, code ``q[n, 2j]`` in the low nibble of
``packed[n, j]`` and ``q[n, 2j + 1]`` in the high one (packed along K); ``scales``, ``zeros`` ``[N, K/group_size]``
bf16. The weight is ``W[n, k] = bf16((q - 8) · scale + zero)``, the product and the sum formed in float32
(``(q - 8)·scale`` is exact there: 4 × 8 significant bits) and rounded to bf16 once, as tinygemm's
``fma.rn.bf16x2`` does (:func:`hf_lowbit.kernels.fake_quant.fake_quant_int4_tinygemm`). Products with bf16 ``x``
are exact in float32, accumulated in float32, bf16 out.

* :func:`int4_decode_triton` (M ≤ ``DECODE_MAX_M`` rows): a split-K GEMV built to stream the weight. Program
  ``(pid_n, pid_k)`` owns ``BLOCK_N`` weight rows and the ``pid_k``-th of ``SPLIT_K`` equal slices of K; it walks
  its slice ``BLOCK_K`` columns at a time (``BLOCK_N × BLOCK_K/2`` contiguous bytes a step, ``BLOCK_K`` ≤ the group,
  so a step needs one scale and one zero per row), unpacks in registers (the low nibbles are the even columns, the
  high ones the odd: ``x`` is read as its even and odd columns, so nothing is interleaved), and accumulates
  ``[BLOCK_M, BLOCK_N]`` float32. M = 1: elementwise products and a row sum (no tensor cores, nothing through
  shared memory); 2..16 rows: ``tl.dot`` on the bf16 weight tile (x padded to 16 rows). ``SPLIT_K = 1`` stores bf16
  directly; otherwise each slice writes float32 partials ``[SPLIT_K, M, N]`` and a second small kernel sums them in
  a fixed order (deterministic, no atomics, no zero-filled buffer) and rounds once. ``SPLIT_K`` is chosen so that
  there are about ``_WAVES`` waves of programs on the GPU's SMs (132 on the H200): e.g. 4096→1024 (k/v) has only
  32 row tiles of 32, so K is split 8 ways.
* :func:`int4_dequant_triton` (large M, prefill): the bf16 weight written once, then cuBLAS (``F.linear``) in
  :func:`hf_lowbit.kernels.int4.int4_linear`. Costs one bf16 weight of memory transiently and a write + read of it
  (~1.2 GB for 8 Llama-8B layers: ~0.5 ms at 4.8 TB/s against ~13 ms of bf16 prefill matmuls).

Tiles are constexprs with defaults for the H200 (``DECODE_TILES``); under ``TRITON_INTERPRET=1`` 16-wide tiles so
the kernels can be checked on a CPU (as :mod:`hf_lowbit.kernels.triton_int8` does). Measured on the H200
(docs/results/int4_mm_h200.md): this first GEMV 0.26-0.34x tinygemm at one row, the tile GEMV below 0.45-0.75x.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import on_operand_device
from .triton_quant import SERVING_ADVICE, _check_32bit_offsets

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# 0x4B000000 is 2**23 as float32: OR-ing a 4-bit code into its mantissa gives 2**23 + q exactly, and subtracting
# 2**23 + 8 gives q - 8: two integer/float ops a code instead of an int->float conversion (quarter rate on GPUs)
_MAGIC_BITS = 0x4B000000

# (BLOCK_N, BLOCK_K, num_warps) of the decode kernel for M = 1 and for M in 2..16 (BLOCK_K is capped at the group
# size). H200 guesses, not tuned: 32 rows x 128 columns = 2 KB of codes a step, 16 B a thread with 4 warps.
DECODE_TILES = {1: (32, 128, 4), 16: (32, 128, 4)}
DECODE_TILES_INTERPRET = {1: (16, 32, 1), 16: (16, 32, 1)}
DEQUANT_TILES = (64, 128, 4)  # BLOCK_N, BLOCK_K (capped at the group size), warps
DEQUANT_TILES_INTERPRET = (16, 32, 1)
_WAVES = 2  # programs wanted per SM, at least, before K is split further
_MAX_SPLIT_K = 16
# the tile layout's GEMVs (the serving path) split K at most 7 ways: under torch.compile their slices are summed in
# the graph, and Inductor unrolls a sum of fewer than its unroll_reductions_threshold (8; `<` in
# torch/_inductor/ir.py) slices into the output's consumer; 8 or more compile to a persistent reduction kernel of
# their own (the 32-layer profile at 5ed2021, split 8: triton_per_fused_sum kernels, 0.21 of 2.88 GPU ms a token;
# at 5b8f89c, split 16 on down_proj: ~4.5 us a call). tests/test_triton_int4.py checks the threshold still holds
_TILE_MAX_SPLIT_K = 7
_MIN_K_STEPS = 4  # each split keeps at least this many BLOCK_K steps
# the mma GEMV splits K until 8 programs an SM (up to _TILE_MAX_SPLIT_K): its wgmmas stay in flight across a
# slice's steps, and more, shorter slices kept more bytes in flight on the H200 (one row, 128 x 128 tiles: 26.7 us
# at split 8 on 28672 x 4096 against 30.4 at 2, _WAVES' choice; 4096 x 14336 14.0 against 17.9 at 4;
# int4_read_probe --variants, session 26; split 7 not yet timed)
_MMA_WAVES = 8


@triton.jit
def _round_bf16(v, SOFT: tl.constexpr):
    """float32 ``v`` rounded to bf16, to nearest even. The GPU's cast does that (``cvt.rn.bf16.f32``); Triton 3.6's
    interpreter truncates (and its "rtne" mode neither ties to even nor carries), so ``SOFT`` (the interpreter)
    rounds the bits by hand and returns float32 holding the bf16 value (finite inputs; a store to bf16 keeps it)."""
    if SOFT:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _dequant_tile(p, s, z, SOFT: tl.constexpr):
    """``p [BN, BK/2]`` uint8 codes, ``s``, ``z`` ``[BN]`` bf16 -> the bf16 weight at the even and odd columns."""
    p = p.to(tl.int32)
    lo = ((p & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # q - 8, exactly
    hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    s = s.to(tl.float32)[:, None]
    z = z.to(tl.float32)[:, None]
    # (q - 8)·s is exact in float32, so a fused or separate multiply-add gives the same float32 sum: one rounding
    # there, one to bf16 (tinygemm's bf16 FMA rounds once; the fake quant and the reference do what is done here)
    return _round_bf16(lo * s + z, SOFT), _round_bf16(hi * s + z, SOFT)


@triton.jit
def _split_k_steps(pid_k, steps, SPLIT_K: tl.constexpr):
    """The ``[first, last)`` of ``steps`` K steps that split ``pid_k`` of ``SPLIT_K`` streams (the last may be
    shorter, or empty)."""
    per = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per
    return first, tl.minimum(first + per, steps)


@triton.jit
def _int4_decode_kernel(
    x_ptr, p_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_pn, stride_sn, stride_om, stride_split,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HALF)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    # this program's K slice, in BLOCK_K steps (K is a multiple of GROUP, GROUP of BLOCK_K)
    first, last = _split_k_steps(pid_k, K // BLOCK_K, SPLIT_K)
    p_ptrs = p_ptr + offs_n[:, None] * stride_pn + offs_j[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_j[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        k0 = step * BLOCK_K
        g = k0 // GROUP
        p = tl.load(p_ptrs + k0 // 2, mask=mask_n[:, None], other=0)
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
        w_even, w_odd = _dequant_tile(p, s, z, SOFT)
        x_even = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
        x_odd = tl.load(x_ptrs + k0 + 1, mask=mask_m[:, None], other=0.0)
        if USE_DOT:
            if DOT_IEEE:  # the interpreter's bf16 dot is wrong (Triton 3.6); bf16 products are exact in float32
                acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(x_even, tl.trans(w_even), acc, out_dtype=tl.float32)
                acc = tl.dot(x_odd, tl.trans(w_odd), acc, out_dtype=tl.float32)
        else:  # BLOCK_M = 1: [1, 1, HALF] x [1, BN, HALF] summed over the columns
            prod = x_even.to(tl.float32)[:, None, :] * w_even.to(tl.float32)[None, :, :]
            prod += x_odd.to(tl.float32)[:, None, :] * w_odd.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        acc = _round_bf16(acc, SOFT)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = bf16(Σ_s part[s, i])``, the slices added in order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _round_bf16(acc, SOFT).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(p_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_pn, stride_sn, stride_wn,
                         GROUP: tl.constexpr, SOFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The bf16 weight ``w [N, K]``. Row offsets in 64 bits: ``w`` is a whole weight, and one of 2**31 elements
    (a 256k-vocabulary LM head at 8192 columns) would wrap in 32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_j = tl.arange(0, HALF)
    mask_n = offs_n < N
    k0 = pid_k * BLOCK_K
    g = k0 // GROUP
    p = tl.load(p_ptr + offs_n[:, None] * stride_pn + k0 // 2 + offs_j[None, :], mask=mask_n[:, None], other=0)
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
    z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
    w_even, w_odd = _dequant_tile(p, s, z, SOFT)
    # interleave in registers: [BN, HALF, 2] -> [BN, BLOCK_K], one contiguous store
    w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w, mask=mask_n[:, None])


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that small shapes still split K
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decode_split_k(N: int, K: int, block_n: int, block_k: int, sms: int, max_split: int = _MAX_SPLIT_K,
                   waves: int = _WAVES) -> int:
    """How many slices of K the decode kernel uses: doubled while the programs make fewer than ``waves`` per SM,
    each slice keeps at least ``_MIN_K_STEPS`` steps of ``block_k``, at most ``max_split`` (taken when the doubling
    stops under the waves short of it: 7 where 8 is over the cap)."""
    tiles, steps, split = triton.cdiv(N, block_n), K // block_k, 1
    while (tiles * split < waves * sms and split * 2 <= max_split
           and steps // (split * 2) >= _MIN_K_STEPS):
        split *= 2
    if tiles * split < waves * sms and split < max_split < split * 2 and steps // max_split >= _MIN_K_STEPS:
        split = max_split
    return split


def _decode_tiles(M: int, group_size: int, tiles: tuple[int, int, int] | None):
    table = DECODE_TILES_INTERPRET if _INTERPRET else DECODE_TILES
    bn, bk, warps = tiles or table[1 if M == 1 else 16]
    return bn, min(bk, group_size), warps


@on_operand_device
def int4_decode_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, split_k: int | None = None,
                       tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` bf16 (M ≤ 16, any strides) times the int4 weight, bf16 ``[M, N]``.
    ``split_k`` / ``tiles`` (BLOCK_N, BLOCK_K, warps) override the defaults (tests, benchmarks). Offsets are 32-bit
    (a decode's operands are far below 2**31 elements): an operand past that is refused, before any launch."""
    for t in (x, packed, scales, zeros):
        _check_32bit_offsets("int4_decode_triton", t, SERVING_ADVICE)
    # the kernel addresses the codes, scales and zeros as contiguous (the zeros with the scales' row stride) and x's
    # columns as contiguous: other layouts are copied (int4_linear passes them so)
    packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    N = packed.shape[0]
    bn, bk, warps = _decode_tiles(M, group_size, tiles)
    if split_k is None:
        split_k = decode_split_k(N, K, bn, bk, _sms(x.device))
    use_dot = M > 1
    block_m = 16 if use_dot else 1
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    dest = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    _check_32bit_offsets("int4_decode_triton", dest, SERVING_ADVICE)
    wrap_triton(_int4_decode_kernel)[(triton.cdiv(N, bn), split_k)](
        x, packed, scales, zeros, dest, M, N, K,
        x.stride(0), packed.stride(0), scales.stride(0), N, M * N,
        GROUP=group_size, SPLIT_K=split_k, USE_DOT=use_dot, DOT_IEEE=_INTERPRET,
        SOFT=_INTERPRET,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1 if _INTERPRET else 3,
    )
    if split_k > 1:
        block = 256 if _INTERPRET else 1024
        wrap_triton(_split_sum_kernel)[(triton.cdiv(M * N, block),)](
            dest, out, M * N, SPLIT_K=split_k, SOFT=_INTERPRET, BLOCK=block, num_warps=1 if _INTERPRET else 4)
    return out


@on_operand_device
def int4_dequant_triton(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The bf16 weight ``[N, K]`` of the packed codes (bit for bit :func:`hf_lowbit.kernels.int4.int4_dequantize`)."""
    packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()  # as int4_decode_triton
    N, K = packed.shape[0], packed.shape[1] * 2
    bn, bk, warps = tiles or (DEQUANT_TILES_INTERPRET if _INTERPRET else DEQUANT_TILES)
    bk = min(bk, group_size)
    w = torch.empty((N, K), dtype=torch.bfloat16, device=packed.device)
    wrap_triton(_int4_dequant_kernel)[(triton.cdiv(N, bn), K // bk)](
        packed, scales, zeros, w, N, K, packed.stride(0), scales.stride(0), w.stride(0),
        GROUP=group_size, SOFT=_INTERPRET, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    return w


# ---- tinygemm's tile-packed layout read directly (hf_lowbit.kernels.int4.pack_tinygemm_tiles describes it) ----
#
# Words ``q [N/8, K/128, 32, 4]`` int32; an 8-row tile's whole K is contiguous, 128 words (512 B) per 128 columns.
# A program's rows ``n`` and a step's ``BLOCK_K`` columns (a multiple of 128) are ``BLOCK_K / 8`` words a row:
# word ``j = 16·ko + 4·c + w`` of row ``n`` sits at ``(n // 8)·stride + k0 + 128·ko + 16·(n % 8) + 4·c + w``
# (16 contiguous words a row and 128-column block, so 16-byte loads) and holds the even columns
# ``k0 + 128·ko + 32·w + 2·c + 8·ab`` (``ab`` 0..3) in nibbles ``ab`` and the odd ones (``+1``) in nibbles
# ``4 + ab``. ``x`` is read as bf16 pairs (int32 ``x2[k/2]``): the pair of those two columns is
# ``x2[k0/2 + 64·ko + 16·w + c + 4·ab]``, the even column its low half and the odd one its high half, so a code and
# its activation need no interleaving (the layout is tinygemm's mma fragment: lane ``4r + c`` its own columns).
# The GEMV gets ``x`` from :func:`_tile_x`: zero-padded to the layout's K and those pairs moved to ``4j + ab``, so
# its loads of ``x`` have no masks and a word's four pairs are one 16-byte vector. sm_90 code of the M = 1 loop
# (128 x 128 tiles, per step and thread): before, 65 4-byte cp.async copies of x, 137 selp, 65 setp, 1533 SASS
# instructions (12.0 a code); now 16 16-byte copies, 9 selp, 1 setp and (the magic constant a register, bf16x2
# rounding) 1013 SASS (7.9 a code): 0.45-0.75x tinygemm at M = 1 on the H200 (session 13). The factored GEMV below
# takes the scale and zero out of the sum: 4.27 a code (tools/int4_gemv_sass.py).
# ``scale_and_zero [K/group, N, 2]`` bf16 is read as int32 (the scale the low half, the zero the high half): one
# 4-byte load gives both, and each word's 8 columns share a group (groups are >= 32 columns).

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the tile GEMV, M = 1 and M in 2..16; H200 guesses (not measured):
# 64 rows x 256 columns = 8 KB of codes a step (4x the first GEMV's 2 KB), four 16-byte loads a thread
TILE_DECODE_TILES = {1: (128, 128, 4, 3), 16: (64, 128, 4, 3)}
# the benchmark's --sweep of the tile GEMV at M = 1 (each also compiled for sm_90 by tests/_triton_sm90_compile.py)
TILE_SWEEP_TILES = [(bn, bk, w, st) for bn, bk, w in ((64, 128, 2), (64, 256, 2), (128, 128, 4), (128, 256, 4),
                                                      (256, 128, 8), (128, 128, 8)) for st in (2, 4)]
# the mma GEMV's sweep: BLOCK_K 128 (at most the group), BLOCK_N 64-256, warps, stages
MMA_SWEEP_TILES = [(bn, 128, w, st) for bn, w in ((64, 4), (128, 4), (128, 8), (256, 8)) for st in (2, 3, 4)]
TILE_DECODE_TILES_INTERPRET = {1: (16, 128, 1, 1), 16: (16, 128, 1, 1)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the factored GEMV (M = 1) and of its tensor-core form (M <= 16):
# guesses, not swept yet (128 rows: Hopper's wgmma wants the weight rows, its M, >= 64 with 4 warps)
FACTORED_TILES = (128, 128, 4, 3)
MMA_TILES = (128, 128, 4, 3)
TILE_KERNELS = ("tile", "factored", "mma")  # int4_tile_decode_triton's kernel
TILE_DEQUANT_TILES = (32, 256, 4)  # BLOCK_N, BLOCK_K, warps
TILE_DEQUANT_TILES_INTERPRET = (16, 128, 1)


@triton.jit
def _tile_words_offsets(offs_n, stride_qn, k0, KW: tl.constexpr):
    """``[BN, KW]`` word offsets of rows ``offs_n`` at the step starting at column ``k0``."""
    j = tl.arange(0, KW)
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    return row[:, None] + (k0 + (j // 16) * 128 + (j % 16))[None, :]


@triton.jit
def _tile_dequant_words(words, szw, SOFT: tl.constexpr):
    """``words [BN, KW]`` int32, ``szw`` their scale/zero pairs (``[BN, KW]`` or ``[BN, 1]``) -> the bf16 weight at
    the even and odd columns, ``[BN, KW, 4]`` each (float32 holding bf16 values when ``SOFT``).

    Nibble ``ab`` of a 16-bit half is read in place, without a shift: OR-ed into 2**23's mantissa it is
    ``2**23 + q·16**ab`` exactly (bits up to 15), minus ``2**23 + 8·16**ab`` it is ``(q - 8)·16**ab`` exactly, and
    times ``scale·16**-ab`` (a power-of-2 rescale of a bf16 scale: exact for scales above 2**-114) it is
    ``(q - 8)·scale`` exactly, as before; one shift a word for the odd half. A mask, an OR (one LOP3), a
    subtraction and an FMA a code."""
    ab = tl.arange(0, 4)
    nib = (15 << (ab * 4))[None, None, :]
    off = (8388608.0 + 8.0 * (1 << (ab * 4)).to(tl.float32))[None, None, :]
    inv = ((127 - 4 * ab) << 23).to(tl.float32, bitcast=True)[None, None, :]  # 16**-ab
    s = (szw << 16).to(tl.float32, bitcast=True)[:, :, None] * inv
    z = (szw & -65536).to(tl.float32, bitcast=True)[:, :, None]
    qe = ((words[:, :, None] & nib) | 0x4B000000).to(tl.float32, bitcast=True) - off
    qo = (((words >> 16)[:, :, None] & nib) | 0x4B000000).to(tl.float32, bitcast=True) - off
    return _round_bf16(qe * s + z, SOFT), _round_bf16(qo * s + z, SOFT)


@triton.jit
def _tile_dequant_words_t(words, szw, magic, SOFT: tl.constexpr):
    """:func:`_tile_dequant_words` transposed: ``words [KW, BN]``, ``szw`` ``[KW, BN]`` or ``[1, BN]`` ->
    ``[KW, 4, BN]`` each. Rows innermost, so that Triton's default layout gives a thread whole rows (its words,
    scales and zeros read once, not once per nibble). ``magic`` is ``0x4B000000`` passed at run time: a constant
    there makes ptxas mask and OR with two LOP3s (one immediate each), a register with one. On the GPU the two
    roundings to bf16 are one ``cvt.rn.bf16x2.f32`` (the same round-to-nearest-even, two codes an instruction)."""
    ab = tl.arange(0, 4)
    nib = (15 << (ab * 4))[None, :, None]
    off = (8388608.0 + 8.0 * (1 << (ab * 4)).to(tl.float32))[None, :, None]
    inv = ((127 - 4 * ab) << 23).to(tl.float32, bitcast=True)[None, :, None]  # 16**-ab
    s = (szw << 16).to(tl.float32, bitcast=True)[:, None, :] * inv
    z = (szw & -65536).to(tl.float32, bitcast=True)[:, None, :]
    qe = ((words[:, None, :] & nib) | magic).to(tl.float32, bitcast=True) - off
    qo = (((words >> 16)[:, None, :] & nib) | magic).to(tl.float32, bitcast=True) - off
    if SOFT:
        return _round_bf16(qe * s + z, SOFT), _round_bf16(qo * s + z, SOFT)
    else:  # float32 holding the bf16 values: the pair's low half shifted up, its high half masked
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
            "=r,=r,r,r", [qe * s + z, qo * s + z], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _tile_scale_zero(sz_ptr, offs_n, mask_n, k0, stride_sg, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                     KW: tl.constexpr):
    """The scale/zero words of a step: ``[BN, 1]`` when it lies in one group, else ``[BN, KW]`` (word ``j``'s group)."""
    if GROUP >= BLOCK_K:
        return tl.load(sz_ptr + (k0 // GROUP) * stride_sg + offs_n, mask=mask_n, other=0)[:, None]
    else:
        j = tl.arange(0, KW)
        g = (k0 + (j // 16) * 128 + (j % 4) * 32) // GROUP
        return tl.load(sz_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=mask_n[:, None], other=0)


@triton.jit
def _int4_tile_decode_kernel(
    x_ptr, q_ptr, sz_ptr, out_ptr,
    M, N, NP, KP, MAGIC,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr,
    SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``xw [M, KP/2]`` int32 (:func:`_tile_x`: ``x`` zero-padded to ``KP`` columns, bf16 pairs in the words'
    order), ``q`` the tile words, ``sz [KP/GROUP, NP]`` int32 -> ``out``: rows ``N`` of ``NP`` (the layout's, a
    multiple of 8), columns ``KP`` (the layout's). ``x`` is loaded without masks: a step's ``BLOCK_K/2`` pairs are
    contiguous, word ``j``'s four at ``4j``..``4j + 3`` (one 16-byte vector)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < NP
    mask_m = offs_m < M
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in tl.range(first, last, num_stages=NUM_STAGES):
            k0 = step * BLOCK_K
            words = tl.load(q_ptr + _tile_words_offsets(offs_n, stride_qn, k0, KW), mask=mask_n[:, None], other=0)
            szw = _tile_scale_zero(sz_ptr, offs_n, mask_n, k0, stride_sg, GROUP, BLOCK_K, KW)
            x2 = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 // 2 + tl.arange(0, HALF))[None, :],
                         mask=mask_m[:, None], other=0)
            xe = (x2 << 16).to(tl.float32, bitcast=True)
            xo = (x2 & -65536).to(tl.float32, bitcast=True)
            we, wo = _tile_dequant_words(words, szw, SOFT)
            we = tl.reshape(we, (BLOCK_N, HALF))
            wo = tl.reshape(wo, (BLOCK_N, HALF))
            if DOT_IEEE:  # the interpreter's bf16 dot is wrong (Triton 3.6); bf16 products are exact in float32
                acc += tl.dot(xe, tl.trans(we.to(tl.float32)), input_precision="ieee")
                acc += tl.dot(xo, tl.trans(wo.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(xe.to(tl.bfloat16), tl.trans(we), acc, out_dtype=tl.float32)
                acc = tl.dot(xo.to(tl.bfloat16), tl.trans(wo), acc, out_dtype=tl.float32)
    else:  # BLOCK_M = 1, transposed ([KW, 4, BN]): elementwise products, summed over the columns after the loop
        j = tl.arange(0, KW)
        row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
        acc3 = tl.zeros((KW, 4, BLOCK_N), dtype=tl.float32)
        for step in tl.range(first, last, num_stages=NUM_STAGES):
            k0 = step * BLOCK_K
            words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[:, None] + row[None, :],
                            mask=mask_n[None, :], other=0)
            if GROUP >= BLOCK_K:
                szw = tl.load(sz_ptr + (k0 // GROUP) * stride_sg + offs_n, mask=mask_n, other=0)[None, :]
            else:
                g = (k0 + (j // 16) * 128 + (j % 4) * 32) // GROUP
                szw = tl.load(sz_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0)
            x2 = tl.load(x_ptr + k0 // 2 + (4 * j)[:, None] + tl.arange(0, 4)[None, :])
            xe = (x2 << 16).to(tl.float32, bitcast=True)[:, :, None]
            xo = (x2 & -65536).to(tl.float32, bitcast=True)[:, :, None]
            we, wo = _tile_dequant_words_t(words, szw, MAGIC, SOFT)
            acc3 += we.to(tl.float32) * xe
            acc3 += wo.to(tl.float32) * xo
        acc = tl.sum(tl.sum(acc3, axis=0), axis=0)[None, :]
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        acc = _round_bf16(acc, SOFT)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])


@triton.jit
def _nibble_f32(words, SH: tl.constexpr, magic):
    """``q - 8`` as float32, exact, of the nibble at bit ``SH`` (< 20) of each word read in place: OR-ed into 2**23's
    mantissa it is ``2**23 + q·2**SH``; one FMA scales that by ``2**-SH`` and takes ``2**(23 - SH) + 8`` off (both
    exact, so the one rounding has nothing to round). One LOP3 (``magic`` a register) and one FFMA a code."""
    INV: tl.constexpr = 1.0 / (1 << SH)
    OFF: tl.constexpr = 8388608.0 / (1 << SH) + 8.0
    return tl.fma(((words & (15 << SH)) | magic).to(tl.float32, bitcast=True), INV, -OFF)


@triton.jit
def _int4_tile_gemv_factored_kernel(
    xf_ptr, xs_ptr, q_ptr, sz_ptr, out_ptr,
    N, NP, KP, MAGIC,
    stride_qn, stride_sg, stride_split,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """One row of ``x`` times the tile words, the scale and zero factored out of the sum:
    ``y[n] = Σ_groups s·Σ (q - 8)·x + z·Σ x``. ``xf [KP]`` float32 (:func:`_tile_x_factored`: the words' order,
    8 values a word, nibble ``ab``'s even and odd column at ``2ab``, ``2ab + 1``; the even nibbles are read in place
    at bits ``4ab``, the odd ones at ``4ab + 4`` of the word shifted right by 12, one shift a word), ``xs``: ``Σ x``
    a step (``GROUP >= BLOCK_K``) or a word.

    Per code a LOP3 and two FFMAs (:func:`_nibble_f32`'s, and the product with ``x``, exact in float32: 12
    significant bits), against the per-element weight of :func:`_int4_tile_decode_kernel` (a scale FMA and a bf16
    rounding more): 4.27 SASS instructions a code in the loop at the H200 tiles and group 128 (5.04 at group 32),
    80 registers, against 7.91
    and 245 (sm_90, Triton 3.6, ``tools/int4_gemv_sass.py``). The weight is not rounded to bf16 first: the sum is
    closer to the exact product than tinygemm's, and differs from it by up to the weights' bf16 rounding
    (``2**-8 Σ|x·w|``). On the H200: 0.30-0.68x tinygemm at one row on the layer shapes (docs/qat.md)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NP
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = step * BLOCK_K
        words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[:, None] + row[None, :], mask=mask_n[None, :],
                        other=0)
        # a word's 8 x values (one 32-byte load), split into [KW] vectors: ab = 2·a1 + a0, then the column's parity
        x = tl.reshape(tl.load(xf_ptr + k0 + (8 * j)[:, None] + tl.arange(0, 8)[None, :]), (KW, 2, 2, 2))
        xe, xo = tl.split(x)
        xe0, xe1 = tl.split(xe)
        xo0, xo1 = tl.split(xo)
        e0, e2 = tl.split(xe0)
        e1, e3 = tl.split(xe1)
        o0, o2 = tl.split(xo0)
        o1, o3 = tl.split(xo1)
        odd = (words.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)  # odd nibbles at bits 4..19
        inner = _nibble_f32(words, 0, MAGIC) * e0[:, None]  # [KW, BN]: Σ (q - 8)·x of each word
        inner += _nibble_f32(odd, 4, MAGIC) * o0[:, None]
        inner += _nibble_f32(words, 4, MAGIC) * e1[:, None]
        inner += _nibble_f32(odd, 8, MAGIC) * o1[:, None]
        inner += _nibble_f32(words, 8, MAGIC) * e2[:, None]
        inner += _nibble_f32(odd, 12, MAGIC) * o2[:, None]
        inner += _nibble_f32(words, 12, MAGIC) * e3[:, None]
        inner += _nibble_f32(odd, 16, MAGIC) * o3[:, None]
        if GROUP >= BLOCK_K:  # the step lies in one group
            szw = tl.load(sz_ptr + (k0 // GROUP) * stride_sg + offs_n, mask=mask_n, other=0)
            s = (szw << 16).to(tl.float32, bitcast=True)
            z = (szw & -65536).to(tl.float32, bitcast=True)
            acc += s * tl.sum(inner, axis=0) + z * tl.load(xs_ptr + step)
        else:  # each word lies in one group (groups are >= 32 columns)
            g = (k0 + (j // 16) * 128 + (j % 4) * 32) // GROUP
            szw = tl.load(sz_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0)
            s = (szw << 16).to(tl.float32, bitcast=True)
            z = (szw & -65536).to(tl.float32, bitcast=True)
            acc += tl.sum(s * inner + z * tl.load(xs_ptr + k0 // 8 + j)[:, None], axis=0)
    if SPLIT_K == 1:
        acc = _round_bf16(acc, SOFT)
    tl.store(out_ptr + pid_k * stride_split + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _pair_dequant_bf16(words, szw, SH: tl.constexpr, SOFT: tl.constexpr):
    """The bf16 weight ``(q - 8)·s + z`` of the nibble at bit ``SH`` of each word's low half (an even column) and
    high half (its odd neighbour), as two bf16 tensors; ``szw`` the words' scale/zero pairs (broadcast to
    ``words``' shape). On the GPU three instructions for the pair (Marlin's dequantization, in bf16x2): a LOP3 masks
    both halves and ORs them into bf16 128.0's mantissa (``128 + q``, exact), an FMA takes 136 off (``q - 8``,
    exact) and an FMA with the scale and zero pairs rounds once to bf16. The interpreter computes ``(q - 8)·s + z``
    in float32 (``(q - 8)·s`` exact) and rounds that to bf16: the reference's and the fake quantization's two
    roundings, which differ from the one only where the float32 sum lands exactly halfway between two bf16 values
    (possible only where the float32 sum is inexact: ``|z|`` and ``|(q - 8)·s|`` over ~``2**13`` apart)."""
    if SH > 0:
        words = (words.to(tl.uint32, bitcast=True) >> SH).to(tl.int32, bitcast=True)
    if SOFT:
        s = (szw << 16).to(tl.float32, bitcast=True)
        z = (szw & -65536).to(tl.float32, bitcast=True)
        even = ((words & 15) - 8).to(tl.float32) * s + z
        odd = (((words >> 16) & 15) - 8).to(tl.float32) * s + z
        return _round_bf16(even, SOFT).to(tl.bfloat16), _round_bf16(odd, SOFT).to(tl.bfloat16)
    else:
        s2 = (szw & 0xFFFF) * 0x10001  # (s, s) and (z, z) as bf16x2
        z2 = ((szw >> 16) & 0xFFFF) * 0x10001
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, off; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
            "lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 t, t, one, off; "
            "fma.rn.bf16x2 t, t, $3, $4; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r,r", [words, s2, z2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _int4_tile_gemv_mma_kernel(
    x_ptr, q_ptr, sz_ptr, out_ptr,
    M, N, NP, KP,
    stride_xm, stride_qn, stride_sg, stride_om, stride_split,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, SOFT: tl.constexpr, DOT_IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Up to 16 rows of ``x`` times the tile words on tensor cores: per step the tile's bf16 weight
    (:func:`_pair_dequant_bf16`: tinygemm's numerics, 1.5 instructions a code) times ``x`` by ``tl.dot``
    (``[BLOCK_N, BLOCK_K] @ [BLOCK_K, 16]``: the weight rows are the MMA's M, so Hopper's wgmma takes them; ``x``'s
    rows, padded to 16, its N), accumulated across steps in the dot's own float32 accumulator. ``x [M, KP]`` bf16
    as it is (zero-padded to the layout's K); any group of 32 columns or more (a word's 8 columns lie in one group).

    The codes, joined and permuted into ``x``'s column order (as :func:`_int4_tile_dequant_kernel` orders them),
    land in the register layout wgmma reads its A operand from, so the tile never goes through shared memory.
    Nothing happens to the accumulator between steps, so Triton leaves the wgmmas in flight across them (a wait for
    all but the last few, ``WARPGROUP.DEPBAR.LE gsb0, 0x7``): 3.27 SASS instructions a code in the loop at
    ``MMA_TILES`` and group 128 (3.75 at 32), 135 registers, 29 KB of shared memory (``tools/int4_gemv_sass.py``).
    The form before it, the scale and zero factored out of the sum (``acc += s·(128 + q)·x + (z - 136·s)·Σ x``, the
    weight never rounded: 2.31 instructions a code), waited for each step's product before scaling it, and at one
    row on the H200 took 1.06-1.14x as long on the served layer shapes, each at its best tiles and split-K
    (``benchmarks/int4_read_probe.py --variants``, session 26). The output is float32 slices (the caller sums and
    rounds): a bf16 store here makes ptxas serialize the wgmmas (C7515)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    mask_n = offs_n < NP
    mask_m = offs_m < M
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = step * BLOCK_K
        words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[None, :] + row[:, None], mask=mask_n[:, None],
                        other=0)
        szw = tl.broadcast_to(_tile_scale_zero(sz_ptr, offs_n, mask_n, k0, stride_sg, GROUP, BLOCK_K, KW),
                              (BLOCK_N, KW))
        e0, o0 = _pair_dequant_bf16(words, szw, 0, SOFT)
        e1, o1 = _pair_dequant_bf16(words, szw, 4, SOFT)
        e2, o2 = _pair_dequant_bf16(words, szw, 8, SOFT)
        e3, o3 = _pair_dequant_bf16(words, szw, 12, SOFT)
        # [BN, KW, ab, d] (a join stacks on a new last axis: (e0, e2), (e1, e3) -> 2·a1 + a0 = ab), then x's
        # column order: [BN, (ko, c, w), ab, d] -> [BN, ko, w, ab, c, d] (k = 128ko + 32w + 8ab + 2c + d)
        w = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(o0, o2), tl.join(o1, o3)))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // 128, 4, 4, 4, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K))
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[:, None], mask=mask_m[None, :],
                    other=0.0)
        if DOT_IEEE:  # the interpreter's bf16 dot is wrong (Triton 3.6); the products are exact in float32
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc, out_dtype=tl.float32)
    # float32 out, split or not: with a bf16 output ptxas serializes the loop's wgmmas (C7515, "non wgmma
    # instructions defining accumulator registers", Triton 3.6); the caller rounds (fused under torch.compile)
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc, mask=(offs_n < N)[:, None] & mask_m[None, :])


@triton.jit
def _int4_tile_dequant_kernel(q_ptr, sz_ptr, w_ptr, N, K, stride_qn, stride_sg, stride_wn,
                              GROUP: tl.constexpr, SOFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The bf16 weight ``w [N, K]`` of the tile words (rows and columns past ``N``, ``K``: the layout's padding). Its
    row offsets in 64 bits (a weight of 2**31 elements would wrap in 32; the words and scales, an eighth and less of
    it, are refused past 2**31 by the launcher)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    KO: tl.constexpr = BLOCK_K // 128
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k0 = pid_k * BLOCK_K
    words = tl.load(q_ptr + _tile_words_offsets(offs_n, stride_qn, k0, KW), mask=mask_n[:, None], other=0)
    szw = _tile_scale_zero(sz_ptr, offs_n, mask_n, k0, stride_sg, GROUP, BLOCK_K, KW)
    we, wo = _tile_dequant_words(words, szw, SOFT)
    # [BN, (ko, c, w), ab, d] -> columns in order: [BN, ko, w, ab, c, d] (k = 128ko + 32w + 8ab + 2c + d)
    w = tl.reshape(tl.join(we, wo), (BLOCK_N, KO, 4, 4, 4, 2))
    w = tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (offs_k < K)[None, :])


def _tile_decode_tiles(M: int, tiles: tuple[int, int, int, int] | None, kernel: str = "tile"):
    """The tiles ``int4_tile_decode_triton`` launches ``kernel`` with: ``tiles`` where given, else its H200 default
    (the interpreter's small ones on the CPU)."""
    if tiles or _INTERPRET:
        return tiles or TILE_DECODE_TILES_INTERPRET[1 if M == 1 else 16]
    return {"factored": FACTORED_TILES, "mma": MMA_TILES}.get(kernel, TILE_DECODE_TILES[1 if M == 1 else 16])


def _tile_x(x: torch.Tensor, KP: int) -> torch.Tensor:
    """``x [M, K]`` bf16 as the tile GEMV reads it: int32 ``[M, KP/2]``, zero-padded to the layout's ``KP`` columns
    and each 128-column block's 64 bf16 pairs reordered to the words' order (word ``j = 4c + w`` of the block holds
    the pairs ``16w + c + 4ab``, ``ab`` 0..3; they go to ``4j + ab``), so that the kernel's loads of ``x`` need no
    masks and each word's four pairs are one 16-byte vector. One copy of ``M × KP`` bf16 (16 KB for M = 1 and
    K = 8192; next to the weight's ``N × K / 2`` bytes, nothing), a pad and a permute that ``torch.compile`` can
    fuse into whatever writes ``x``."""
    M, K = x.shape
    if K != KP:
        x = torch.nn.functional.pad(x, (0, KP - K))
    # [M, block, w, ab, c, pair half] -> [M, block, c, w, ab, pair half]
    x = x.reshape(M, KP // 128, 4, 4, 4, 2).permute(0, 1, 4, 2, 3, 5)
    return x.reshape(M, KP).view(torch.int32)


def _tile_x_factored(x: torch.Tensor, KP: int, block_k: int, per_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [1, K]`` bf16 as the factored GEMV reads it: ``xf [KP]`` float32 in the words' order (:func:`_tile_x`'s,
    8 values a word: nibble ``ab``'s even and odd column); and ``xs``, the float32 sums of ``x`` a ``block_k`` step
    (``per_step``) or a word (8 columns), for the zeros' term. 16 KB and a few sums for K = 4096: a pad, a permute
    and a reduction that ``torch.compile`` fuses."""
    xw = _tile_x(x, KP).view(torch.bfloat16).reshape(KP // 8, 8).float()  # [word, (ab, half)]
    xs = xw.sum(1)
    return xw.reshape(KP), (xs.reshape(KP // block_k, block_k // 8).sum(1) if per_step else xs)


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced by ``torch.compile`` rather than run: Inductor traces a ``triton_op``'s body
    with fake (functional) tensors. ``torch.compiler.is_compiling()`` alone is not enough: torch 2.11 sets it only
    while Dynamo traces, not while AOTAutograd traces the op's body (2.13 holds it for the whole compile)."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode((t,)) is not None


@on_operand_device
def int4_tile_decode_triton(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                            out_features: int, split_k: int | None = None,
                            tiles: tuple[int, int, int, int] | None = None, kernel: str = "tile") -> torch.Tensor:
    """``x [M, K]`` bf16 (M ≤ 16) times the int4 weight in tinygemm's tile layout (``qdata``, ``scale_and_zero``:
    torchao's, as stored), bf16 ``[M, out_features]``. ``kernel``: ``"tile"`` (:func:`_int4_tile_decode_kernel`,
    :func:`int4_decode_triton`'s numerics), ``"factored"`` (one row: :func:`_int4_tile_gemv_factored_kernel`, the
    scale and zero out of the sum, the weight not rounded to bf16; more rows: ``"tile"``) or ``"mma"``
    (:func:`_int4_tile_gemv_mma_kernel` on tensor cores: the bf16 weight, as ``"tile"`` and tinygemm, any group).
    ``split_k`` / ``tiles`` (BLOCK_N, BLOCK_K, warps, stages) override the defaults (tests, benchmarks). Offsets
    are 32-bit (a decode's operands are far below 2**31 elements): an operand past that is refused, before any
    launch."""
    if kernel not in TILE_KERNELS:
        raise ValueError(f"int4_tile_decode_triton: kernel {kernel!r} is not one of {TILE_KERNELS}")
    for t in (x, qdata, scale_and_zero):
        _check_32bit_offsets("int4_tile_decode_triton", t, SERVING_ADVICE)
    # the kernels address the words and the scale/zero pairs as contiguous: other layouts are copied (as
    # int4_tile_linear passes them)
    qdata, scale_and_zero = qdata.contiguous(), scale_and_zero.contiguous()
    M = x.shape[0]
    if M == 0:  # nothing to compute; the one-row kernels read x's first row without a row mask
        return torch.empty((0, out_features), dtype=torch.bfloat16, device=x.device)
    NP, KP = qdata.shape[0] * 8, qdata.shape[1] * 128
    if kernel == "factored" and M > 1:
        kernel = "tile"
    bn, bk, warps, stages = _tile_decode_tiles(M, tiles, kernel)
    if bk % 128:  # a step's words are those of whole 128-column blocks (8 rows x 16 words each)
        raise ValueError(f"int4_tile_decode_triton: tiles' BLOCK_K must be a multiple of 128 (the tile layout's column "
                         f"blocks), got {tiles}")
    if split_k is None:
        split_k = decode_split_k(NP, KP, bn, bk, _sms(x.device), _TILE_MAX_SPLIT_K,
                                 _MMA_WAVES if kernel == "mma" else _WAVES)
    sz = scale_and_zero.view(torch.int32).squeeze(-1)  # [G, NP]
    # under torch.compile the split-K slices are summed in the graph (below): no bf16 output buffer then
    # the mma GEMV writes float32 slices even unsplit (its kernel says why)
    partials = split_k > 1 or kernel == "mma"
    graph_sum = partials and _traced(x)
    out = None if graph_sum else torch.empty((M, out_features), dtype=torch.bfloat16, device=x.device)
    dest = out if not partials else torch.empty((split_k, M, out_features), dtype=torch.float32, device=x.device)
    _check_32bit_offsets("int4_tile_decode_triton", dest, SERVING_ADVICE)
    grid = (triton.cdiv(NP, bn), split_k)
    if kernel == "factored":
        xf, xs = _tile_x_factored(x, KP, bk, group_size >= bk)
        wrap_triton(_int4_tile_gemv_factored_kernel)[grid](
            xf, xs, qdata, sz, dest, out_features, NP, KP, _MAGIC_BITS, qdata.stride(0), sz.stride(0),
            M * out_features, GROUP=group_size, SPLIT_K=split_k, SOFT=_INTERPRET, BLOCK_N=bn, BLOCK_K=bk,
            NUM_STAGES=stages, num_warps=warps, num_stages=stages,
        )
    elif kernel == "mma":
        xb = torch.nn.functional.pad(x, (0, KP - x.shape[1])) if KP != x.shape[1] else x
        xb = xb if xb.stride(1) == 1 else xb.contiguous()  # rows may be strided (a wider tensor), columns not
        wrap_triton(_int4_tile_gemv_mma_kernel)[grid](
            xb, qdata, sz, dest, M, out_features, NP, KP, xb.stride(0), qdata.stride(0), sz.stride(0), out_features,
            M * out_features, GROUP=group_size, SPLIT_K=split_k, SOFT=_INTERPRET, DOT_IEEE=_INTERPRET, BLOCK_N=bn,
            BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps, num_stages=stages,
        )
    else:
        use_dot = M > 1
        x2 = _tile_x(x, KP)
        wrap_triton(_int4_tile_decode_kernel)[grid](
            x2, qdata, sz, dest, M, out_features, NP, KP, _MAGIC_BITS,
            x2.stride(0), qdata.stride(0), sz.stride(0), out_features, M * out_features,
            GROUP=group_size, SPLIT_K=split_k, USE_DOT=use_dot, DOT_IEEE=_INTERPRET, SOFT=_INTERPRET,
            BLOCK_M=16 if use_dot else 1, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps,
            num_stages=stages,
        )
    if partials:
        if graph_sum:
            # the slices' sum in the graph, where Inductor fuses it into what reads the output (up to 7 slices it
            # unrolls the sum into that kernel: _TILE_MAX_SPLIT_K): no kernel of its own a call
            return dest.sum(0).to(torch.bfloat16)
        block = 256 if _INTERPRET else 1024
        wrap_triton(_split_sum_kernel)[(triton.cdiv(M * out_features, block),)](
            dest, out, M * out_features, SPLIT_K=split_k, SOFT=_INTERPRET, BLOCK=block,
            num_warps=1 if _INTERPRET else 4)
    return out


@on_operand_device
def int4_tile_dequant_triton(qdata: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                             shape: tuple[int, int], tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The bf16 weight ``shape = (N, K)`` of tinygemm's tile layout, bit for bit
    :func:`hf_lowbit.kernels.int4.int4_tile_dequantize` (the prefill path's weight, read from the one copy). The
    weight's offsets are 64-bit; the words' and scales' 32-bit (an eighth of the weight and less): refused past
    2**31 elements, before any launch."""
    for t in (qdata, scale_and_zero):
        _check_32bit_offsets("int4_tile_dequant_triton", t, SERVING_ADVICE)
    qdata, scale_and_zero = qdata.contiguous(), scale_and_zero.contiguous()  # as int4_tile_decode_triton
    N, K = shape
    bn, bk, warps = tiles or (TILE_DEQUANT_TILES_INTERPRET if _INTERPRET else TILE_DEQUANT_TILES)
    sz = scale_and_zero.view(torch.int32).squeeze(-1)
    w = torch.empty((N, K), dtype=torch.bfloat16, device=qdata.device)
    wrap_triton(_int4_tile_dequant_kernel)[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        qdata, sz, w, N, K, qdata.stride(0), sz.stride(0), w.stride(0),
        GROUP=group_size, SOFT=_INTERPRET, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    return w
