"""FP8 building blocks: row-wise (and tensorwise) e4m3 quantization and the scaled FP8 matmul custom op.

Same contract as :mod:`hf_lowbit.kernels.int8`: quantization is plain PyTorch (Inductor fuses it);
``hf_lowbit::fp8_scaled_mm`` is a custom op with a fake implementation. CUDA runs
``torch._scaled_mm`` with row-wise scales (Hopper FP8 tensor cores, fp32 accumulation); other devices
run the same arithmetic on upcast operands (products of e4m3 values are exact in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_scaled_mm_args

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_AMAX = 1e-30
ALIGN = 16  # _scaled_mm needs K and N to be multiples of 16


def quantize_fp8(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """Absmax-scaled e4m3 along ``dim``: ``x ≈ q.float() * scale``; NaN/inf rows keep a non-finite scale."""
    x32 = x.float()
    amax = x32.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=_MIN_AMAX) / FP8_MAX
    return encode_fp8(x32, scale), scale


def quantize_fp8_tensorwise(x: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """:func:`quantize_fp8` with one scale for all of ``x`` (its absmax / 448; a NaN/inf anywhere makes it
    non-finite). The scale comes back expanded to :func:`quantize_fp8`'s shape (``dim`` kept as 1, a stride-0 view),
    so the code that takes one scale per row or column needs no special case; the codes are then the same in both
    layouts (a column quantization is a cast and a transpose, no per-column absmax)."""
    x32 = x.float()
    scale = x32.abs().amax().clamp(min=_MIN_AMAX) / FP8_MAX
    shape = list(x.shape)
    shape[dim] = 1
    return encode_fp8(x32, scale), scale.expand(shape)


def encode_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """The e4m3 codes of ``x`` for a given (broadcastable, float32) ``scale`` (:func:`quantize_fp8` without
    the absmax)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    check_scaled_mm_args("fp8_scaled_mm", FP8_DTYPE, a, b, a_scale, b_scale)


@torch.library.custom_op("hf_lowbit::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a @ b.T) * a_scale[:, None] * b_scale[None, :]``; a ``[M, K]``, b ``[N, K]`` e4m3, fp32 accumulation."""
    _check(a, b, a_scale, b_scale)
    acc = a.float() @ b.float().T
    return (acc * a_scale.reshape(-1, 1).float() * b_scale.reshape(1, -1).float()).to(out_dtype)


@fp8_scaled_mm.register_fake
def _(a, b, a_scale, b_scale, out_dtype):
    _check(a, b, a_scale, b_scale)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def fp8_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``fp8_scaled_mm``'s arithmetic; on CUDA a direct ``torch._scaled_mm`` call, not the custom op.

    Under ``torch.compile`` Inductor lowers ``aten._scaled_mm`` itself (launched from its generated code,
    scale reshapes and the output cast fused around it) where the custom op cost a Python dispatch per
    call, most of the step at 2048-token micro-batches (docs/benchmarks.md, "Small micro-batches")."""
    if a.is_cuda:
        _check(a, b, a_scale, b_scale)
        return _scaled_mm_cuda(a, b, a_scale, b_scale, out_dtype)
    return fp8_scaled_mm(a, b, a_scale, b_scale, out_dtype)


def fp8_tensorwise_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """:func:`fp8_mm` for operands with one scale each (every element of ``a_scale``, and of ``b_scale``, equal:
    :func:`quantize_fp8_tensorwise`'s expanded scales, or ones). On CUDA the tensorwise ``torch._scaled_mm`` (one
    float32 scale per operand, the first element); elsewhere the same reference as :func:`fp8_mm`."""
    if a.is_cuda:
        _check(a, b, a_scale, b_scale)
        return _scaled_mm_cuda(a, b, a_scale, b_scale, out_dtype, tensorwise=True)
    return fp8_scaled_mm(a, b, a_scale, b_scale, out_dtype)


@fp8_scaled_mm.register_kernel("cuda")
def _(a, b, a_scale, b_scale, out_dtype):
    _check(a, b, a_scale, b_scale)
    return _scaled_mm_cuda(a, b, a_scale, b_scale, out_dtype)


def _scaled_mm_cuda(a, b, a_scale, b_scale, out_dtype, tensorwise: bool = False):
    if not torch.compiler.is_compiling() and torch.cuda.get_device_capability(a.device) < (8, 9):
        raise RuntimeError("fp8_scaled_mm needs FP8 tensor cores (compute capability 8.9 or newer, e.g. L4, H100, "
                           f"H200); this GPU is {torch.cuda.get_device_name(a.device)}. Use int8_mixed_precision.")
    M, K = a.shape
    N = b.shape[0]
    pad_k, pad_n = -K % ALIGN, -N % ALIGN
    if pad_k or pad_n:  # zero padding leaves every product unchanged
        a = F.pad(a.view(torch.uint8), (0, pad_k)).view(FP8_DTYPE)
        b = F.pad(b.view(torch.uint8), (0, pad_k, 0, pad_n)).view(FP8_DTYPE)
        if not tensorwise:
            b_scale = F.pad(b_scale.reshape(-1), (0, pad_n), value=1.0)
    if tensorwise:  # tensorwise _scaled_mm: one fp32 scale per operand
        scale_a, scale_b = (s.reshape(-1)[:1].float().contiguous() for s in (a_scale, b_scale))
    else:  # row-wise _scaled_mm: fp32 scales [M, 1] and [1, N]
        scale_a, scale_b = a_scale.reshape(-1, 1).float().contiguous(), b_scale.reshape(1, -1).float().contiguous()
    # a row-major, b column-major, bf16 output
    out = torch._scaled_mm(a.contiguous(), b.contiguous().T, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return out[:, :N].to(out_dtype)
