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
the kernels can be checked on a CPU (as :mod:`hf_lowbit.kernels.triton_int8` does). Not yet measured on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# 0x4B000000 is 2**23 as float32: OR-ing a 4-bit code into its mantissa gives 2**23 + q exactly, and subtracting
# 2**23 + 8 gives q - 8: two integer/float ops a code instead of an int->float conversion (quarter rate on GPUs)
_MAGIC_BITS = 0x4B000000
_MAGIC_MINUS_8 = 8388616.0  # 2**23 + 8

# (BLOCK_N, BLOCK_K, num_warps) of the decode kernel for M = 1 and for M in 2..16 (BLOCK_K is capped at the group
# size). H200 guesses, not tuned: 32 rows x 128 columns = 2 KB of codes a step, 16 B a thread with 4 warps.
DECODE_TILES = {1: (32, 128, 4), 16: (32, 128, 4)}
DECODE_TILES_INTERPRET = {1: (16, 32, 1), 16: (16, 32, 1)}
DEQUANT_TILES = (64, 128, 4)  # BLOCK_N, BLOCK_K (capped at the group size), warps
DEQUANT_TILES_INTERPRET = (16, 32, 1)
_WAVES = 2  # programs wanted per SM, at least, before K is split further
_MAX_SPLIT_K = 16
_MIN_K_STEPS = 4  # each split keeps at least this many BLOCK_K steps


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
    steps = K // BLOCK_K
    per = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per
    last = tl.minimum(first + per, steps)
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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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


def decode_split_k(N: int, K: int, block_n: int, block_k: int, sms: int) -> int:
    """How many slices of K the decode kernel uses: doubled while the programs make fewer than ``_WAVES`` per SM,
    each slice keeps at least ``_MIN_K_STEPS`` steps of ``block_k``, at most ``_MAX_SPLIT_K``."""
    tiles, steps, split = triton.cdiv(N, block_n), K // block_k, 1
    while (tiles * split < _WAVES * sms and split * 2 <= _MAX_SPLIT_K
           and steps // (split * 2) >= _MIN_K_STEPS):
        split *= 2
    return split


def _decode_tiles(M: int, group_size: int, tiles: tuple[int, int, int] | None):
    table = DECODE_TILES_INTERPRET if _INTERPRET else DECODE_TILES
    bn, bk, warps = tiles or table[1 if M == 1 else 16]
    return bn, min(bk, group_size), warps


def int4_decode_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, split_k: int | None = None,
                       tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` bf16 (M ≤ 16, rows of any stride, columns contiguous) times the int4 weight, bf16 ``[M, N]``.
    ``split_k`` / ``tiles`` (BLOCK_N, BLOCK_K, warps) override the defaults (tests, benchmarks)."""
    M, K = x.shape
    N = packed.shape[0]
    bn, bk, warps = _decode_tiles(M, group_size, tiles)
    if split_k is None:
        split_k = decode_split_k(N, K, bn, bk, _sms(x.device))
    use_dot = M > 1
    block_m = 16 if use_dot else 1
    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    dest = out if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
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


def int4_dequant_triton(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The bf16 weight ``[N, K]`` of the packed codes (bit for bit :func:`hf_lowbit.kernels.int4.int4_dequantize`)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    bn, bk, warps = tiles or (DEQUANT_TILES_INTERPRET if _INTERPRET else DEQUANT_TILES)
    bk = min(bk, group_size)
    w = torch.empty((N, K), dtype=torch.bfloat16, device=packed.device)
    wrap_triton(_int4_dequant_kernel)[(triton.cdiv(N, bn), K // bk)](
        packed, scales, zeros, w, N, K, packed.stride(0), scales.stride(0), w.stride(0),
        GROUP=group_size, SOFT=_INTERPRET, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    return w
