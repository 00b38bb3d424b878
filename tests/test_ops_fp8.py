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


@pytest.mark.parametrize("x_dim,w_dim", [(1, 1), (1, 0), (0, 0)])
def test_fp8_matmul_layouts_snr(x_dim, w_dim):
    x = torch.randn(96, 128) if x_dim == 0 else torch.randn(128, 96)
    w = torch.randn(96, 80) if w_dim == 0 else torch.randn(80, 96)
    ref = (x.T if x_dim == 0 else x).double() @ (w if w_dim == 0 else w.T).double()
    assert snr_db(ref, scaled_matmul("fp8", x, x_dim, w, w_dim, torch.float32)) > 25


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
