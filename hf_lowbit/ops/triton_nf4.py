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

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton


@triton.jit
def _rne(y):
    """Round fp32 ``|y| < 2**22`` to the nearest integer, ties to even (as ``torch.round``), exactly."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _nf4_to_int8_kernel(codes_ptr, mul_ptr, lut_ptr, q_ptr, N, K, TRANSPOSED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program: BLOCK_N rows x BLOCK_K columns; the codes come two a byte (first element in the high nibble)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # bytes of the row
    offs_g = pid_k * (BLOCK_K // 64) + tl.arange(0, BLOCK_K // 64)  # 64-element blocks of the row
    mask_n = offs_n < N
    packed = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + offs_b[None, :],
                     mask=mask_n[:, None] & (offs_b[None, :] < K // 2), other=0).to(tl.int32)
    code = tl.reshape(tl.join(packed >> 4, packed & 15), (BLOCK_N, BLOCK_K))  # interleaved: hi, lo, hi, lo, ...
    level = tl.load(lut_ptr + code)  # 16 float32 levels: an L1-resident gather
    mul = tl.load(mul_ptr + offs_n[:, None] * (K // 64) + offs_g[None, :],
                  mask=mask_n[:, None] & (offs_g[None, :] < K // 64), other=0.0)
    mul = tl.reshape(tl.broadcast_to(mul[:, :, None], (BLOCK_N, BLOCK_K // 64, 64)), (BLOCK_N, BLOCK_K))
    q = tl.minimum(tl.maximum(_rne(level * mul), -127.0), 127.0).to(tl.int8)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if TRANSPOSED:  # [K, N]: the tile stored transposed, N contiguous
        tl.store(q_ptr + offs_k[:, None] * N + offs_n[None, :], tl.trans(q),
                 mask=(offs_k[:, None] < K) & mask_n[None, :])
    else:
        tl.store(q_ptr + offs_n[:, None] * K + offs_k[None, :], q, mask=mask_n[:, None] & (offs_k[None, :] < K))


def nf4_to_int8_triton(codes: torch.Tensor, mul: torch.Tensor, lut: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``codes`` uint8 ``[N, K/2]``, ``mul`` float32 ``[N, K/64]``, ``lut`` float32 ``[16]`` -> int8 ``[N, K]``
    (``[K, N]`` if ``transposed``), contiguous."""
    N, K = codes.shape[0], codes.shape[1] * 2
    q = torch.empty((K, N) if transposed else (N, K), dtype=torch.int8, device=codes.device)
    # 64 x 256 tiles (8 warps): 16 KB of codes written a program; 32-row tiles on the interpreter
    bn, bk, warps = (16, 128, 1) if codes.device.type == "cpu" else (64, 256, 8)
    wrap_triton(_nf4_to_int8_kernel)[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        codes, mul, lut, q, N, K, TRANSPOSED=transposed, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return q
