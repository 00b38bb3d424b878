"""INT8 building blocks: row-wise quantization and the scaled INT8 matmul op.

* :func:`quantize_int8` is plain PyTorch on purpose: under ``torch.compile`` Inductor fuses the
  abs/amax/divide/round/clamp/cast chain with its neighbours instead of running eager kernels.
* :func:`int8_scaled_mm` is a ``torch.library.triton_op`` (``hf_lowbit::int8_scaled_mm``): traceable, so
  ``torch.compile`` goes through it without a graph break and Inductor launches its Triton kernel
  (:mod:`hf_lowbit.kernels.triton_int8`) from the generated code; every other device runs an exact integer
  reference (chunked float32 products, each chunk exact, summed in int32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_scaled_mm_args

# Smallest absmax we divide by. A row whose absmax is below it quantizes to zeros (its true values
# are < 1e-30, i.e. zero for any bf16/fp32 consumer). NaN rows keep a NaN scale on purpose: the
# NaN then reaches the output instead of vanishing in the cast to int8.
_MIN_AMAX = 1e-30
INT8_MAX = 127.0


def quantize_int8(x: Tensor, dim: int = -1, stochastic: bool = False) -> tuple[Tensor, Tensor]:
    """Symmetric absmax quantization of ``x`` along ``dim`` (the matmul's reduction dim).

    Returns ``(q, scale)`` with ``q`` int8 in [-127, 127], ``scale`` float32 with ``dim`` kept as
    size 1, and ``x ≈ q * scale``. Non-finite rows give non-finite scales (never silently finite).
    ``stochastic``: round ``x / scale`` down or up with the probability of its distance to each
    (``floor(y + u)``, ``u ~ U[0, 1)``), so ``E[q] * scale = x`` exactly; under ``torch.compile``
    Inductor draws ``u`` inside the fused quantization kernel (no tensor of random numbers).
    """
    amax = x.abs().amax(dim=dim, keepdim=True).float()  # exact in x's dtype
    scale = amax.clamp(min=_MIN_AMAX) / INT8_MAX  # clamp keeps NaN, so NaN rows stay NaN
    return encode_int8(x, scale, stochastic), scale


def encode_int8(x: Tensor, scale: Tensor, stochastic: bool = False) -> Tensor:
    """The codes of ``x`` for a given (broadcastable, float32) ``scale``: :func:`quantize_int8` without the
    absmax, for re-encoding a tensor whose scale is already known (the weight's, in the input gradient)."""
    y = x / scale  # divides in float32 (type promotion)
    y = (y + torch.rand_like(y)).floor() if stochastic else y.round()
    return y.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def _check_mm_args(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> None:
    check_scaled_mm_args("int8_scaled_mm", torch.int8, a, b, a_scale, b_scale)


def _check_addend(a: Tensor, b: Tensor, add_a: Tensor | None, add_b: Tensor | None) -> None:
    if (add_a is None) != (add_b is None):
        raise RuntimeError("int8_scaled_mm: add_a and add_b come together (the addend is add_a @ add_b.T)")
    if add_a is None:
        return
    if add_a.dim() != 2 or add_b.dim() != 2 or add_a.shape[0] != a.shape[0] or add_b.shape[0] != b.shape[0] \
            or add_a.shape[1] != add_b.shape[1]:
        raise RuntimeError(f"int8_scaled_mm: the addend needs add_a [M={a.shape[0]}, R] and add_b [N={b.shape[0]}, R], "
                           f"got {tuple(add_a.shape)} and {tuple(add_b.shape)}")
    if add_a.dtype != add_b.dtype or not add_a.is_floating_point():
        raise RuntimeError(f"int8_scaled_mm: add_a and add_b must share one floating dtype, got {add_a.dtype} and "
                           f"{add_b.dtype}")


# fp32 holds every integer below 2**24 exactly; a chunk of k int8×int8 products sums to at most
# k * 127 * 127, so chunks of 1024 are exact and the chunk sums can be added in int32.
_EXACT_FP32_CHUNK = 1024


def int8_mm_reference(a: Tensor, b: Tensor) -> Tensor:
    """Exact ``a @ b.T`` for int8 ``a [M, K]``, ``b [N, K]``, as int32 (any device, fast on CPU)."""
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32, device=a.device)
    for k0 in range(0, a.shape[1], _EXACT_FP32_CHUNK):
        a_c = a[:, k0:k0 + _EXACT_FP32_CHUNK].float()
        b_c = b[:, k0:k0 + _EXACT_FP32_CHUNK].float()
        out += (a_c @ b_c.T).to(torch.int32)
    return out


@torch.library.triton_op("hf_lowbit::int8_scaled_mm", mutates_args=())
def int8_scaled_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                   out_dtype: torch.dtype, add_a: Tensor | None = None, add_b: Tensor | None = None) -> Tensor:
    """``(a @ b.T) * a_scale[:, None] * b_scale[None, :] (+ add_a @ add_b.T)`` in ``out_dtype``.

    ``a`` is int8 ``[M, K]``, ``b`` int8 ``[N, K]`` (any strides: transposed views are fine),
    ``a_scale`` float32 with M elements, ``b_scale`` float32 with N elements. Accumulation is int32.
    ``add_a [M, R]``, ``add_b [N, R]`` (one floating dtype, R small): a low-rank addend formed in float32 in the
    epilogue and rounded to ``out_dtype`` once with the product (a LoRA branch fused into its base's matmul).

    A ``triton_op``: under ``torch.compile`` Inductor sees the Triton kernel itself and launches it from
    its generated code (no Python dispatch per call, CUDA-graph friendly); eagerly it is a plain op.
    """
    _check_mm_args(a, b, a_scale, b_scale)
    _check_addend(a, b, add_a, add_b)
    if a.device.type == "cuda":
        from .triton_int8 import int8_scaled_mm_triton

        return int8_scaled_mm_triton(a, b, a_scale, b_scale, out_dtype, add_a, add_b)
    acc = int8_mm_reference(a, b).float()
    out = acc * a_scale.reshape(-1, 1).float() * b_scale.reshape(1, -1).float()
    if add_a is not None:
        out = out + add_a.float() @ add_b.float().T
    return out.to(out_dtype)
