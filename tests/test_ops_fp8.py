"""The FP8 kernels against plain-torch references (CPU path here; the CUDA path in test_*_linear on a GPU)."""

import pytest
import torch
from conftest import snr_db

from hf_lowbit.kernels import scaled_matmul
from hf_lowbit.kernels.fp8 import FP8_DTYPE, FP8_MAX, fp8_scaled_mm, quantize_fp8

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dim", [0, 1])
def test_quantize_fp8_range_and_error(dim):
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 96)
    q, s = quantize_fp8(x, dim=dim)
    assert q.dtype == FP8_DTYPE and (q.float().abs().amax(dim=dim) == FP8_MAX).all()
    rel = (q.float() * s - x).abs() / x.abs().clamp(min=1e-30)
    big = x.abs() >= s * 2 ** -6 * FP8_MAX / 448 * 64  # normal e4m3 range: relative error <= 2^-4
    assert (rel[big] <= 2 ** -4 + 1e-6).all()


def test_quantize_fp8_extremes():
    x = torch.randn(3, 32)
    x[0] = 0
    x[1, 2] = float("nan")
    x[2] *= 1e30
    q, s = quantize_fp8(x)
    assert torch.isfinite(s[[0, 2]]).all() and (q[0].float() == 0).all() and torch.isnan(s[1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 48, 64), (40, 24, 100), (7, 5, 33)])
