"""Triton scaled INT8 matmul: ``out = (a @ b.T) * a_scale[:, None] * b_scale[None, :] (+ c @ d.T)``.

A tiled tensor-core matmul with int32 accumulation and the row/column scales applied in the
epilogue, so the int32 product never goes to memory. The optional low-rank addend ``c @ d.T`` (``c [M, R]``,
``d [N, R]``, R small: a LoRA branch's ``x·Aᵀ`` and ``B·scaling``) is one more ``tl.dot`` in the same epilogue,
in float32, so a LoRA layer's output is written once instead of three times (base output, LoRA output, sum). Operands
may be transposed views (any strides). Autotuned per (M, N, K, layout); under ``TRITON_INTERPRET=1`` one small tile is
used so the kernel can be checked on a CPU.

``_scaled_mm_accumulate_kernel`` shares its tile order and main loop (``_tile_offsets``, ``_tile_product``) and adds
the scaled product into an existing tensor instead (``hf_lowbit::scaled_mm_accumulate_``: a weight gradient
accumulated across micro-batches), for INT8 or FP8 e4m3 codes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._launch import on_operand_device

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(extra=()):
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2},
                              num_warps=1, num_stages=1)]
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the 4-stage 128x256 / 256x128 tiles (196 KB of shared memory)
    # are for Hopper's deeper pipelines at 2048-token operands
    shapes = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
              (128, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
              (128, 256, 128, 8, 4), (256, 128, 128, 8, 4), *extra]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_warps=w, num_stages=s) for bm, bn, bk, w, s in shapes]


# the accumulating kernel's epilogue reads a tile of .grad after the product's loop: tiles small enough in registers
# and shared memory for two programs an SM, so one program's read can overlap the other's products
_ACCUMULATE_EXTRA = ((128, 128, 128, 4, 3), (128, 128, 128, 4, 2))


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile: its row and column offsets, tiles in grouped order for L2 reuse."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    group_id = pid // group_size
    first_m = group_id * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_m)
    pid_n = (pid % group_size) // group_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _tile_product(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                  A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr, INT_CODES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The output tile at ``offs_m`` x ``offs_n`` of ``a @ b.T`` (``INT_CODES``: int8 codes, int32 sums; else FP8
    e4m3 codes, float32 sums)."""
    offs_k = tl.arange(0, BLOCK_K)
    # Contiguous-K flags let the compiler vectorize along K without relying on stride specialization.
    # Offsets in 64 bits: an operand spanning 2^31 elements or more (a low-bit LM head's dY codes at a 128k
    # vocabulary and 16.7k tokens, a 14336-wide linear's at 150k) would wrap in 32. Its rows' offsets, and a
    # transposed view's K offsets (formed once before the loop, then a scalar BLOCK_K * stride a step: the loop's
    # code is that of 32 bits; a contiguous K's stride is the constexpr 1)
    sak = 1 if A_K_CONTIG else stride_ak.to(tl.int64)
    sbk = 1 if B_K_CONTIG else stride_bk.to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * sak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * sbk
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N

    if INT_CODES:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0)
            b = tl.load(b_ptrs, mask=mask_n & (offs_k[:, None] < k_left), other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
    else:  # e4m3 takes no integer fill value
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=mask_n & (offs_k[:, None] < k_left), other=0.0)
            # products added into the float32 sum every BLOCK_K (sm_90's FP8 MMA keeps fewer bits; Triton's default
            # there never promotes), as cuBLAS does without fast accumulation
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
    return acc


