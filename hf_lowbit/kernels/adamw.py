"""AdamW on a weight matrix in one Triton pass that also leaves each row's absmax (issue 25).

Why: the weight cache (``MixedPrecisionLinear``'s ``weight_cache``) re-quantizes every low-bit weight after each
optimizer step (:func:`hf_lowbit.kernels.quantize_weight`, the rows kernel). That kernel reads each weight row
twice, absmax then encode, because a row's scale must be known before its codes; on the H200 it ran at 1.5-2.0
TB/s of its minimal traffic, ~5 ms a step for 8 Llama-8B layers (docs/benchmarks.md, "Issue 25 at c62cf15"), right
after torch's fused AdamW had read and written the same weights. Here the optimizer's own pass computes the absmax
of each row it writes (an atomic integer max of ``|p|``'s float32 bits, NaN above inf) into ``row_amax``, which
``quantize_t_triton(..., variant="rows", row_amax=...)`` takes, so the refresh reads the weight once.

The update is torch's AdamW (``torch.optim.AdamW``, decoupled weight decay, no amsgrad, not maximized) in float32
for any stored dtype, rounded once when stored, as torch's fused CUDA kernel computes it:

    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1**step)) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

with the scalars rounded to float32 once on the host, the division and square root correctly rounded and no fused
multiply-add (``enable_fp_fusion=False``), so the GPU's bits are the interpreter's and those of
:func:`adamw_reference` (plain float32 torch, the same operations in the same order). torch's own kernels differ
from it in the last float32 bit at times (they form some products in float64 and contract into fmas): after the
rounding to a bf16 weight that is one bf16 step on a small share of elements (the tests bound it; torch's
float32 square root on the CPU is one of those: not always correctly rounded).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import on_operand_device
from .triton_quant import _abs_bits

# (BLOCK_R, BLOCK_K, num_warps) on CUDA: the fastest of the H200 sweep at 0232f11 (docs/results/refresh_h200.md: every
# weight shape, both formats; gate/up 0.207 ms against 0.220 at (8, 256, 4), the first guess, and 0.250 at (16, 256,
# 8)); the interpreter (CPU) uses small tiles
_TILES = (4, 256, 4)
_CPU_TILES = (4, 16, 1)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """float32 ``x`` to ``dtype`` rounded to nearest even. bf16 by integer ops: Triton's interpreter truncates
    float32 -> bf16 (the GPU's ``cvt.rn`` rounds to nearest even); NaN becomes the quiet NaN 0x7FC0 (torch's casts
    give other NaN payloads: the tests compare NaN as NaN)."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        r = tl.where(x != x, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _adamw_rows_kernel(p_ptr, g_ptr, m_ptr, v_ptr, amax_ptr, R, K, decay, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, step_size, bc2_sqrt, eps, ROW_AMAX: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """One ``[BLOCK_R, BLOCK_K]`` tile of contiguous ``[R, K]`` tensors updated in place; with ``ROW_AMAX`` the
    tile's per-row maximum of the stored ``|p|`` merged into ``amax_bits [R]`` (zeroed by the launcher) by an
    atomic integer max. Offsets are 64-bit (a weight may span 2**31 elements)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_r[:, None] < R) & (offs_k[None, :] < K)
    idx = offs_r[:, None].to(tl.int64) * K + offs_k[None, :]
    p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32) + one_minus_beta1 * g
    v = beta2 * tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32) + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    new = p * decay - tl.math.div_rn(step_size * m, denom)
    stored = _cast(new, p_ptr.dtype.element_ty)  # the weight as kept: the absmax is of this
    tl.store(p_ptr + idx, stored, mask=mask)
    tl.store(m_ptr + idx, _cast(m, m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + idx, _cast(v, v_ptr.dtype.element_ty), mask=mask)
    if ROW_AMAX:
        bits = tl.where(mask, _abs_bits(stored.to(tl.float32)), 0)  # |p|'s bits: NaN above inf
        tl.atomic_max(amax_ptr + offs_r, tl.max(bits, axis=1), mask=offs_r < R, sem="relaxed")


def _scalars(step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> dict:
    """The host-side scalars of one step (Python floats: Triton passes them as float32)."""
    if step < 1:
        raise ValueError(f"adamw_rows_: step counts from 1 (the first update), got {step}")
    return dict(decay=1.0 - lr * weight_decay, beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2,
                one_minus_beta2=1.0 - beta2, step_size=lr / (1.0 - beta1 ** step),
                bc2_sqrt=math.sqrt(1.0 - beta2 ** step))


@torch.no_grad()
@on_operand_device
def adamw_rows_(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
                beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
                row_amax: Tensor | None = None, tiles: tuple[int, int, int] | None = None) -> Tensor | None:
    """One AdamW step of a 2-D weight ``p [R, K]`` in place (``exp_avg`` / ``exp_avg_sq`` updated in place; any
    float dtypes, all contiguous and of ``p``'s shape). ``step``: this update's number, from 1 (its bias
    corrections). ``row_amax``: int32 ``[R]`` to receive each row's absmax of the updated weight as float32 bits
    (zeroed here first); returned. ``tiles``: ``(BLOCK_R, BLOCK_K, num_warps)``, powers of two."""
    if p.dim() != 2 or any(t.shape != p.shape for t in (g, exp_avg, exp_avg_sq)):
        raise ValueError(f"adamw_rows_: p, g, exp_avg and exp_avg_sq must be one 2-D shape, got {tuple(p.shape)}, "
                         f"{tuple(g.shape)}, {tuple(exp_avg.shape)}, {tuple(exp_avg_sq.shape)}")
    if not all(t.is_contiguous() and t.is_floating_point() and t.device == p.device
               for t in (p, g, exp_avg, exp_avg_sq)):
        raise ValueError("adamw_rows_: p, g, exp_avg and exp_avg_sq must be contiguous floating-point tensors on one "
                         "device")
    R, K = p.shape
    if row_amax is not None:
        if row_amax.shape != (R,) or row_amax.dtype != torch.int32 or row_amax.device != p.device \
                or not row_amax.is_contiguous():
            raise ValueError(f"adamw_rows_: row_amax must be {R} contiguous int32 values on {p.device}, got "
                             f"{tuple(row_amax.shape)} {row_amax.dtype} strides {row_amax.stride()} on "
                             f"{row_amax.device}")
        row_amax.zero_()  # |p| >= +0: the max's identity
    small = p.device.type == "cpu"
    br, bk, warps = tiles or (_CPU_TILES if small else _TILES)
    if not all(isinstance(t, int) and t > 0 and t & (t - 1) == 0 for t in (br, bk, warps)):
        raise ValueError(f"adamw_rows_: tiles must be (block, block, num_warps), powers of two, got {tiles}")
    if triton.cdiv(K, bk) > 65535:  # the grid's second axis: CUDA refuses the launch past it ("invalid argument")
        raise ValueError(f"adamw_rows_: p of shape {tuple(p.shape)} takes {triton.cdiv(K, bk):,} blocks of {bk} "
                         "columns, past the 65,535 a CUDA grid's second axis holds; view it as rows of fewer columns "
                         "(LowBitAdamW passes rows of 1024)")
    kw = {} if small else {"enable_fp_fusion": False}  # no fma contraction: the interpreter's bits
    _adamw_rows_kernel[(triton.cdiv(R, br), triton.cdiv(K, bk))](
        p, g, exp_avg, exp_avg_sq, p if row_amax is None else row_amax, R, K, eps=eps,
        **_scalars(step, lr, beta1, beta2, weight_decay), ROW_AMAX=row_amax is not None, BLOCK_R=br, BLOCK_K=bk,
        num_warps=warps, **kw)
    return row_amax


@torch.no_grad()
def adamw_reference(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
                    beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                    weight_decay: float = 0.01) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`adamw_rows_`'s arithmetic in plain float32 torch (not in place): ``(p, exp_avg, exp_avg_sq)`` in their
    own dtypes, the same bits (the test reference)."""
    c = {k: torch.tensor(v, dtype=torch.float32) for k, v in _scalars(step, lr, beta1, beta2, weight_decay).items()}
    f = lambda t: t.float()  # noqa: E731
    m = c["beta1"] * f(exp_avg) + c["one_minus_beta1"] * f(g)
    v = c["beta2"] * f(exp_avg_sq) + (c["one_minus_beta2"] * f(g)) * f(g)
    # torch's float32 sqrt on the CPU is not always correctly rounded (one ulp off at times, vectorized); through
    # float64 it is (53 bits hold a float32 square root's rounding exactly)
    denom = v.double().sqrt().float() / c["bc2_sqrt"] + torch.tensor(eps, dtype=torch.float32)
    new = f(p) * c["decay"] - (c["step_size"] * m) / denom
    return new.to(p.dtype), m.to(exp_avg.dtype), v.to(exp_avg_sq.dtype)