def test_fp8_scaled_mm_matches_upcast_reference(device, shape):
    M, N, K = shape
    a = torch.randn(M, K, device=device).to(FP8_DTYPE)
    b = torch.randn(N, K, device=device).to(FP8_DTYPE)
    sa, sb = torch.rand(M, device=device) + 0.5, torch.rand(N, device=device) + 0.5
    ref = (a.double() @ b.double().T) * sa.double()[:, None] * sb.double()[None, :]
    out = fp8_scaled_mm(a, b, sa, sb, torch.float32)
    tol = 1e-6 if device == "cpu" else 8e-3  # CUDA returns bf16 from _scaled_mm
    assert ((out.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize("fmt", ["fp8", "fp8_tensorwise"])
@pytest.mark.parametrize("x_dim,w_dim", [(1, 1), (1, 0), (0, 0)])
def test_fp8_matmul_layouts_snr(x_dim, w_dim, fmt):
    x = torch.randn(96, 128) if x_dim == 0 else torch.randn(128, 96)
    w = torch.randn(96, 80) if w_dim == 0 else torch.randn(80, 96)
    ref = (x.T if x_dim == 0 else x).double() @ (w if w_dim == 0 else w.T).double()
    assert snr_db(ref, scaled_matmul(fmt, x, x_dim, w, w_dim, torch.float32)) > 25


def test_argument_checks_trace_without_graph_break():
    """FP8 on CUDA calls ``torch._scaled_mm`` straight from the traced graph with these checks in front: their
    message closures must hold no tensors, or Dynamo breaks the graph at every matmul (46 breaks on the H200)."""
    import torch._dynamo

    from hf_lowbit.kernels._checks import check_scaled_mm_args
    from hf_lowbit.kernels.fp8 import FP8_DTYPE, quantize_fp8

    def f(x, w):  # as in the layer: the checked operands are intermediates of the traced graph
        (a, sa), (b, sb) = quantize_fp8(x, dim=1), quantize_fp8(w, dim=1)
        sa, sb = sa.reshape(-1), sb.reshape(-1)
        check_scaled_mm_args("fp8_scaled_mm", FP8_DTYPE, a, b, sa, sb)
        return a.float() @ b.float().T * sa[:, None] * sb[None, :]

    explanation = torch._dynamo.explain(f)(torch.randn(8, 32), torch.randn(16, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons


# fp8_tensorwise: one float32 scale per tensor (amax / 448), expanded to the per-row / per-column shape
def _tensorwise_reference(x):
    """Written out here, independently of hf_lowbit: codes and the one scale."""
    amax = x.float().abs().max()
    scale = torch.clamp(amax, min=1e-30) / 448.0
    return torch.clamp(x.float() / scale, -448.0, 448.0).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_quantize_fp8_tensorwise_bit_for_bit(dim):
    from hf_lowbit.kernels.fp8 import quantize_fp8_tensorwise

    x = (torch.randn(64, 96) * torch.logspace(-3, 3, 96)).bfloat16()
    q, s = quantize_fp8_tensorwise(x, dim=dim)
    rq, rs = _tensorwise_reference(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (1, 96) if dim == 0 else s.shape == (64, 1)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and (s == rs).all()
    # the same bits as the row-wise quantizer over the flattened tensor (one row)
    fq, fs = quantize_fp8(x.reshape(1, -1), dim=1)
    assert torch.equal(q.reshape(1, -1).view(torch.uint8), fq.view(torch.uint8)) and (s == fs).all()


def test_quantize_fp8_tensorwise_extremes():
    from hf_lowbit.kernels.fp8 import quantize_fp8_tensorwise

    q, s = quantize_fp8_tensorwise(torch.zeros(3, 32))
    assert (q.float() == 0).all() and torch.isfinite(s).all()
    x = torch.randn(3, 32)
    x[1, 2] = float("nan")
    assert torch.isnan(quantize_fp8_tensorwise(x)[1]).all()
    x[1, 2] = float("inf")
    assert not torch.isfinite(quantize_fp8_tensorwise(x)[1]).any()
    q, s = quantize_fp8_tensorwise(torch.randn(3, 32) * 1e30)
    assert torch.isfinite(s).all() and q.float().abs().max() == FP8_MAX


def test_tensorwise_codes_are_one_set_in_every_layout():
    """Per row and per column the codes are the same (transposed), so none of the per-column kernels is needed:
    quantize_operand, quantize_t, quantize_dual and quantize_weight all give them."""
    from hf_lowbit.kernels import (
        quantize_dual,
        quantize_operand,
        quantize_t,
        quantize_weight,
    )

    x = torch.randn(40, 48, dtype=torch.bfloat16) * torch.logspace(-2, 2, 48).bfloat16()
    rq, rs = _tensorwise_reference(x)
    (qr, sr), (qc, sc) = quantize_operand("fp8_tensorwise", x, 1), quantize_operand("fp8_tensorwise", x, 0)
    tq, ts = quantize_t(x, "fp8_tensorwise")
    q, s, qt = quantize_weight("fp8_tensorwise", x)
    _, _, dq, ds = quantize_dual(x, "fp8_tensorwise")
    for name, got, ref in (("row", qr, rq), ("column", qc, rq.T), ("quantize_t", tq, rq.T), ("weight", q, rq),
                           ("weight_t", qt, rq.T), ("dual column", dq, rq.T)):
        assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8)), name
    for name, got, n in (("row", sr, 40), ("column", sc, 48), ("quantize_t", ts, 48), ("weight", s, 40),
                         ("dual column", ds, 48)):
        assert got.shape == (n,) and (got == rs).all(), name


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(256, 512, 1024), (40, 24, 100), (7, 5, 33)])
def test_fp8_tensorwise_scaled_mm_cuda_matches_float32(shape):
    """The tensorwise torch._scaled_mm path (one float32 scale per operand; K, N padded to 16) against float32
    arithmetic on the same codes, and the layer's matmul against the float32 product of the unquantized operands."""
    from hf_lowbit.kernels.fp8 import fp8_tensorwise_mm, quantize_fp8_tensorwise

    M, N, K = shape
    x, w = torch.randn(M, K, device="cuda") * 3, torch.randn(N, K, device="cuda") / 7
    (a, sa), (b, sb) = quantize_fp8_tensorwise(x, dim=1), quantize_fp8_tensorwise(w, dim=1)
    sa, sb = sa.reshape(-1), sb.reshape(-1)
    ref = (a.float() @ b.float().T) * sa[0] * sb[0]
    out = fp8_tensorwise_mm(a, b, sa, sb, torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()) < 8e-3  # _scaled_mm returns bf16
    assert snr_db(x @ w.T, scaled_matmul("fp8_tensorwise", x, 1, w, 1, torch.float32)) > 25
