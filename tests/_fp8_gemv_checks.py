"""Checks of the FP8 decode GEMV (:mod:`hf_lowbit.kernels.triton_fp8_gemv`) against torchao's quantization and the
float32 reference, for the device they run on: interpreted on a CPU (``_triton_checks.py``'s ``fp8_gemv`` mode,
TRITON_INTERPRET=1), compiled on CUDA (the tests call these functions directly)."""

import torch
from _triton_checks import PoisonedAllocations, _poison_works
from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

from hf_lowbit.kernels.fp8_gemv import fp8_rowwise_linear_reference, quantize_fp8_rows
from hf_lowbit.kernels.triton_fp8_gemv import DESIGNS, act_quant_triton, fp8_gemv_triton

FP8 = torch.float8_e4m3fn
U32 = 2.0 ** -24  # float32's unit roundoff


def torchao_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao 0.18's own row-wise activation quantization (what ``Float8Tensor.from_hp`` runs off sm_90+mslk):
    ``(codes [M, K], scale [M])``."""
    scale = _choose_scale_float8(x, block_size=[1, x.shape[1]], float8_dtype=FP8)
    return _quantize_affine_float8(x, scale, FP8), scale.reshape(-1)


def _activations(M: int, K: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows of mixed magnitudes: an outlier row (its small entries flush to subnormal codes or 0), a tiny row,
    an all-zero row (when M > 2), the rest Gaussian at random scales."""
    x = torch.randn(M, K, device=device) * torch.rand(M, 1, device=device) * 4
    if M > 1:
        x[1, : K // 3] *= 1e3 if dtype != torch.float16 else 30
    if M > 2:
        x[2] = 0
    if M > 3:
        x[3] *= 1e-3
    return x.to(dtype)


def _codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def torch_cuda_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch computes for torchao's quantization on a CUDA device, emulated on any device: the scale's
    division by the Python scalar 448 is ``amax * fl32(1/448)`` (ATen's ``div_true_kernel_cuda`` multiplies by a
    CPU scalar's reciprocal, Inductor's ``div_prim`` does so off the CPU), rounded to x's dtype; the codes'
    division by the scale tensor is an IEEE one in both (eagerly; compiled: see the module docstring of
    hf_lowbit.kernels.triton_fp8_gemv)."""
    amax = x.abs().amax(-1).float()
    scale = (amax * torch.tensor(1 / 448, dtype=torch.float32, device=x.device)).to(x.dtype).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (x.float() / scale[:, None]).clamp(-448, 448).to(FP8)
    return q, scale


def check_fp8_act_quant(device: str) -> int:
    """The kernels' activation quantization (scales and codes written by ``act_quant_triton``: the row kernel of
    the ``codes`` design and the looped one of the ``fused`` design, the jit functions the GEMVs quantize with)
    bit for bit against torchao's primitives and :func:`quantize_fp8_rows` run on the same device, every input
    dtype, both roundings on CUDA (the hardware cast and the soft one the interpreter runs); the scale's other
    formula (``recip``: CUDA's on the CPU, the CPU's on CUDA) against its emulation; an all-zero row: ours scale
    1 and codes 0, torchao's NaN. Returns the number of checks."""
    n = 0
    softs = (None, True) if device == "cuda" else (None,)
    on_cuda = device == "cuda"
    for M, K in ((5, 100), (16, 64), (1, 300)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = _activations(M, K, dtype, device)
            ref_q, ref_s = quantize_fp8_rows(x)
            ao_q, ao_s = torchao_codes(x)
            live = ao_s != 0  # rows torchao quantizes (its all-zero rows are 0/0 = NaN)
            assert torch.equal(ref_s[live], ao_s[live]) and _codes_equal(ref_q[live], ao_q[live]), (M, K, dtype)
            if M > 2:
                assert not live[2] and torch.isnan(ao_q[2].float()).all() and ref_s[2] == 1 and (ref_q[2] == 0).all()
            if on_cuda:  # torch's own CUDA division is the emulated one
                emu_q, emu_s = torch_cuda_codes(x)
                assert torch.equal(emu_s, ref_s) and _codes_equal(emu_q, ref_q), (M, K, dtype)
            for recip in (None, not on_cuda):
                if recip is None:
                    want_q, want_s = ref_q, ref_s
                elif recip:  # CUDA's formula, emulated
                    want_q, want_s = torch_cuda_codes(x)
                else:  # the CPU's: the IEEE quotient (float64 -> float32 is exact here: 448 = 7 * 64)
                    s64 = (x.abs().amax(-1).double() / 448).float().to(dtype).float()
                    want_s = torch.where(s64 == 0, torch.ones_like(s64), s64)
                    want_q = (x.float() / want_s[:, None]).clamp(-448, 448).to(FP8)
                for soft in softs:
                    for rows in (True, False):
                        with PoisonedAllocations() as poison:  # codes start as NaN, scales as NaN
                            q, s = act_quant_triton(x, soft=soft, recip=recip, rows=rows)
                        assert ((M, K), FP8) in poison.shapes and ((M,), torch.float32) in poison.shapes
                        case = f"{(M, K)} {dtype} soft={soft} recip={recip} rows={rows}"
                        assert torch.equal(s, want_s), f"{case}: scales differ"
                        bad = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
                        assert bad == 0, f"{case}: {bad} codes differ from torchao's"
                        n += 1
    return n


def gemv_cases(device: str) -> list[tuple]:
    """``(M, N, K, bias, split_k, pre_scale, x_transposed, design, use_dot)``: M in (1, 3, 16); K of several
    tiles and not a multiple of one; N not a multiple of the tile; split K (a given count and the heuristic's) and
    not; both designs: ``fused`` with the activation's absmax in the GEMV's programs and from the scale kernel,
    ``codes`` with its row sums (M = 1) and its dot (every M)."""
    cases = [(M, N, K, bias, split, pre, False, "fused", None)
             for M in (1, 3, 16) for N, K in ((37, 100), (16, 160))
             for bias in (False, True) for split, pre in ((None, None), (1, False), (3, True))]
    cases += [(3, 37, 100, True, 2, False, True, "fused", None)]  # x a transposed view
    cases += [(M, N, K, bias, split, None, False, "codes", dot)
              for M, dot in ((1, None), (1, True), (3, None), (16, None)) for N, K in ((37, 100), (16, 160))
              for bias in (False, True) for split in (None, 1, 3)]
    cases += [(1, 37, 100, True, 2, None, True, "codes", None), (3, 37, 100, True, 2, None, True, "codes", None)]
    if device == "cuda":  # Llama-8B layer shapes (the H200 tiles and the split-K heuristic)
        for design in ("fused", "codes"):
            cases += [(M, N, K, False, None, None, False, design, None) for M in (1, 8, 16)
                      for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))]
            cases += [(1, 128256, 4096, False, None, None, False, design, None),
                      (5, 1000, 4096, True, None, None, False, design, None)]
    return cases


