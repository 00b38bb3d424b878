"""The row-wise FP8 linear of a torchao ``fp8_rowwise`` export as one op, ``hf_lowbit::fp8_rowwise_linear``.

``fp8_rowwise_linear(x [M, K], w [N, K] e4m3, w_scale [N] float32, bias [N] | None)`` computes what torchao's
``Float8Tensor`` weight computes in ``F.linear`` (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``):
each row of ``x`` quantized to e4m3 with its own scale, the product of codes summed in float32, scaled by both
scales, the bias added, one rounding to ``x``'s dtype.

* CUDA, M ≤ 16 (decoding): the Triton GEMV of :mod:`.triton_fp8_gemv` in its default design
  (``DEFAULT_DESIGN``, ``"codes"``: the activation quantized once by a row kernel, the fp8 weight streamed once,
  float32 row sums at M = 1; ``"fused"``, the first design, quantizes inside the GEMV).
* CUDA, M > 16 (prefill): what the export runs, the rows quantized in plain torch (Inductor fuses it) and
  ``torch._scaled_mm`` with row-wise scales and fast accumulation (torchao's default on sm_89+).
* Other devices: :func:`fp8_rowwise_linear_reference`, the codes exactly and the matmul in float32 (what the
  kernel is tested against).

A ``torch.library.triton_op``: under ``torch.compile`` Inductor traces into it and launches the Triton kernels from
its generated code (no graph break, no Python dispatch per call, CUDA-graph friendly).

The activation codes are torchao's bit for bit as torch runs them on the device (``_choose_scale_float8``:
``amax / 448`` in ``x``'s dtype, then float32; on CUDA that division by a Python scalar is a multiplication by
its float32 reciprocal; ``_quantize_affine_float8``: ``e4m3(clamp(x.float() / scale, ±448))``), with one
departure: a row whose scale is 0 (all zeros) gets scale 1 and codes 0, so the output is the bias, where torchao's
0/0 gives a NaN row (:func:`hf_lowbit.kernels.fake_quant.fake_quant_fp8_rowwise` departs the same way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fake_quant import quantize_fp8_rowwise
from .fp8 import FP8_DTYPE
MAX_GEMV_M = 16  # rows the decode kernel takes (triton_fp8_gemv.MAX_M)


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """torchao's row-wise activation quantization of ``x`` [..., K]: ``(codes e4m3, scale float32 [...])``
    (:func:`hf_lowbit.kernels.fake_quant.quantize_fp8_rowwise`: the QAT fake quant's, the same bits eagerly and
    compiled; an all-zero row gets scale 1, codes 0, instead of torchao's NaN). Plain torch: Inductor fuses it."""
    q, scale = quantize_fp8_rowwise(x)
    return q, scale.squeeze(-1)


def fp8_rowwise_linear_reference(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The op's arithmetic on any device: torchao's codes, their products summed in float32 (each product exact),
    ``(sum * s_x) * s_w + bias`` in float32, rounded once to ``x``'s dtype."""
    q, sx = quantize_fp8_rows(x)
    acc = q.float() @ w.float().T
    out = acc * sx.reshape(-1, 1) * w_scale.reshape(1, -1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _check(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> None:
    # plain if/raise (evaluated at trace time, no graph break: see _checks.check_scaled_mm_args)
    if x.dim() != 2 or w.dim() != 2:
        raise RuntimeError(f"fp8_rowwise_linear: x and w must be 2-D, got {x.dim()}-D and {w.dim()}-D")
    if w.dtype != FP8_DTYPE or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise RuntimeError(f"fp8_rowwise_linear: w must be float8_e4m3fn and x floating, got {w.dtype}, {x.dtype}")
    if x.shape[1] != w.shape[1]:
        raise RuntimeError(f"fp8_rowwise_linear: reduction dims differ: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if w_scale.numel() != w.shape[0] or w_scale.dtype != torch.float32:
        raise RuntimeError("fp8_rowwise_linear: w_scale needs one float32 value per row of w")
    if bias is not None and bias.numel() != w.shape[0]:
        raise RuntimeError("fp8_rowwise_linear: bias needs one value per row of w")


def _scaled_mm_rows(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """Prefill on CUDA: the export's own path (torchao's ``addmm_float8_unwrapped_inference``)."""
    q, sx = quantize_fp8_rows(x)
    M, K = x.shape
    N = w.shape[0]
    if K % 16 or N % 16:  # torchao's convert skips such layers; pad for _scaled_mm (zeros change no product)
        from .fp8 import _scaled_mm_cuda

        out = _scaled_mm_cuda(q, w, sx, w_scale, torch.float32)
        return (out + bias.float() if bias is not None else out).to(x.dtype)
    fused_bias = bias is not None and x.dtype != torch.float32  # _scaled_mm takes no bias with a float32 output
    out = torch._scaled_mm(q, w.T, scale_a=sx.reshape(-1, 1), scale_b=w_scale.reshape(1, -1).float(),
                           bias=bias.to(x.dtype) if fused_bias else None, out_dtype=x.dtype, use_fast_accum=True)
    return out + bias if bias is not None and not fused_bias else out


@torch.library.triton_op("hf_lowbit::fp8_rowwise_linear", mutates_args=())
def fp8_rowwise_linear(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``q(x) @ w.T * s_x * s_w (+ bias)`` in ``x``'s dtype; ``x`` [M, K], ``w`` [N, K] e4m3 (K contiguous on
    CUDA), ``w_scale`` [N] (or [N, 1]) float32. See the module docstring for the paths."""
    _check(x, w, w_scale, bias)
    if x.device.type == "cuda":
        if x.shape[0] <= MAX_GEMV_M:
            from .triton_fp8_gemv import fp8_gemv_triton

            return fp8_gemv_triton(x, w if w.stride(1) == 1 else w.contiguous(), w_scale.reshape(-1), bias)
        return _scaled_mm_rows(x, w, w_scale, bias)
    return fp8_rowwise_linear_reference(x, w, w_scale, bias)
