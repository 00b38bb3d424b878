"""The registry of low-bit number formats: one :class:`Format` record per format.

Everything the rest of the package needs to know about a format lives in its record: how to
quantize an operand, which scaled-matmul op multiplies two quantized operands, the storage
dtype and largest code of a quantized value, the feature alignment its matmul needs (the swap skips
layers that do not meet it) and the GPU compute capability whose tensor cores run it.
``hf_lowbit.kernels.scaled_matmul``, ``hf_lowbit::quantize_t``, the mixed-precision recipe's filter and
the setup checks all read it. A new format (e.g. INT4; FP8 tensorwise was one) is one record here plus its
kernels in this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .fp8 import ALIGN as FP8_ALIGN
from .fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    encode_fp8,
    fp8_mm,
    fp8_tensorwise_mm,
    quantize_fp8,
    quantize_fp8_tensorwise,
)
from .int8 import INT8_MAX, encode_int8, int8_scaled_mm, quantize_int8


@dataclass(frozen=True)
class Format:
    """One number format of the low-bit matmuls.

    ``quantize(x, dim) -> (q, scale)``: symmetric absmax quantization along ``dim`` (``x ≈ q * scale``,
    ``scale`` float32 with ``dim`` kept). ``encode(x, scale) -> q``: the same codes for a known scale.
    ``scaled_mm(a [M, K], b [N, K], a_scale [M], b_scale [N],
    out_dtype)``: the op computing ``(a @ b.T) * a_scale[:, None] * b_scale[None, :]``.
    ``dtype``: the storage dtype of ``q``; ``qmax``: its largest magnitude. ``alignment``: in and out
    features must be multiples of it. ``min_capability``: the CUDA compute capability whose tensor
    cores run the matmul. ``tensorwise``: one scale per tensor (``quantize`` returns it expanded to the per-row or
    per-column shape): the codes are the same in both layouts, so a column quantization is the row one transposed,
    plain torch that Inductor fuses; the per-column Triton kernels (``hf_lowbit::quantize_t``, ``quantize_dual``),
    which compute one scale per column, are never used for it. The weight cache's eager refresh
    (``quantize_weight``) runs the rows kernel with one scale (``quantize_t_triton(..., tensorwise=True)``).
    """

    name: str
    quantize: Callable[..., tuple[Tensor, Tensor]]
    encode: Callable[[Tensor, Tensor], Tensor]
    scaled_mm: Callable[..., Tensor]
    dtype: torch.dtype
    qmax: float
    alignment: int = 1
    min_capability: tuple[int, int] = (8, 0)
    tensor_cores: str = ""  # how the setup checks name the hardware it needs
    tensorwise: bool = False


FORMATS: dict[str, Format] = {
    "int8": Format("int8", quantize_int8, encode_int8, int8_scaled_mm, torch.int8, INT8_MAX, alignment=1,
                   min_capability=(8, 0), tensor_cores="INT8"),
    "fp8": Format("fp8", quantize_fp8, encode_fp8, fp8_mm, FP8_DTYPE, FP8_MAX, alignment=FP8_ALIGN,
                  min_capability=(8, 9), tensor_cores="FP8"),
    # one scale per tensor: cuBLAS's plain FP8 GEMM, no per-column quantization kernels (issue 25 cites torchtitan:
    # +25% over bf16 against row-wise's +10% on Llama-3-8B; ours unmeasured); one outlier sets the whole tensor's scale
    "fp8_tensorwise": Format("fp8_tensorwise", quantize_fp8_tensorwise, encode_fp8, fp8_tensorwise_mm, FP8_DTYPE,
                             FP8_MAX, alignment=FP8_ALIGN, min_capability=(8, 9), tensor_cores="FP8", tensorwise=True),
}


def get_format(name: str) -> Format:
    """The record of format ``name``; a ValueError lists the known ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown number format {name!r}; known formats: {', '.join(FORMATS)}") from None


__all__ = ["Format", "FORMATS", "get_format"]