def check_fp8_gemv(device: str, soft: bool | None = None, part: tuple[int, int] = (0, 1)) -> int:
    """The GEMV against the exact product of torchao's codes and the scales (float64): with x float32 within
    float32 accumulation (``K · 2^-24`` of the products' magnitudes), with x bf16 also within one rounding to
    bf16; and against the float32 reference (:func:`fp8_rowwise_linear_reference`) within one bf16 step. Its
    output allocated as poison (all of it written); an all-zero activation row gives the bias exactly. ``part``
    ``(i, n)``: every ``n``-th case from the ``i``-th (the CUDA test splits them over pytest-xdist workers: each
    case compiles its own kernels, 268 s in one test on the H200 in session 18). Returns the number of checks."""
    _poison_works(device)
    n = 0
    i, parts = part
    for M, N, K, has_bias, split, pre, x_t, design, dot in gemv_cases(device)[i::parts]:
        w = (torch.randn(N, K, device=device) * 2).to(FP8)
        w[0] = 0  # an all-zero weight row
        w_scale = torch.rand(N, device=device) / 100 + 1e-4
        bias = torch.randn(N, device=device) if has_bias else None
        for dtype in (torch.float32, torch.bfloat16):
            x = _activations(M, K, dtype, device)
            if x_t:
                x = x.T.contiguous().T
            b = bias.to(dtype) if has_bias else None
            with PoisonedAllocations() as poison:
                out = fp8_gemv_triton(x, w, w_scale, b, split_k=split, pre_scale=pre, soft=soft, design=design,
                                      use_dot=dot)
            assert ((M, N), dtype) in poison.shapes and out.shape == (M, N) and out.dtype == dtype
            assert torch.isfinite(out).all(), f"unwritten or non-finite output at {(M, N, K)}"
            q, sx = quantize_fp8_rows(x)
            prod = q.double() @ w.double().T
            exact = prod * sx.double()[:, None] * w_scale.double()[None, :]
            mag = (q.double().abs() @ w.double().abs().T) * sx.double()[:, None] * w_scale.double()[None, :]
            if has_bias:
                exact = exact + b.double()
            tol = (K + 8) * U32 * mag + 4 * U32 * exact.abs()  # + the splits, scales, bias, output rounding
            if dtype == torch.bfloat16:
                tol = tol + 2.0 ** -8 * exact.abs()
            err = (out.double() - exact).abs()
            case = (M, N, K, has_bias, split, pre, x_t, design, dot, dtype)
            assert (err <= tol).all(), f"{case}: error {(err - tol).max().item():.3g} over the bound"
            if M > 2:  # the all-zero row: the bias (or 0), exactly
                assert torch.equal(out[2], b if has_bias else torch.zeros_like(out[2])), case
            ref = fp8_rowwise_linear_reference(x, w, w_scale, b)
            step = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
            assert ((out.double() - ref.double()).abs() <= step * ref.double().abs() + tol).all(), case
            n += 1
    return n


def check_fp8_gemv_vs_scaled_mm(device: str = "cuda") -> int:
    """CUDA: the GEMV against what the export runs, torchao's ``torch._scaled_mm`` (fast accumulation) on the same
    codes, Llama-8B layer shapes at M = 1, 8, 16, bf16, both designs: the same values within the looser of the two
    accumulations (cuBLAS's fast FP8 accumulation is not a full float32 one). Returns the number of checks."""
    n = 0
    for M in (1, 8, 16):
        for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
            w = (torch.randn(N, K, device=device) * 2).to(FP8)
            w_scale = torch.rand(N, device=device) / 100 + 1e-4
            x = _activations(M, K, torch.bfloat16, device)
            x[2 % M] += 1  # no all-zero row here: torchao's would be NaN
            q, sx = quantize_fp8_rows(x)
            ref = torch._scaled_mm(q, w.T, scale_a=sx.reshape(-1, 1), scale_b=w_scale.reshape(1, -1),
                                   out_dtype=torch.bfloat16, use_fast_accum=True)
            exact = (q.double() @ w.double().T) * sx.double()[:, None] * w_scale.double()[None, :]
            rel = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
            for design in DESIGNS:
                out = fp8_gemv_triton(x, w, w_scale, design=design)
                assert rel(out) < 4e-3 and rel(out) <= rel(ref) + 1e-3, (M, N, K, design, rel(out), rel(ref))
                n += 1
    return n