@triton.autotune(configs=_configs(), key=["M", "N", "K", "A_K_CONTIG", "B_K_CONTIG", "HAS_ADD", "R"])
@triton.jit
def _int8_scaled_mm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, out_ptr, c_ptr, d_ptr,
    M, N, K, R,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on, stride_cm, stride_cr, stride_dn, stride_dr,
    A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_R: tl.constexpr,
    ADD_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_product(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                        A_K_CONTIG, B_K_CONTIG, True, BLOCK_M, BLOCK_N, BLOCK_K)
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_ADD:  # + c @ d.T over the small R, in float32 (R padded to BLOCK_R >= 16 with zeros)
        offs_r = tl.arange(0, BLOCK_R).to(tl.int64)  # (64 bits: a transposed c or d, columns far apart)
        c = tl.load(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_r[None, :] * stride_cr,
                    mask=mask_m & (offs_r[None, :] < R), other=0.0)
        d = tl.load(d_ptr + offs_n[None, :].to(tl.int64) * stride_dn + offs_r[:, None] * stride_dr,
                    mask=mask_n & (offs_r[:, None] < R), other=0.0)
        if ADD_IEEE:  # float32 operands (no TF32), and the interpreter, whose bf16 dot is wrong (Triton 3.6);
            # bf16 products are exact in float32, so both forms compute the same sums
            out += tl.dot(c.to(tl.float32), d.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        else:
            out += tl.dot(c, d, out_dtype=tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m & mask_n)


@triton.autotune(configs=_configs(_ACCUMULATE_EXTRA), key=["M", "N", "K", "A_K_CONTIG", "B_K_CONTIG", "INT_CODES"],
                 restore_value=["acc_ptr"])
@triton.jit
def _scaled_mm_accumulate_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, acc_ptr,
    M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr, INT_CODES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``acc += (a @ b.T) * a_scale[:, None] * b_scale[None, :]`` in place, the sum in float32 rounded to ``acc``'s
    dtype once: a weight gradient accumulated in the epilogue. INT8 codes (``INT_CODES``: int32 products) or FP8 e4m3
    codes (float32 products)."""
    # The accumulator's tile is read after the product's loop, not overlapped with it: on the H200 (8 Llama-8B layers,
    # 1x2048, accumulation 8) the INT8 kernel took 66.7 ms a step where the plain one took 50.3 (+16.4 against the
    # 19.8 ms of autograd's add it replaces); read before the loop (its registers held through it) 75.7 ms.
    # docs/benchmarks.md, "Fused gradient accumulation"
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc_t = _tile_product(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bn, stride_bk,
                          A_K_CONTIG, B_K_CONTIG, INT_CODES, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    # 64-bit offsets, rows and columns: ``acc`` may be a transposed view (columns far apart)
    c_ptrs = acc_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    prev = tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    out = acc_t.to(tl.float32) * a_scale[:, None] * b_scale[None, :] + prev
    tl.store(c_ptrs, out.to(acc_ptr.dtype.element_ty), mask=mask)


@on_operand_device
def int8_scaled_mm_triton(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                          b_scale: torch.Tensor, out_dtype: torch.dtype, c: torch.Tensor | None = None,
                          d: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel; ``a`` [M, K] and ``b`` [N, K] int8 of any strides, scales float32; ``c`` [M, R] and
    ``d`` [N, R] (any strides, one floating dtype) add ``c @ d.T`` in the epilogue."""
    M, K = a.shape
    N = b.shape[0]
    has_add = c is not None
    R = c.shape[1] if has_add else 0
    c_, d_ = (c, d) if has_add else (a_scale, a_scale)  # never read without HAS_ADD
    sc = (c.stride(0), c.stride(1), d.stride(0), d.stride(1)) if has_add else (0, 0, 0, 0)
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    a_scale = a_scale.reshape(-1).float().contiguous()
    b_scale = b_scale.reshape(-1).float().contiguous()

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    wrap_triton(_int8_scaled_mm_kernel)[grid](
        a, b, a_scale, b_scale, out, c_, d_, M, N, K, R,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), *sc,
        A_K_CONTIG=a.stride(1) == 1, B_K_CONTIG=b.stride(1) == 1, HAS_ADD=has_add,
        BLOCK_R=max(16, triton.next_power_of_2(R)), ADD_IEEE=has_add and (c.dtype == torch.float32 or _INTERPRET),
    )
    return out


@on_operand_device
def scaled_mm_accumulate_triton(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                                b_scale: torch.Tensor) -> None:
    """Launch the accumulating kernel: the scaled product of ``a [M, K]`` and ``b [N, K]`` (both int8 or both
    float8_e4m3fn, any strides) added into ``acc [M, N]`` (a floating dtype, any strides) in place."""
    M, K = a.shape
    N = b.shape[0]
    a_scale = a_scale.reshape(-1).float().contiguous()
    b_scale = b_scale.reshape(-1).float().contiguous()

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    wrap_triton(_scaled_mm_accumulate_kernel)[grid](
        a, b, a_scale, b_scale, acc, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), acc.stride(0), acc.stride(1),
        A_K_CONTIG=a.stride(1) == 1, B_K_CONTIG=b.stride(1) == 1, INT_CODES=a.dtype == torch.int8,
    )
