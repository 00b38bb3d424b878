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
* An export's ``Int4TilePackedTo4dTensor`` (torchao's tile-packed int32 layout for ``aten._weight_int4pack_mm``,
  which has no unpack op) read in plain torch on any device: :func:`unpack_tinygemm_tiles` /
  :func:`pack_tinygemm_tiles`, :func:`from_tinygemm` (to the layout above); :func:`int4_tile_linear` serves it as
  stored.

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


# ---- tinygemm's tile-packed layout, read directly (one copy of the weight: issue 26's serving path) ----

TILE_INNER_K = 8  # torchao's inner_k_tiles for Int4TilePackedTo4dTensor (fixed there): 16-byte words a lane
TILE_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes tinygemm takes


def pack_tinygemm_tiles(q: Tensor, inner_k_tiles: int = TILE_INNER_K) -> Tensor:
    """Codes ``q [N, K]`` (0..15; K a multiple of ``inner_k_tiles · 16``) in tinygemm's tile-packed int32 layout,
    what ``aten._convert_weight_to_int4pack`` makes on CUDA (its CPU op makes another layout), in plain torch on any
    device: ``[ceil(N/8), K/(inner_k_tiles·16), 32, inner_k_tiles/2]``, rows padded with code 0.

    The layout (``matrix_to_m16n8k16_Bint4_layout`` in torch's ``int4mm.cu``, as its ``mma.m16n8k16`` B fragments):
    word ``[t, r·4 + c, w]`` (lane ``r·4 + c``) holds row ``n = 8t + r`` and the 8 columns
    ``k = 128·ko + 32·w + 16a + 8b + 2c + d`` (``a, b, d`` in 0..1) in nibble ``4d + 2a + b``: the even columns in
    its low 16 bits, the odd ones in its high 16 bits. An 8-row × 128-column block is 512 contiguous bytes and an
    8-row tile's whole K is contiguous."""
    N, K = q.shape
    W2 = inner_k_tiles // 2
    if K % (inner_k_tiles * 16):
        raise ValueError(f"pack_tinygemm_tiles: K = {K} is not a multiple of {inner_k_tiles * 16}")
    NT = -(-N // 8)
    qp = torch.zeros((NT * 8, K), dtype=torch.int64, device=q.device)
    qp[:N] = q.to(torch.int64)
    # k = 128·ko + 32·w + 16a + 8b + 2c + d -> [t, r, ko, w, a, b, c, d] -> [t, ko, r, c, w, d, a, b]
    g = qp.reshape(NT, 8, K // (16 * inner_k_tiles), W2, 2, 2, 4, 2).permute(0, 2, 1, 6, 3, 7, 4, 5)
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    words = (g.reshape(*g.shape[:5], 8) << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.reshape(NT, K // (16 * inner_k_tiles), 32, W2).contiguous()


def unpack_tinygemm_tiles(qdata: Tensor) -> Tensor:
    """:func:`pack_tinygemm_tiles`' inverse: the codes ``[N_pad, K_pad]`` uint8 of a tile-packed ``qdata``, in plain
    torch (any device)."""
    NT, KO, lanes, W2 = qdata.shape
    if lanes != 32:
        raise ValueError(f"unpack_tinygemm_tiles: qdata of shape {tuple(qdata.shape)} is not tile-packed")
    shifts = 4 * torch.arange(8, device=qdata.device, dtype=torch.int64)
    nib = (qdata.to(torch.int64).reshape(NT, KO, 8, 4, W2, 1) >> shifts) & 15  # [t, ko, r, c, w, (d, a, b)]
    nib = nib.reshape(NT, KO, 8, 4, W2, 2, 2, 2).permute(0, 2, 1, 4, 6, 7, 3, 5)  # [t, r, ko, w, a, b, c, d]
    return nib.reshape(NT * 8, KO * W2 * 32).to(torch.uint8)


def tinygemm_operands(qdata: Tensor, scale_and_zero: Tensor, shape: tuple[int, int], group_size: int
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """This module's ``(packed, scales, zeros)`` of tinygemm's ``qdata`` / ``scale_and_zero`` (plain torch, exact:
    :func:`unpack_tinygemm_tiles` then :func:`from_tinygemm`)."""
    return from_tinygemm(unpack_tinygemm_tiles(qdata), scale_and_zero, shape, group_size)


def int4_tile_dequantize(qdata: Tensor, scale_and_zero: Tensor, group_size: int, shape: tuple[int, int]) -> Tensor:
    """The bf16 weight ``[N, K]`` (``shape``) of tinygemm's layout, as :func:`int4_dequantize` forms it."""
    return int4_dequantize(*tinygemm_operands(qdata, scale_and_zero, shape, group_size), group_size)


def _check_tile(x: Tensor, qdata: Tensor, scale_and_zero: Tensor, group_size: int, out_features: int,
                decode: str) -> None:
    if qdata.dtype != torch.int32 or qdata.dim() != 4 or qdata.shape[2] != 32 or qdata.shape[3] != TILE_INNER_K // 2:
        raise RuntimeError(f"int4_tile_linear: qdata must be int32 [N/8, K/128, 32, 4] (tinygemm's layout, inner "
                           f"k tiles 8), got {qdata.dtype} {tuple(qdata.shape)}")
    N_pad, K_pad = qdata.shape[0] * 8, qdata.shape[1] * 16 * TILE_INNER_K
    K = x.shape[-1]
    if group_size not in TILE_GROUP_SIZES or K % group_size or K > K_pad or not 0 < out_features <= N_pad:
        raise RuntimeError(f"int4_tile_linear: group_size {group_size} (32..256), in_features {K} (a multiple of "
                           f"it, <= {K_pad}), out_features {out_features} (<= {N_pad}) do not fit qdata")
    if scale_and_zero.dtype != torch.bfloat16 or tuple(scale_and_zero.shape) != (K_pad // group_size, N_pad, 2):
        raise RuntimeError(f"int4_tile_linear: scale_and_zero must be bf16 [{K_pad // group_size}, {N_pad}, 2], got "
                           f"{scale_and_zero.dtype} {tuple(scale_and_zero.shape)}")
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise RuntimeError(f"int4_tile_linear: x must be bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    if decode not in DECODE_KERNELS:
        raise RuntimeError(f"int4_tile_linear: decode {decode!r} is not one of {DECODE_KERNELS}")


# what runs the decode rows (M <= DECODE_MAX_M) of int4_tile_linear on CUDA: tinygemm (aten._weight_int4pack_mm,
# the default: 3-4x faster than our first GEMV on the H200, docs/results/int4_mm_h200.md), our tile GEMV, or
# our factored GEMVs: one row on CUDA cores (more rows: the tile GEMV) or up to 16 on tensor cores (groups of 128
# and more) (triton_int4.int4_tile_decode_triton's ``kernel``: tile, factored, mma)
DECODE_KERNELS = ("tinygemm", "triton", "triton_factored", "triton_mma")
_TILE_KERNEL = {"triton": "tile", "triton_factored": "factored", "triton_mma": "mma"}


@torch.library.triton_op("hf_lowbit::int4_tile_linear", mutates_args=())
def int4_tile_linear(x: Tensor, qdata: Tensor, scale_and_zero: Tensor, group_size: int, out_features: int,
                     decode: str = "tinygemm") -> Tensor:
    """``x @ W.T`` bf16 ``[M, out_features]``, ``W`` in tinygemm's tile-packed layout (``qdata``, ``scale_and_zero``
    of torchao's ``Int4TilePackedTo4dTensor``, used as stored: one copy of the weight).

    CUDA: M ≤ ``DECODE_MAX_M`` rows ``decode="tinygemm"`` runs ``aten._weight_int4pack_mm`` (x zero-padded to the
    layout's K, as torchao's linear does), ``"triton"`` our split-K tile GEMV
    (:func:`hf_lowbit.kernels.triton_int4.int4_tile_decode_triton`), ``"triton_factored"`` at one row its factored
    GEMV (the scale and zero out of the sum, the weight not rounded to bf16: within that rounding of the others),
    ``"triton_mma"`` a GEMV on tensor cores (up to 16 rows); more rows (prefill): the bf16 weight dequantized from
    the tile layout by a Triton kernel, then ``F.linear`` (cuBLAS). Other devices: the plain-torch reference
    (:func:`int4_tile_dequantize`, float32 matmul). Numerics: our kernels form the weight as :func:`int4_dequantize`
    (``bf16((q - 8)·s + z)``, float32 then one rounding to bf16); tinygemm and ``"triton_mma"`` with one bf16 FMA,
    which rounds once from the exact value: the two weights differ only where the float32 sum lands on a bf16 tie
    (rarely; tests/test_triton_int4.py counts it on CUDA), and the float32 sums run in different orders, so the
    outputs agree within a bf16 rounding of the result."""
    _check_tile(x, qdata, scale_and_zero, group_size, out_features, decode)
    N, K = out_features, x.shape[1]
    if x.device.type == "cuda":
        from .triton_int4 import int4_tile_decode_triton, int4_tile_dequant_triton

        qdata, scale_and_zero = qdata.contiguous(), scale_and_zero.contiguous()
        if x.shape[0] <= DECODE_MAX_M:
            if decode == "tinygemm":
                K_pad = qdata.shape[1] * 16 * TILE_INNER_K
                xp = F.pad(x, (0, K_pad - K)) if K_pad != K else x.contiguous()
                y = torch.ops.aten._weight_int4pack_mm(xp, qdata, group_size, scale_and_zero)
                return y if y.shape[1] == N else y[:, :N].contiguous()
            return int4_tile_decode_triton(x, qdata, scale_and_zero, group_size, N, kernel=_TILE_KERNEL[decode])
        return F.linear(x, int4_tile_dequant_triton(qdata, scale_and_zero, group_size, (N, K)))
    return int4_linear_reference(x, *tinygemm_operands(qdata, scale_and_zero, (N, K), group_size), group_size)


@int4_tile_linear.register_fake
def _(x, qdata, scale_and_zero, group_size, out_features, decode="tinygemm"):
    return x.new_empty((x.shape[0], out_features))
