"""Fake quantization (quantize, then dequantize, in the input's dtype) for QAT, in plain PyTorch.

The arithmetic follows torchao's ``choose_qparams_affine`` + ``_fake_quantize_affine`` step for
step and in the same dtype, so a fake-quantized weight equals what torchao's convert step stores
(dequantized) and a fake-quantized activation equals what its converted linear computes on:

* :func:`fake_quant_per_token_asym`: int8 per token (last dim), asymmetric: scale = (max⁺ − min⁻)/255,
  zero point = −128 − round(min⁻/scale).
* :func:`fake_quant_per_group_sym`: intN per group of ``group_size`` along the last dim, symmetric:
  scale = absmax / ((qmax − qmin)/2), e.g. absmax/7.5 for int4, values clamped to [−8, 7].

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
