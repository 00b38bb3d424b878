"""``hf_lowbit::quantize_t``: quantize per column (along dim 0) and write the result transposed.

The operands a matmul reduces over their dim 0 (both weight-gradient operands) need one scale per column
and the reduction dim contiguous; on a transposed view the same op quantizes per row (the weight cache's
refresh, the input gradient's stochastically rounded ``dY·diag(s)``). CUDA runs the
Triton kernels in :mod:`hf_lowbit.kernels.triton_quant`; other devices the plain-torch quantize
functions followed by a transposed copy (the reference the kernels are tested against).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import FORMATS

# Which of :func:`hf_lowbit.kernels.triton_quant.quantize_t_triton`'s two-pass variants quantizes activations and
# output gradients per column on CUDA, per format (all give the same bits; ``VARIANTS`` there lists them). Measured
# on the H200 at 5600f0c (docs/results/regimes_h200.json, blocks layers_b8_atomic, layers_b1_atomic, trainer_b1_ga8;
# quant_sweep_h200_t2048.json): ``atomic_rcp`` (absmax by atomic max on |x|'s bits, one correctly rounded reciprocal
# a column instead of a division an element) is 1.21x the two-kernel pair over a Llama-8B layer's INT8 activation
# quantizations and 1.28x over FP8's, and whole INT8 steps went 1.28x -> 1.30x bf16 (8x2048 layers), 1.03x -> 1.04x
# (1x2048 layers), 1.15x -> 1.18x (Trainer, 1x2048, accumulation 8) with the same losses; FP8 1.26x -> 1.28x, 1.04x
# -> 1.06x and (47a45b8) 1.14x -> 1.17x. FP8 waited on the two kernels because its Trainer runs ended at a loss of
# 10.33 with either variant: the cause was the weight cache's transposed FP8 codes (fixed, de9803d), not atomic_rcp,
# whose codes equal the two kernels' bit for bit at a Llama layer's shapes on the H200
# (test_quantize_t_llama_shapes_cuda, de9803d). Since session 17 FP8 takes it too; at 1x2048 GA 8 its two kernels were
# 41.4 ms of a 343 ms step against INT8's 26.8 on atomic_rcp (session 17's profile, 2dda4b0). ``atomic_rcp`` rounds to
# nearest only: stochastic rounding then takes ``atomic``. benchmarks/driver.py's ``{fmt}_{variant}`` recipes set one
# for a process, to compare them in one run.
ACTIVATION_VARIANT = {"int8": "atomic_rcp", "fp8": "atomic_rcp"}
# How those variants turn FP8 quotients into codes on CUDA (``quantize_t_triton``'s ``fp8_cast``; the same bits): None,
# its default, the hardware cast; "soft" the float32 rounding first (28.4 SASS instructions an element against 19.4;
# before 2026-12-03 the only way; on the H200 at 8x2048 the cast took 3.5 ms a step off the kernel, +0.01 on the step,
# 4a4f0d0). benchmarks/driver.py's ``fp8_softcast`` recipe sets "soft" for a process.
FP8_CAST = None


def _triton_kwargs(fmt: str, stochastic: bool) -> dict:
    """``quantize_t_triton``'s kernel choice for ``fmt``: the activation variant and, for FP8 on the variants that
    take a cast, :data:`FP8_CAST` where one is set (called where the CUDA path imports the kernels anyway)."""
    from .triton_quant import FP8_CAST_VARIANTS

    variant = _activation_variant(fmt, stochastic)
    cast = FP8_CAST if fmt == "fp8" and variant in FP8_CAST_VARIANTS else None
    return {"variant": variant, **({"fp8_cast": cast} if cast else {})}


def _activation_variant(fmt: str, stochastic: bool) -> str:
    variant = ACTIVATION_VARIANT[fmt]
    return "atomic" if stochastic and variant == "atomic_rcp" else variant


def _check(x: Tensor, fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantize_t: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if x.dim() != 2:
        raise ValueError(f"quantize_t: x must be 2-D, got shape {tuple(x.shape)}")


@torch.library.triton_op("hf_lowbit::quantize_t", mutates_args=())
def quantize_t(x: Tensor, fmt: str, stochastic: bool = False, row_mul: Tensor | None = None,
               col_amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``x`` [M, N] -> (``q`` [N, M] contiguous, ``scale`` [N] float32) with ``x.T ≈ q * scale[:, None]``.

    A ``triton_op`` (Inductor launches the two Triton kernels from its generated code); the plain-torch
    path off CUDA is the reference the kernels are tested against, bit for bit. ``stochastic`` (int8):
    stochastic rounding, the random numbers drawn inside the Triton kernel (Philox, seeded from the torch
    generator of ``x``'s device); an argument of this op rather than an op of its own because everything
    but the rounding line is shared, and so is the scale (bit for bit). ``row_mul`` [M] (float32): quantize
    ``x * row_mul[:, None]`` instead, the product formed in registers (the input gradient's ``dY·diag(s)``). A
    tensorwise format takes the plain-torch path on CUDA too (the kernels compute one scale per column);
    :func:`hf_lowbit.kernels.quantize_operand` does not call this op for one. ``col_amax`` [N] (int32 float bits):
    each column's absmax of ``x`` already known (the pass that wrote ``x`` took it:
    :func:`hf_lowbit.kernels.swiglu.swiglu_backward_quant`), so that on CUDA the encode pass alone reads ``x``
    (nearest rounding with the atomic variants; otherwise, and off CUDA, computed here: the same bits)."""
    _check(x, fmt)
    f = FORMATS[fmt]
    if stochastic and fmt != "int8":
        raise ValueError(f"quantize_t: stochastic rounding is implemented for int8, not {fmt!r}")
    if x.device.type == "cuda" and not f.tensorwise:  # the kernels compute one scale per column
        from .triton_quant import quantize_t_triton

        from .triton_quant import FP8_CAST_VARIANTS

        kw = _triton_kwargs(fmt, stochastic)
        if col_amax is not None and row_mul is None and kw["variant"] in FP8_CAST_VARIANTS:
            kw["col_amax"] = col_amax
        return quantize_t_triton(x, f.dtype, f.qmax, stochastic=stochastic, row_mul=row_mul, **kw)
    if row_mul is not None:
        x = x.float() * row_mul.reshape(-1, 1)
    q, scale = f.quantize(x, dim=0, stochastic=True) if stochastic else f.quantize(x, dim=0)
    return q.T.contiguous(), scale.reshape(-1).contiguous()  # (a tensorwise scale is an expanded view)


