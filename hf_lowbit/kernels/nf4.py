"""NF4 (QLoRA 4-bit NormalFloat) quantization in plain PyTorch, chunked so memory stays lean.

The format is the standard one (QLoRA paper; torchao ``to_nf4``): the weight is flattened row-major
and cut into blocks of 64 elements; each block keeps its absmax and every element stores the index
of the nearest of 16 NF4 levels to ``x / absmax``, two indices per byte (first element in the high
nibble). The block absmaxes are double-quantized: their mean is subtracted and groups of 256 are
stored as int8 with one factor per group. Codes, scales and dequantized values agree bit for bit
with torchao's ``to_nf4`` (tests/test_qlora.py), with one documented difference: an all-zero block
gets code 7 (exactly 0) where torchao divides 0/0 and stores whichever index ``min`` returns for NaN.
The last group may hold fewer than 256 blocks here (torchao asserts ``n_blocks % 256 == 0``).

INT8 compute reads the codes directly (:func:`nf4_to_int8`): each becomes ``round(level · absmax_block / row_scale)``
with the row's INT8 scale taken from its block absmaxes (a row's largest magnitude is its largest block absmax:
each block holds a ±1 code at its absmax), one pass over the 4-bit codes into either layout of the INT8 operand.

Memory: torchao materializes ``x / absmax``, a uint8 code per element and two shifted halves (about
3x the input at peak). Here the nearest-level search is one ``bucketize`` over 15 precomputed
thresholds (:func:`nf4_thresholds`, exact for the input dtype), ``chunk_numel`` elements at a time,
writing packed bytes straight into the output: the peak is the input + the 0.25x packed output +
the 1/128x scales + one chunk's temporaries (about 8 bytes an element).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
DEFAULT_CHUNK_NUMEL = 1 << 20

# The 16 NF4 levels, as torchao and bitsandbytes list them (rounded to 4 decimals like torchao).
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
              0.3379, 0.4407, 0.5626, 0.7230, 1.0)


class Nf4Data(NamedTuple):
    """The stored form of an NF4 weight of shape ``[rows, cols]`` (plain tensors: safetensors and
    FSDP2 shard them like any other).

    ``codes`` uint8 ``[rows, cols // 2]``; ``scales`` int8 ``[rows, cols // 64]`` (double-quantized
    block absmaxes); ``scale_factor`` ``[ceil(n_blocks / 256)]`` and ``scale_mean`` ``[1]`` in the
    weight's dtype.
    """

    codes: Tensor
    scales: Tensor
    scale_factor: Tensor
    scale_mean: Tensor


def check_nf4_shape(shape, block_size: int = BLOCK_SIZE) -> str | None:
    """Why a weight of ``shape`` cannot be stored as NF4 (None if it can)."""
    if len(shape) != 2:
        return f"NF4 needs a 2-D weight, got shape {tuple(shape)}"
    if shape[1] % block_size:
        return f"in_features = {shape[1]} is not a multiple of the NF4 block size {block_size}"
    return None


def nf4_levels(dtype: torch.dtype, device) -> Tensor:
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def _nearest_reference(values: Tensor, levels: Tensor) -> Tensor:
    """torchao's rule: index of the first minimum of ``|value - level|`` computed in the levels' dtype."""
    return (values[..., None] - levels).abs().min(dim=-1).indices


_THRESHOLDS: dict[torch.dtype, Tensor] = {}


def nf4_thresholds(dtype: torch.dtype) -> Tensor:
    """The 15 smallest ``dtype`` values that round to codes 1 … 15 under :func:`_nearest_reference`.

    Between two neighbouring levels, ``|v - lo|`` rounded in ``dtype`` grows and ``|v - hi|`` shrinks
    with ``v``, so "nearer to hi" switches once: bisecting over representable values finds the switch.
    Then ``code = bucketize(v, thresholds, right=True)`` is torchao's code, bit for bit, in one pass
    with no 16-wide intermediate. Computed once per dtype (a few hundred scalar steps on the CPU).
    """
    if dtype not in _THRESHOLDS:
        levels = nf4_levels(dtype, "cpu")
        out = []
        for i in range(15):
            a, b = levels[i:i + 1].clone(), levels[i + 1:i + 2].clone()  # code(a) <= i < i + 1 <= code(b)
            while True:
                step = torch.nextafter(a, b)
                if torch.equal(step, b):
                    break
                mid = ((a.double() + b.double()) / 2).to(dtype)
                if torch.equal(mid, a) or torch.equal(mid, b):
                    mid = step
                if _nearest_reference(mid, levels).item() > i:
                    b = mid
                else:
                    a = mid
            out.append(b)
        _THRESHOLDS[dtype] = torch.cat(out)
    return _THRESHOLDS[dtype]


@torch.no_grad()
def quantize_nf4(weight: Tensor, block_size: int = BLOCK_SIZE, scaler_block_size: int = SCALER_BLOCK_SIZE,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> Nf4Data:
    """Quantize a 2-D floating ``weight`` (``cols`` a multiple of ``block_size``) to NF4."""
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(f"quantize_nf4: weight must be a floating-point tensor, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    why = check_nf4_shape(weight.shape, block_size)
    if why:
        raise ValueError(f"quantize_nf4: {why}")
    if block_size % 2 or chunk_numel < block_size:
        raise ValueError(f"quantize_nf4: block_size must be even and chunk_numel >= block_size, got "
                         f"{block_size} and {chunk_numel}")
    rows, cols = weight.shape
    w = weight.detach().contiguous()
    dtype, device = w.dtype, w.device
    rows_per_chunk = max(1, chunk_numel // cols)

    # pass 1: block absmax (input dtype, like torchao), then double quantization of those scales
    absmax = torch.empty(rows, cols // block_size, dtype=dtype, device=device)
    for r0 in range(0, rows, rows_per_chunk):
        chunk = w[r0:r0 + rows_per_chunk]
        absmax[r0:r0 + rows_per_chunk] = chunk.view(-1, cols // block_size, block_size).abs().amax(-1)
    flat = absmax.view(-1)
    n_blocks = flat.numel()
    mean = flat.mean()
    n_groups = -(-n_blocks // scaler_block_size)
    centered = torch.zeros(n_groups * scaler_block_size, dtype=dtype, device=device)
    centered[:n_blocks] = flat - mean  # zero padding leaves each group's absmax unchanged
    centered = centered.view(n_groups, scaler_block_size)
    factor = 256 / (2 * centered.abs().amax(-1))
    scales = (centered * factor[:, None]).round().clamp(-128, 127).to(torch.int8)
    scales = scales.view(-1)[:n_blocks].view(rows, cols // block_size).clone()
    del centered, flat

    # pass 2: nearest NF4 level of x / absmax, packed two per byte, one chunk of rows at a time
    thresholds = nf4_thresholds(dtype).to(device)
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    for r0 in range(0, rows, rows_per_chunk):
        blocks = w[r0:r0 + rows_per_chunk].view(-1, cols // block_size, block_size)
        amax = absmax[r0:r0 + rows_per_chunk, :, None]
        scaled = blocks / torch.where(amax == 0, torch.ones_like(amax), amax)  # zero block -> code 7 (0.0)
        idx = torch.bucketize(scaled, thresholds, out_int32=True, right=True).view(blocks.shape[0], cols // 2, 2)
        codes[r0:r0 + rows_per_chunk] = (idx[..., 0] << 4) | idx[..., 1]  # int32 -> uint8 on assignment
        del blocks, scaled, idx
    return Nf4Data(codes, scales, factor.contiguous(), mean.reshape(1))


def dequantize_nf4_scales(data: Nf4Data, scaler_block_size: int = SCALER_BLOCK_SIZE) -> Tensor:
    """The per-block absmaxes ``[rows, cols // 64]`` in the weight's dtype (torchao's arithmetic)."""
    scales = data.scales
    n_blocks = scales.numel()
    group = torch.arange(n_blocks, device=scales.device) // scaler_block_size
    flat = scales.reshape(-1) / data.scale_factor[group]
    return (flat.to(data.scale_mean.dtype) + data.scale_mean).view(scales.shape)


_LUTS: dict[tuple[torch.dtype, str], Tensor] = {}
# the levels rounded to each weight dtype, as Python floats (exact in float32): made here, at import, so that
# nothing is computed from tensors while torch.compile traces nf4_lut
_LUT_VALUES = {dt: [float(v) for v in torch.tensor(NF4_LEVELS, dtype=dt).float()]
               for dt in (torch.bfloat16, torch.float16, torch.float32)}


def nf4_lut(dtype: torch.dtype, device) -> Tensor:
    """The 16 levels rounded to the weight's ``dtype`` (what :func:`dequantize_nf4` multiplies), as float32 on
    ``device``: the table the NF4 → INT8 kernel gathers from.

    Eagerly a tensor made once per (dtype, device); while ``torch.compile`` traces, the same values built on the
    device from Python constants (one tiny fused kernel, no host copy inside the graph, CUDA-graph safe)."""
    if dtype not in _LUT_VALUES:  # another floating dtype: made once, eagerly
        _LUT_VALUES[dtype] = [float(v) for v in nf4_levels(dtype, "cpu").float()]
    values = _LUT_VALUES[dtype]
    if torch.compiler.is_compiling():
        index = torch.arange(16, device=device)
        lut = torch.full((16,), values[15], dtype=torch.float32, device=device)
        for i in range(15):
            lut = torch.where(index == i, values[i], lut)
        return lut
    key = (dtype, str(device))
    if key not in _LUTS:
        _LUTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _LUTS[key]


def nf4_int8_multipliers(data: Nf4Data) -> tuple[Tensor, Tensor]:
    """``(mul [rows, cols // 64], scale [rows])``, float32: the INT8 row scales of the weight ``data`` stores and,
    per 64-element block, the block absmax over its row's scale, so that ``code · scale ≈ level · absmax``.

    Reads only the double-quantized block scales (1/64 of the weight): a row's largest magnitude is its largest
    block absmax (the quantizer stores ±1 at each block's absmax; for other codes the scale is merely no tighter,
    never clipping). Plain torch: Inductor fuses it into one small kernel."""
    absmax = dequantize_nf4_scales(data).float()
    scale = absmax.abs().amax(1).clamp(min=1e-30) / 127.0  # clamp keeps NaN, as quantize_int8
    return absmax / scale[:, None], scale


def nf4_to_int8_reference(codes: Tensor, mul: Tensor, lut: Tensor, transposed: bool = False) -> Tensor:
    """Plain-torch ``clamp(round(lut[code] · mul[block]), ±127)`` as int8 ``[rows, cols]`` (``[cols, rows]``
    contiguous if ``transposed``): what the Triton kernel computes, bit for bit (IEEE float32 products)."""
    rows = codes.shape[0]
    mul = mul.repeat_interleave(BLOCK_SIZE, dim=1)
    if transposed:  # unpacked from the transposed bytes: a compiled graph then shares no intermediate with the
        # forward's unpacking (on CPU, where these ops are visible, it kept one alive until the backward)
        c = codes.T
        idx, mul = torch.stack([c >> 4, c & 15], dim=1).view(-1, rows), mul.T
    else:
        idx = torch.stack([codes >> 4, codes & 15], dim=-1).view(rows, -1)
    return (lut[idx.long()] * mul).round().clamp(-127, 127).to(torch.int8).contiguous()


@torch.library.triton_op("hf_lowbit::nf4_to_int8", mutates_args=())
def nf4_to_int8_op(codes: Tensor, mul: Tensor, lut: Tensor, transposed: bool) -> Tensor:
    """The INT8 operand of NF4 ``codes`` (see :func:`nf4_to_int8`): Triton on CUDA, the reference elsewhere."""
    if codes.device.type == "cuda":
        from .triton_nf4 import nf4_to_int8_triton

        return nf4_to_int8_triton(codes, mul, lut, transposed)
    return nf4_to_int8_reference(codes, mul, lut, transposed)


def nf4_to_int8(data: Nf4Data, transposed: bool = False, multipliers: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor]:
    """The weight ``data`` stores as the INT8 matmul operand, per output row: ``(q, scale)`` with
    ``W ≈ diag(scale) · q`` — ``q`` int8 ``[rows, cols]``, or ``[cols, rows]`` contiguous with ``transposed`` (the
    input gradient's operand) — in one pass over the 4-bit codes (no bf16 weight, no absmax pass over it).
    ``multipliers``: :func:`nf4_int8_multipliers`'s result when the caller already has it."""
    mul, scale = multipliers if multipliers is not None else nf4_int8_multipliers(data)
    lut = nf4_lut(data.scale_mean.dtype, data.codes.device)
    return nf4_to_int8_op(data.codes, mul.contiguous(), lut, transposed), scale


def dequantize_nf4(data: Nf4Data, dtype: torch.dtype | None = None,
                   scaler_block_size: int = SCALER_BLOCK_SIZE) -> Tensor:
    """The ``[rows, cols]`` weight that ``data`` stores, in its dtype (then cast to ``dtype``).

    Plain tensor ops (index, shift, multiply): under ``torch.compile`` they fuse into one kernel.
    """
    rows, half = data.codes.shape
    n_col_blocks = data.scales.shape[1]
    wdtype = data.scale_mean.dtype
    levels = nf4_levels(wdtype, data.codes.device)
    hi = levels[(data.codes >> 4).long()]
    lo = levels[(data.codes & 15).long()]
    values = torch.stack([hi, lo], dim=-1).view(rows, n_col_blocks, -1)
    absmax = dequantize_nf4_scales(data, scaler_block_size)
    w = (values * absmax[..., None]).view(rows, 2 * half)
    return w if dtype is None else w.to(dtype)
