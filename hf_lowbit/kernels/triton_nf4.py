"""Triton NF4 → INT8: the 4-bit codes of a frozen QLoRA base decoded straight into the INT8 matmul operand.

``q[n, k] = clamp(rne(lut[code[n, k]] · mul[n, k // 64]), ±127)``, written row-major ``[N, K]`` (the forward's
operand, reduction dim K contiguous) or transposed ``[K, N]`` (the input gradient's, N contiguous), in one read
of the packed codes (0.5 byte a weight) and one write of the codes (1 byte): no bf16 copy of the weight, no
absmax pass over it. ``mul`` (one float32 per 64-element block: the block's absmax over the row's INT8 scale)
and the row scales come from the small scale tensors alone (:func:`hf_lowbit.kernels.nf4.nf4_int8_multipliers`,
plain torch). The multiply is IEEE float32 and the rounding exact (half to even), so the kernel equals the
plain-torch reference :func:`hf_lowbit.kernels.nf4.nf4_to_int8_reference` bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import on_operand_device
from .triton_quant import _check_32bit_offsets
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_product(a, b, RINT: tl.constexpr):
    """``round(a · b)`` (fp32, ties to even, as ``torch.round`` of the IEEE product), exactly. On the GPU through
    ``rint``: the magic-number form ``(a·b + 1.5·2**23) − 1.5·2**23`` let the compiler fuse the product and the
    add into one FMA, which skips the product's own rounding (270 of 58.7M codes differed on the H200). The CPU
    interpreter has no libdevice, and numpy never fuses, so there it takes the magic number."""
    y = a * b
    if RINT:
        return libdevice.rint(y)
    return (y + 12582912.0) - 12582912.0


def _configs():
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 8, "GROUPS": 2}, num_warps=1)]
    # (rows, 64-element blocks a row, warps)
    shapes = [(32, 4, 4), (64, 4, 8), (16, 8, 4), (64, 2, 4), (128, 2, 8)]
    return [triton.Config({"BLOCK_N": bn, "GROUPS": g}, num_warps=w) for bn, g, w in shapes]


@triton.autotune(configs=_configs(), key=["N", "K", "TRANSPOSED"])
@triton.jit
def _nf4_to_int8_kernel(codes_ptr, mul_ptr, lut_ptr, q_ptr, N, K, TRANSPOSED: tl.constexpr, RINT: tl.constexpr,
                        BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    # One program: BLOCK_N rows x GROUPS blocks of 64 elements (32 bytes of codes each), as a [BLOCK_N, GROUPS, 32]
    # tile of bytes. A block has one multiplier, so its 16 possible INT8 codes are computed once, per block, and
    # packed four to an int32 word (table[c] = byte c % 4 of word c // 4); each element then looks its code up in
    # registers with a few integer ops. (Per-element float levels gathered from memory and multiplied ran at
    # ~0.6 TB/s on the H200; the kernel is meant to be bound by its 1.5 bytes a weight.)
    pid_n, pid_g = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = pid_g * GROUPS + tl.arange(0, GROUPS)
    mask_g = (offs_n[:, None] < N) & (offs_g[None, :] < K // 64)
    mul = tl.load(mul_ptr + offs_n[:, None] * (K // 64) + offs_g[None, :], mask=mask_g, other=0.0)
    w0 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.int32)
    w1, w2, w3 = w0, w0, w0
    for c in tl.static_range(16):
        code = tl.minimum(tl.maximum(_round_product(tl.load(lut_ptr + c), mul, RINT), -127.0), 127.0)
        byte = (code.to(tl.int32) & 0xFF) << (8 * (c % 4))
        if c // 4 == 0:
            w0 = w0 | byte
        elif c // 4 == 1:
            w1 = w1 | byte
        elif c // 4 == 2:
            w2 = w2 | byte
        else:
            w3 = w3 | byte
    w0, w1, w2, w3 = w0[:, :, None], w1[:, :, None], w2[:, :, None], w3[:, :, None]
    n3 = offs_n[:, None, None]
    b3 = offs_g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # byte index in the row
    mask = (n3 < N) & (b3 < K // 2)
    packed = tl.load(codes_ptr + n3 * (K // 2) + b3, mask=mask, other=0).to(tl.int32)
    hi, lo = packed >> 4, packed & 15  # the first element's code is the high nibble
    q_hi = (tl.where(hi < 8, tl.where(hi < 4, w0, w1), tl.where(hi < 12, w2, w3)) >> ((hi & 3) * 8)) & 0xFF
    q_lo = (tl.where(lo < 8, tl.where(lo < 4, w0, w1), tl.where(lo < 12, w2, w3)) >> ((lo & 3) * 8)) & 0xFF
    if TRANSPOSED:  # q [K, N]: element (n, 2b) goes to row 2b, (n, 2b + 1) to row 2b + 1 (stores coalesce along n)
        rows = q_ptr + 2 * b3 * N + n3
        tl.store(rows, q_hi.to(tl.int8), mask=mask)
        tl.store(rows + N, q_lo.to(tl.int8), mask=mask)
    else:  # q [N, K] viewed as int16 [N, K/2]: one little-endian pair a byte of codes, the first element low
        pair = ((q_lo << 8) | q_hi).to(tl.int16)
        tl.store(q_ptr.to(tl.pointer_type(tl.int16)) + n3 * (K // 2) + b3, pair, mask=mask)


@on_operand_device
def nf4_to_int8_triton(codes: torch.Tensor, mul: torch.Tensor, lut: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``codes`` uint8 ``[N, K/2]``, ``mul`` float32 ``[N, K/64]``, ``lut`` float32 ``[16]`` -> int8 ``[N, K]``
    (``[K, N]`` if ``transposed``), contiguous. Offsets are 32-bit (a QLoRA base's weights are far below 2**31
    elements): a weight of 2**31 elements or more is refused, before any launch. The kernel addresses its operands
    as contiguous: views in other layouts are copied (a slice of a wider weight's codes; small, and rare)."""
    N, K = codes.shape[0], codes.shape[1] * 2
    if K % 64 or tuple(mul.shape) != (N, K // 64):
        raise ValueError(f"nf4_to_int8_triton: mul must be [{N}, {K // 64}] (one multiplier a 64-element block of "
                         f"codes [{N}, {K // 2}]), got {list(mul.shape)}; NF4 -> INT8 takes blocks of 64 "
                         "(quantize_nf4's default block_size)")
    codes, mul, lut = codes.contiguous(), mul.contiguous(), lut.contiguous()
    q = torch.empty((K, N) if transposed else (N, K), dtype=torch.int8, device=codes.device)
    _check_32bit_offsets("nf4_to_int8_triton", q)  # (the codes and multipliers are a half and a 64th of it)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K // 64, meta["GROUPS"]))

    wrap_triton(_nf4_to_int8_kernel)[grid](codes, mul, lut, q, N, K, TRANSPOSED=transposed,
                                           RINT=codes.device.type != "cpu")
    return q