@torch.library.custom_op("hf_lowbit::quantize_t_shared", mutates_args=())
def quantize_t_shared(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """:func:`quantize_t` (nearest rounding), the same bits, as an opaque op: for an operand that sibling layers
    quantize identically, a decoder layer's normed input X, which q/k/v (and gate/up) each quantize per column for
    their weight gradients. Under ``torch.compile`` the joint graph's CSE merges identical calls of an opaque op
    into one, but never merges ``quantize_t``'s traced Triton launches (their outputs come from ``aten.empty``,
    which CSE skips): with this op X is quantized once per sibling group, and its one set of codes is what the
    partitioner may keep. The kernels launch directly (``wrap_triton``'s eager dispatch costs ~1 ms a launch)."""
    _check(x, fmt)
    if x.device.type == "cuda" and not FORMATS[fmt].tensorwise:
        from torch._library.triton import set_wrap_triton_enabled

        from .triton_quant import quantize_t_triton

        f = FORMATS[fmt]
        with set_wrap_triton_enabled(False):
            return quantize_t_triton(x, f.dtype, f.qmax, **_triton_kwargs(fmt, False))
    return quantize_t(x, fmt)


@quantize_t_shared.register_fake
def _(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    _check(x, fmt)
    return (x.new_empty((x.shape[1], x.shape[0]), dtype=FORMATS[fmt].dtype),
            x.new_empty((x.shape[1],), dtype=torch.float32))


# Rows of X from which siblings share X's column codes (:func:`shares_codes`). Measured on the H200 at d88ae55
# (docs/results/regimes_h200.json, blocks layers_b8_shared / layers_b1_shared, 8 Llama-8B-shaped layers, compiled):
# at 16384 rows sharing is faster and lighter (INT8 1.28x bf16 against 1.26x, FP8 1.26x against 1.24x; peak memory
# 0.92x against 0.95x); at 2048 rows it is slower (INT8 1.00x against 1.03x, FP8 0.99x against 1.02x, memory equal):
# the op's ~4 Python-dispatched calls a layer cost host time that a host-bound step pays and the bytes it saves
# (a few MB a call) do not repay. 8192 lies between the two measured sizes, unmeasured itself.
SHARE_MIN_ROWS = 8192


def shares_codes(x: Tensor) -> bool:
    """Whether a shared operand ``x`` [rows, features] goes through :func:`quantize_t_shared`: on CUDA from
    :data:`SHARE_MIN_ROWS` rows (large micro-batches, where the step is GPU-bound and the saved bytes count);
    otherwise :func:`quantize_t`, per linear (on other devices the plain-torch path, which Inductor fuses,
    recomputes and CSEs by itself)."""
    return x.device.type == "cuda" and x.shape[0] >= SHARE_MIN_ROWS
