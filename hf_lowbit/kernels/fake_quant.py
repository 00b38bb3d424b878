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

No autograd here (callers apply a straight-through estimator) and no data-dependent Python control
flow, so ``torch.compile`` fuses each into one or two kernels inside the QAT linear's
``autograd.Function``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _qrange(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def fake_quant_per_token_asym(x: Tensor, bits: int = 8) -> Tensor:
    """Asymmetric ``bits``-bit fake quantization of each row (last dim) of ``x``, in ``x.dtype``."""
    qmin, qmax = _qrange(bits)
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=torch.finfo(x.dtype).smallest_normal)
    zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero, qmin, qmax)
    return ((q - zero) * scale).to(x.dtype)


def fake_quant_per_group_sym(w: Tensor, group_size: int, bits: int = 4) -> Tensor:
    """Symmetric ``bits``-bit fake quantization of ``w`` [N, K] in groups of ``group_size`` along K."""
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"fake_quant_per_group_sym: weight of shape {tuple(w.shape)} is not 2-D with a last "
                         f"dim divisible by group_size={group_size}")
    qmin, qmax = _qrange(bits)
    g = w.reshape(w.shape[0], -1, group_size)
    amax = torch.maximum(-torch.clamp(g.amin(-1, keepdim=True), max=0), torch.clamp(g.amax(-1, keepdim=True), min=0))
    scale = torch.clamp(amax / (float(qmax - qmin) / 2), min=torch.finfo(w.dtype).smallest_normal)
    q = torch.clamp(torch.round(g * (1.0 / scale)), qmin, qmax)
    return (q * scale).to(w.dtype).reshape(w.shape)


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
    bf16 = torch.bfloat16
    g = w.to(bf16).reshape(w.shape[0], -1, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = torch.clamp((hi - lo) / 15.0, min=torch.finfo(bf16).smallest_normal)
    zero = lo + scale * 8.0
    q = torch.clamp(torch.round((g - (zero - scale * 8.0)) / scale), 0, 15)
    return ((q.float() - 8.0) * scale.float() + zero.float()).to(bf16).reshape(w.shape)


FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fake_quant_fp8_rowwise(x: Tensor) -> Tensor:
    """Float8 e4m3 fake quantization of each row (last dim) of ``x``, in ``x.dtype``.

    torchao's ``_choose_scale_float8`` / ``_quantize_affine_float8`` / ``_dequantize_affine_float8``: the
    scale is ``amax(|x|)/448`` computed in ``x.dtype`` and then held in float32, codes
    ``e4m3(clamp(x/scale, ±448))`` in float32, value ``code·scale`` rounded to ``x.dtype``. One departure:
    an all-zero row gets scale 1 (zeros back) where torchao's 0/0 gives NaN, which would end training.
    """
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax / FP8_E4M3_MAX).float()
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)
