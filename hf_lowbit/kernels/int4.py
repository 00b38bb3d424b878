"""W4A16 with tinygemm's numerics, for serving ``int4_tinygemm`` exports with our own kernels (issue 26).

The layout (``packed``, ``scales``, ``zeros``):

* ``packed [N, K/2]`` uint8: the codes ``q`` (0..15) packed along K, ``q[n, 2j]`` in the low nibble of
  ``packed[n, j]`` and ``q[n, 2j + 1]`` in the high one (:func:`pack_int4` / :func:`unpack_int4`);
* ``scales``, ``zeros`` ``[N, K/group_size]`` bf16, contiguous; the weight is
  ``W[n, k] = bf16((q[n, k] - 8) · scale + zero)`` formed in float32 and rounded once (as tinygemm does,
  :func:`hf_lowbit.kernels.fake_quant.fake_quant_int4_tinygemm`).

* :func:`int4_linear` (``hf_lowbit::int4_linear``, a ``torch.library.triton_op``): ``x [M, K]`` bf16 ->
  ``x @ W.T`` bf16 with float32 accumulation. On CUDA, M ≤ :data:`DECODE_MAX_M`: the split-K decode kernel;
  larger M: the dequantize kernel, then ``F.linear`` (cuBLAS). Every other device: :func:`int4_linear_reference`
  (plain torch: the same bf16 weight, float32 matmul), what the kernels are tested against.
* Repacking an export's ``Int4TilePackedTo4dTensor`` (torchao's tile-packed int32 layout for
  ``aten._weight_int4pack_mm``, which has no unpack op) exactly: :func:`unpack_tinygemm_codes` (CUDA: tinygemm
  itself multiplies the identity by the weight with every scale 1 and zero 8, which gives the codes) and
  :func:`from_tinygemm` (the layout change, plain torch); :func:`repack_tinygemm_weight` is both.

Imports torch; Triton on CUDA only (:mod:`.triton_int4`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# rows up to which the decode (GEMV) kernel runs; above, the weight is dequantized and cuBLAS multiplies
DECODE_MAX_M = 16


def pack_int4(q: Tensor) -> Tensor:
    """Codes ``q [N, K]`` (integers 0..15, K even) -> ``packed [N, K/2]`` uint8, even columns in the low nibbles."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4: codes of shape {tuple(q.shape)} are not 2-D with an even last dim")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """:func:`pack_int4`'s inverse: ``[N, K]`` uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def int4_dequantize(packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """The bf16 weight ``[N, K]``: ``bf16((q - 8)·scale + zero)`` in float32, rounded once (plain torch)."""
    q = unpack_int4(packed).float()
    N, K = q.shape
    g = q.reshape(N, K // group_size, group_size)
    w = (g - 8.0) * scales.float()[:, :, None] + zeros.float()[:, :, None]
    return w.to(torch.bfloat16).reshape(N, K)


def int4_linear_reference(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """``x @ W.T`` in float32 from the bf16 weight of :func:`int4_dequantize`, rounded to bf16 once."""
    w = int4_dequantize(packed, scales, zeros, group_size)
    return (x.float() @ w.float().T).to(torch.bfloat16)


def _check(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> None:
    N, half = packed.shape if packed.dim() == 2 else (None, None)
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise RuntimeError(f"int4_linear: packed must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    K = 2 * half
    # >= 32: the decode kernel's step is at most a group, and its tl.dot (M > 1) needs 16 of each parity of K a step
    if group_size < 32 or group_size & (group_size - 1) or K % group_size:
        raise RuntimeError(f"int4_linear: group_size {group_size} must be a power of 2 >= 32 dividing K = {K}")
    G = K // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.bfloat16 or tuple(t.shape) != (N, G):
            raise RuntimeError(f"int4_linear: {name} must be bf16 [{N}, {G}], got {t.dtype} {tuple(t.shape)}")
    if x.dim() != 2 or x.shape[1] != K or x.dtype != torch.bfloat16:
        raise RuntimeError(f"int4_linear: x must be bf16 [M, {K}], got {x.dtype} {tuple(x.shape)}")


@torch.library.triton_op("hf_lowbit::int4_linear", mutates_args=())
def int4_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """``x @ W.T`` bf16 ``[M, N]`` for ``x [M, K]`` bf16 and the int4 weight in this module's layout.

    A ``triton_op``: under ``torch.compile`` Inductor launches the Triton kernels from its generated code (one
    graph node, CUDA-graph friendly); eagerly a plain op. CUDA: M ≤ ``DECODE_MAX_M`` the split-K decode kernel,
    else the dequantize kernel and ``F.linear``; other devices: :func:`int4_linear_reference`."""
    _check(x, packed, scales, zeros, group_size)
    if x.device.type == "cuda":
        from .triton_int4 import int4_decode_triton, int4_dequant_triton

        packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()
        if x.stride(1) != 1:
            x = x.contiguous()
        if x.shape[0] <= DECODE_MAX_M:
            return int4_decode_triton(x, packed, scales, zeros, group_size)
        return F.linear(x, int4_dequant_triton(packed, scales, zeros, group_size))
    return int4_linear_reference(x, packed, scales, zeros, group_size)


@int4_linear.register_fake
def _(x, packed, scales, zeros, group_size):
    return x.new_empty((x.shape[0], packed.shape[0]))


# ---- from torchao's Int4TilePackedTo4dTensor (an int4_tinygemm export) ----

def from_tinygemm(codes: Tensor, scale_and_zero: Tensor, shape: tuple[int, int], group_size: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """This module's ``(packed, scales, zeros)`` from tinygemm's unpacked codes and its ``scale_and_zero``.

    ``codes [N_pad, K_pad]`` (0..15, the padded weight's: torchao pads N to a multiple of 8, K of 1024);
    ``scale_and_zero [K_pad/group_size, N_pad, 2]`` bf16 (torchao's ``pack_tinygemm_scales_and_zeros``: ``[..., 0]``
    the scale, ``[..., 1]`` the zero); ``shape`` the unpadded ``(N, K)``, K a multiple of ``group_size``. Exact:
    the padding is dropped and the rest reordered, nothing recomputed."""
    N, K = shape
    if K % group_size:
        raise ValueError(f"from_tinygemm: in_features {K} is not a multiple of group_size {group_size}")
    if scale_and_zero.dim() != 3 or scale_and_zero.shape[-1] != 2 or scale_and_zero.shape[1] < N \
            or scale_and_zero.shape[0] * group_size < K or codes.shape[0] < N or codes.shape[1] < K:
        raise ValueError(f"from_tinygemm: codes {tuple(codes.shape)} / scale_and_zero {tuple(scale_and_zero.shape)} "
                         f"do not cover shape {shape} with group_size {group_size}")
    G = K // group_size
    sz = scale_and_zero[:G, :N].transpose(0, 1)  # [N, G, 2]
    scales = sz[..., 0].to(torch.bfloat16).contiguous()
    zeros = sz[..., 1].to(torch.bfloat16).contiguous()
    return pack_int4(codes[:N, :K]), scales, zeros


def unpack_tinygemm_codes(qdata: Tensor, scale_and_zero: Tensor, group_size: int, chunk: int = 4096) -> Tensor:
    """The codes ``[N_pad, K_pad]`` (uint8, 0..15) of tinygemm's tile-packed int32 ``qdata`` (CUDA only).

    torch has no unpack op for ``_convert_weight_to_int4pack``'s layout, so tinygemm itself unpacks it: with every
    scale 1 and every zero 8 its weight is ``(q - 8)·1 + 8 = q`` (its bf16 FMA on integers ≤ 15: exact), and
    ``_weight_int4pack_mm(I, qdata, group_size, that)`` (``I`` rows of the bf16 identity) is ``I @ Wᵀ``, i.e. rows
    of ``Wᵀ = qᵀ``; each sum has one nonzero term, so it is exact in tinygemm's float32 accumulation. Done
    ``chunk`` rows of the identity at a time (memory: ``chunk × K_pad`` and ``chunk × N_pad`` bf16)."""
    G, N_pad, _ = scale_and_zero.shape
    K_pad = G * group_size
    ones = torch.empty_like(scale_and_zero)
    ones[..., 0] = 1.0
    ones[..., 1] = 8.0
    out = torch.empty((N_pad, K_pad), dtype=torch.uint8, device=qdata.device)
    for k0 in range(0, K_pad, chunk):
        k1 = min(k0 + chunk, K_pad)
        eye = torch.zeros((k1 - k0, K_pad), dtype=torch.bfloat16, device=qdata.device)
        eye[:, k0:k1] = torch.eye(k1 - k0, dtype=torch.bfloat16, device=qdata.device)
        wt = torch.ops.aten._weight_int4pack_mm(eye, qdata, group_size, ones)  # [k1 - k0, N_pad] = q[:, k0:k1].T
        out[:, k0:k1] = wt.T.to(torch.uint8)
    return out


def repack_tinygemm_weight(weight) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(packed, scales, zeros, group_size)`` of a loaded ``Int4TilePackedTo4dTensor`` (on CUDA), exactly."""
    group_size = int(weight.block_size[-1])
    if getattr(weight, "act_pre_scale", None) is not None:
        raise ValueError("repack_tinygemm_weight: weights with an act_pre_scale are not supported")
    if weight.qdata.dim() != 4:
        raise ValueError(f"repack_tinygemm_weight: qdata of {weight.qdata.dim()} dims (a 2-D weight's is 4-D)")
    codes = unpack_tinygemm_codes(weight.qdata, weight.scale_and_zero, group_size)
    N, K = weight.shape
    return (*from_tinygemm(codes, weight.scale_and_zero, (N, K), group_size), group_size)
