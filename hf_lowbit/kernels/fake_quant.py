"""Fake quantization (quantize, then dequantize, in the input's dtype) for QAT, in plain PyTorch.

The arithmetic follows torchao's ``choose_qparams_affine`` + ``_fake_quantize_affine`` step for
step and in the same dtype, so a fake-quantized weight equals what torchao's convert step stores
(dequantized) and a fake-quantized activation equals what its converted linear computes on:

* :func:`fake_quant_per_token_asym`: int8 per token (last dim), asymmetric: scale = (max⁺ − min⁻)/255,
  zero point = −128 − round(min⁻/scale).
* :func:`fake_quant_per_group_sym`: intN per group of ``group_size`` along the last dim, symmetric:
  scale = absmax / ((qmax − qmin)/2), e.g. absmax/7.5 for int4, values clamped to [−8, 7].
* :func:`fake_quant_int4_tinygemm`: int4 per group, asymmetric, in bfloat16, as
  ``Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`` stores it for the CUDA tinygemm kernel
  (``torch.ops.aten._weight_int4pack_mm``): codes 0..15, a bf16 scale and a bf16 *float* zero point per group.
* :func:`fake_quant_fp8_rowwise`: float8 e4m3 per row (last dim), absmax/448, as
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` quantizes weights and activations.

Under ``torch.compile`` "in the same dtype" is emulated: a bf16 (or fp16) input is computed in float32 and every
value that eager rounds to bf16 is rounded explicitly by :func:`round_to_bf16` (:func:`round_to_fp16`), integer ops
on the float32 bits; the inputs and the result too (no-ops in eager). Why: Inductor computes a fused low-precision
pointwise chain in float32 and drops the roundings between its ops, and folds cast pairs such as
float32 -> bf16 -> float32 (the caller's cast to bf16, e.g. under autocast, then the upcast here), so the compiled
plain bf16 arithmetic differed from eager, and from torchao's convert, on 10-70% of the values (issue 26); integer
ops it cannot elide. The result is eager's bit for bit (a bf16 op is a float32 op rounded once to bf16). Eagerly
the arithmetic runs in the dtype itself, as before: the emulation's extra full-size ops cost 2-12x there (CPU).
``torch._inductor.config.emulate_precision_casts`` also fixes it, but process-wide, for the whole model. Cost
compiled: on the CPU Inductor scalarizes the bitcasts (the fake quant runs 2-7x slower); in Triton they are free.

No autograd here (callers apply a straight-through estimator) and no data-dependent Python control
flow, so ``torch.compile`` fuses each into one or two kernels inside the QAT linear's
``autograd.Function``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def round_to_bf16(x: Tensor) -> Tensor:
    """``x.to(torch.bfloat16).float()`` for a float32 ``x``, computed on its bits (so Inductor keeps the rounding).

    Round to nearest, ties to even, on the int32 bit pattern: add ``0x7FFF`` plus the kept part's lowest bit,
    clear the low 16 bits. Subnormals round as the cast does (bf16 has float32's exponent range); values past
    bf16's largest round to ±inf, as the cast does; ±inf stay. NaN comes back as is (NaN; a cast to bf16 keeps it
    NaN, its payload may differ): positive NaNs, the only patterns the addition could overflow int32 with, are
    clamped to +inf's first and put back after.
    """
    b = x.view(torch.int32)
    r = b.clamp(max=0x7F800000)
    r = (r + (0x7FFF + ((r >> 16) & 1))) & -0x10000
    return torch.where((b & 0x7FFFFFFF) > 0x7F800000, b, r).view(torch.float32)


_FP16_MIN_NORMAL_BITS = 0x38800000  # 2**-14 in float32
_FP16_OVERFLOW_BITS = 0x47800000  # 2**16: a rounded value this large is past 65504, +inf in fp16


def round_to_fp16(x: Tensor) -> Tensor:
    """``x.to(torch.float16).float()`` for a float32 ``x``, on the bits as :func:`round_to_bf16` (ties to even).

    Normal range: the low 13 bits rounded off on the int32 pattern; a result of 2^16 or more is ±inf (the cast
    overflows from 65520 on). Below fp16's smallest normal (2^-14), multiples of 2^-24: ``round(|x|·2^24)·2^-24``,
    every step exact. NaN comes back as is.
    """
    b = x.view(torch.int32)
    a = b & 0x7FFFFFFF
    normal = a.clamp(max=_FP16_OVERFLOW_BITS)
    normal = (normal + (0xFFF + ((normal >> 13) & 1))) & -0x2000
    normal = torch.where(normal >= _FP16_OVERFLOW_BITS, 0x7F800000, normal)
    sub = (torch.round(x.abs() * 2.0 ** 24) * 2.0 ** -24).view(torch.int32)
    r = torch.where(a < _FP16_MIN_NORMAL_BITS, sub, normal) | (b & -0x80000000)
    return torch.where(a > 0x7F800000, b, r).view(torch.float32)


def _same(x: Tensor) -> Tensor:
    return x


def _emulating() -> bool:
    """Whether bf16/fp16 arithmetic is emulated in float32 (under ``torch.compile``; see the module doc)."""
    return torch.compiler.is_compiling()


def _arithmetic(dtype: torch.dtype) -> tuple[torch.dtype, Callable[[Tensor], Tensor]]:
    """The dtype to compute ``dtype``'s arithmetic in and the rounding to apply after each op: ``dtype`` and none
    eagerly, float32 and :func:`round_to_bf16` / :func:`round_to_fp16` when emulating."""
    if _emulating() and dtype in (torch.bfloat16, torch.float16):
        return torch.float32, round_to_bf16 if dtype == torch.bfloat16 else round_to_fp16
    return dtype, _same


def _qrange(bits: int) -> tuple[int, int]:
    if not 2 <= bits <= 8:  # the integer steps below are exact for codes of at most 8 bits (int8 storage)
        raise ValueError(f"bits must be in 2..8, got {bits}")
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def fake_quant_per_token_asym(x: Tensor, bits: int = 8) -> Tensor:
    """Asymmetric ``bits``-bit fake quantization of each row (last dim) of ``x``, in ``x.dtype``."""
    qmin, qmax = _qrange(bits)
    work, r = _arithmetic(x.dtype)
    xs = r(x.to(work))
    lo = torch.clamp(r(x.amin(-1, keepdim=True).to(work)), max=0)
    hi = torch.clamp(r(x.amax(-1, keepdim=True).to(work)), min=0)
    scale = torch.clamp(r(r(hi - lo) / float(qmax - qmin)), min=torch.finfo(x.dtype).smallest_normal)
    zero = torch.clamp(r(qmin - torch.round(r(lo / scale))), qmin, qmax)
    # Not rounded, as exact: code + zero (integers; past ±256, where bf16 would round them, both clamp to the
    # same end) and code − zero (|.| <= 255).
    q = torch.clamp(torch.round(r(xs * r(1.0 / scale))) + zero, qmin, qmax)
    return r((q - zero) * scale).to(x.dtype)


def fake_quant_per_group_sym(w: Tensor, group_size: int, bits: int = 4) -> Tensor:
    """Symmetric ``bits``-bit fake quantization of ``w`` [N, K] in groups of ``group_size`` along K."""
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"fake_quant_per_group_sym: weight of shape {tuple(w.shape)} is not 2-D with a last "
                         f"dim divisible by group_size={group_size}")
    qmin, qmax = _qrange(bits)
    work, r = _arithmetic(w.dtype)
    g = w.reshape(w.shape[0], -1, group_size)
    lo = torch.clamp(r(g.amin(-1, keepdim=True).to(work)), max=0)
    hi = torch.clamp(r(g.amax(-1, keepdim=True).to(work)), min=0)
    scale = torch.clamp(r(torch.maximum(-lo, hi) / (float(qmax - qmin) / 2)), min=torch.finfo(w.dtype).smallest_normal)
    q = torch.clamp(torch.round(r(r(g.to(work)) * r(1.0 / scale))), qmin, qmax)
    return r(q * scale).to(w.dtype).reshape(w.shape)


def fake_quant_int4_tinygemm(w: Tensor, group_size: int) -> Tensor:
    """The bf16 weight tinygemm's int4 kernel computes with, from ``w`` [N, K] (groups of ``group_size`` along K).

    torchao's ``_choose_qparams_affine_tinygemm`` + ``_quantize_affine_tinygemm`` step for step, in bf16
    (``Int4TilePackedTo4dTensor`` accepts bf16 weights only): no zero-preserving clamp,
    ``scale = (max − min)/15``, a float zero point ``zero = min + 8·scale``, codes
    ``q = clamp(round((w − (zero − 8·scale))/scale), 0, 15)``. The kernel dequantizes with one bf16 FMA,
    ``(q − 8)·scale + zero`` rounded once (``fma.rn.bf16x2``); here the product (12 significant bits) and
    the sum are formed in float32 and rounded to bf16 once. torchao's reference
    ``_dequantize_affine_tinygemm`` in bf16 rounds twice (after the product and after the sum) and is *not*
    what the kernel computes.
    """
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"fake_quant_int4_tinygemm: weight of shape {tuple(w.shape)} is not 2-D with a last "
                         f"dim divisible by group_size={group_size}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        w = w.to(torch.bfloat16)  # e.g. float64: rounded once, as by w.to(bf16)
    (work, r), (_, r_in) = _arithmetic(torch.bfloat16), _arithmetic(w.dtype)
    r_in = _same if w.dtype == torch.bfloat16 else r_in  # r_in: an fp16 w's own rounding first (emulating)
    g = r(r_in(w.to(work)).to(work)).reshape(w.shape[0], -1, group_size)  # w.to(bf16)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = torch.clamp(r(r(hi - lo) / 15.0), min=torch.finfo(torch.bfloat16).smallest_normal)
    scale8 = r(scale * 8.0)
    zero = r(lo + scale8)
    q = torch.clamp(torch.round(r(r(g - r(zero - scale8)) / scale)), 0, 15)
    return r((q.float() - 8.0) * scale.float() + zero.float()).to(torch.bfloat16).reshape(w.shape)


FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """torchao's row-wise e4m3 quantization of ``x`` (last dim): ``(codes float8_e4m3fn, scale float32 [..., 1])``.

    ``_choose_scale_float8`` / ``_quantize_affine_float8``: the scale is ``amax(|x|)/448`` computed in ``x.dtype``
    (emulated: rounded to it) and then held in float32, codes ``e4m3(clamp(x/scale, ±448))`` in float32. One
    departure: a row whose scale is 0 (all zeros) gets scale 1 (codes 0) where torchao's 0/0 gives NaN, which
    would end training. The activation side of the FP8 serving op too (:mod:`hf_lowbit.kernels.fp8_gemv`)."""
    work, r = _arithmetic(x.dtype)
    amax = r(x.abs().amax(-1, keepdim=True).to(work))
    scale = r(amax / FP8_E4M3_MAX).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (r(x.to(work)).float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fake_quant_fp8_rowwise(x: Tensor) -> Tensor:
    """Float8 e4m3 fake quantization of each row (last dim) of ``x``, in ``x.dtype``: :func:`quantize_fp8_rowwise`,
    then torchao's ``_dequantize_affine_float8``, ``code·scale`` rounded to ``x.dtype``."""
    work, r = _arithmetic(x.dtype)
    q, scale = quantize_fp8_rowwise(x)
    return r(q.float() * scale).to(x.dtype)
