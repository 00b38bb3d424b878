"""The INT8 kernels against plain-torch references (CPU path; the Triton kernel in test_triton_int8)."""

import pytest
import torch

from hf_lowbit.kernels import scaled_matmul
from hf_lowbit.kernels.int8 import int8_mm_reference, int8_scaled_mm, quantize_int8


@pytest.mark.parametrize("dim", [0, 1])
def test_quantize_roundtrip_and_range(dim):
    x = torch.randn(64, 96) * torch.logspace(-3, 3, 96)
    q, s = quantize_int8(x, dim=dim)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.abs().max() <= 127 and (q.abs().amax(dim=dim) == 127).all()  # absmax maps to ±127
    assert s.shape == (1, 96) if dim == 0 else s.shape == (64, 1)
    err = (q.float() * s - x).abs()
    assert (err <= s / 2 + 1e-6 * x.abs()).all()  # round-to-nearest: at most half a step


def test_quantize_extremes():
    x = torch.randn(4, 32)
    x[0] = 0  # all-zero row: finite scale, exact zeros
    x[1] *= 1e30  # huge but finite
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    q, s = quantize_int8(x)
    assert torch.isfinite(s[:2]).all() and (q[0] == 0).all()
    rel = ((q[1].double() * s[1].double() - x[1].double()).norm() / x[1].double().norm()).item()
    assert rel < 1e-2
    assert torch.isnan(s[2]).all(), "a NaN row must not get a finite scale"
    assert not torch.isfinite(s[3]).all()


def test_quantize_bf16_input_matches_fp32():
    x = torch.randn(16, 64).bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8(x), quantize_int8(x.float())))


@pytest.mark.parametrize("shape", [(33, 17, 70), (8, 8, 8), (5, 40, 2100)])
def test_int8_mm_reference_exact(shape):
    M, N, K = shape
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    assert torch.equal(int8_mm_reference(a, b), (a.long() @ b.long().T).int())


@pytest.mark.parametrize("K", [4096, 14336])
def test_int8_mm_reference_exact_where_a_float32_sum_would_round(K):
    """The reference sums int8 products in float32 chunks. float32 holds integers exactly only up to 2**24, and
    127**2 * K passes that beyond K = 1040 (128**2 * K beyond 1024 with the op's -128), so a longer chunk rounds. Random codes cannot show it (their sums stay
    near sqrt(K) * 127**2, far below 2**24), so rows here have products of one sign and full size: codes of
    +-127 with matching signs (every product 127**2, odd: the total of 1041 or more is odd and above 2**24, which
    float32 cannot hold whatever the summation order, so any chunk longer than 1040 rounds it), codes in
    [100, 127] (sums past 2**24 after ~1,300 terms, odd half of the time), and 1024 products (-128)**2 = 2**14
    followed by others (outside the quantizer's codes, allowed by the op: any chunk past 1024 rounds there). Bit for bit against an int64 sum (|sum| <= 128**2 * 14336 < 2**31: int32 holds it)."""
    g = torch.Generator().manual_seed(K)
    sign = torch.randint(0, 2, (K,), generator=g) * 2 - 1
    a = (torch.randint(100, 128, (6, K), generator=g) * sign).to(torch.int8)
    b = (torch.randint(100, 128, (5, K), generator=g) * sign).to(torch.int8)
    b[1] = -b[1]  # negative sums
    a[2, :1024], b[2, :1024] = -128, -128
    a[3], b[3] = (127 * sign).to(torch.int8), (127 * sign).to(torch.int8)
    exact = a.long() @ b.long().T
    assert exact.abs().max() > 2 ** 24 and (exact % 2).any()  # the operands do reach float32's rounding
    assert torch.equal(int8_mm_reference(a, b).long(), exact)
    assert torch.equal(int8_mm_reference(a.T.contiguous().T, b), exact.int())  # strided K: the same sums


def test_scaled_mm_transposed_views_and_dtypes():
    a = torch.randint(-127, 128, (48, 40), dtype=torch.int8).T  # [40, 48] with K stride != 1
    b = torch.randint(-127, 128, (48, 24), dtype=torch.int8).T  # [24, 48]
    sa, sb = (torch.rand(40) + 0.1) / 100, (torch.rand(24) + 0.1) / 100  # fp16-safe range
    ref = (a.double() @ b.double().T) * sa.double()[:, None] * sb.double()[None, :]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = int8_scaled_mm(a, b, sa, sb, dtype)
        assert out.dtype == dtype and out.shape == (40, 24)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert ((out.double() - ref).norm() / ref.norm()) < tol


def test_scaled_mm_rejects_bad_input():
    a = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="reduction dims differ"):
        int8_scaled_mm(a, torch.zeros(4, 9, dtype=torch.int8), torch.ones(4), torch.ones(4), torch.float32)
    with pytest.raises(RuntimeError, match="must be int8"):
        int8_scaled_mm(a.float(), a, torch.ones(4), torch.ones(4), torch.float32)


def test_int8_matmul_exact_when_representable():
    # rows whose absmax is exactly 127 with integer entries quantize with scale 1: the product is exact
    x = torch.randint(-127, 128, (32, 64)).float()
    w = torch.randint(-127, 128, (16, 64)).float()
    x[:, 0], w[:, 0] = 127, -127
    assert torch.equal(scaled_matmul("int8", x, 1, w, 1, torch.float32), x @ w.T)


@pytest.mark.parametrize("x_dim,w_dim", [(1, 1), (1, 0), (0, 0)])
def test_int8_matmul_layouts_snr(x_dim, w_dim):
    from conftest import snr_db

    x = torch.randn(128, 96)
    w = torch.randn(96, 80) if w_dim == 0 else torch.randn(80, 96)
    if x_dim == 0:
        x = torch.randn(96, 128)
    ref = (x.T if x_dim == 0 else x).double() @ (w if w_dim == 0 else w.T).double()
    out = scaled_matmul("int8", x, x_dim, w, w_dim, torch.float32)
    assert snr_db(ref, out) > 30
