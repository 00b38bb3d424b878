"""Triton NF4 → INT8: the 4-bit codes of a frozen QLoRA base decoded straight into the INT8 matmul operand.

``q[n, k] = clamp(rne(lut[code[n, k]] · mul[n, k // 64]), ±127)``, written row-major ``[N, K]`` (the forward's
operand, reduction dim K contiguous) or transposed ``[K, N]`` (the input gradient's, N contiguous), in one read
of the packed codes (0.5 byte a weight) and one write of the codes (1 byte): no bf16 copy of the weight, no
absmax pass over it. ``mul`` (one float32 per 64-element block: the block's absmax over the row's INT8 scale)
and the row scales come from the small scale tensors alone (:func:`hf_lowbit.ops.nf4.nf4_int8_multipliers`,
plain torch). The multiply is IEEE float32 and the rounding exact (half to even), so the kernel equals the
plain-torch reference :func:`hf_lowbit.ops.nf4.nf4_to_int8_reference` bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
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
        return [triton.Config({"BLOCK_N": 16, "BLOCK_B": 64}, num_warps=1)]
    # (rows, bytes of codes = 2 x columns, warps): wide tiles along the codes for the row-major store, taller
    # ones for the transposed store (each of its rows is BLOCK_N contiguous bytes)
    shapes = [(32, 128, 4), (64, 128, 4), (64, 256, 8), (128, 64, 4), (128, 128, 8)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_B": bb}, num_warps=w) for bn, bb, w in shapes]


@triton.autotune(configs=_configs(), key=["N", "K", "TRANSPOSED"])
@triton.jit
def _nf4_to_int8_kernel(codes_ptr, mul_ptr, lut_ptr, q_ptr, N, K, TRANSPOSED: tl.constexpr, RINT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    # One program: BLOCK_N rows x BLOCK_B bytes of codes (2 x BLOCK_B columns). Each byte holds two codes, the
    # first element in the high nibble; both are decoded in the byte's own register layout (no reshape, no join),
    # each with the multiplier of its 64-element block (bytes b and b + 1 share it unless b is a block's last)
    pid_n, pid_b = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (offs_n[:, None] < N) & (offs_b[None, :] < K // 2)
    packed = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + offs_b[None, :], mask=mask, other=0).to(tl.int32)
    mul = tl.load(mul_ptr + offs_n[:, None] * (K // 64) + offs_b[None, :] // 32, mask=mask, other=0.0)
    hi = tl.load(lut_ptr + (packed >> 4))  # the 16 float32 levels: an L1-resident gather
    lo = tl.load(lut_ptr + (packed & 15))
    q_hi = tl.minimum(tl.maximum(_round_product(hi, mul, RINT), -127.0), 127.0).to(tl.int8)
    q_lo = tl.minimum(tl.maximum(_round_product(lo, mul, RINT), -127.0), 127.0).to(tl.int8)
    if TRANSPOSED:  # q [K, N]: element (n, 2b) goes to row 2b, (n, 2b + 1) to row 2b + 1, each tile stored N-contiguous
        rows = 2 * offs_b[:, None] * N + offs_n[None, :]
        tmask = (offs_b[:, None] < K // 2) & (offs_n[None, :] < N)
        tl.store(q_ptr + rows, tl.trans(q_hi), mask=tmask)
        tl.store(q_ptr + rows + N, tl.trans(q_lo), mask=tmask)
    else:  # q [N, K] viewed as int16 [N, K/2]: one little-endian pair a byte of codes, first element low
        pair = (q_lo.to(tl.int16) << 8) | (q_hi.to(tl.int16) & 0xFF)
        tl.store(q_ptr.to(tl.pointer_type(tl.int16)) + offs_n[:, None] * (K // 2) + offs_b[None, :], pair, mask=mask)


def nf4_to_int8_triton(codes: torch.Tensor, mul: torch.Tensor, lut: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``codes`` uint8 ``[N, K/2]``, ``mul`` float32 ``[N, K/64]``, ``lut`` float32 ``[16]`` -> int8 ``[N, K]``
    (``[K, N]`` if ``transposed``), contiguous."""
    N, K = codes.shape[0], codes.shape[1] * 2
    q = torch.empty((K, N) if transposed else (N, K), dtype=torch.int8, device=codes.device)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(K // 2, meta["BLOCK_B"]))

    wrap_triton(_nf4_to_int8_kernel)[grid](codes, mul, lut, q, N, K, TRANSPOSED=transposed,
                                           RINT=codes.device.type != "cpu")
    return q
