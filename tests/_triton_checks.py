"""Checks of the Triton kernels against plain-torch references, for the device they run on.

Imported by test_triton_int8.py: directly on CUDA, or in a subprocess with TRITON_INTERPRET=1 on a
CPU (the interpreter must be switched on before Triton compiles anything).
"""

import torch

from hf_lowbit.ops.int8 import int8_mm_reference
from hf_lowbit.ops.triton_int8 import int8_scaled_mm_triton

CPU_SHAPES = [(33, 17, 70), (16, 48, 32), (5, 40, 129)]
CUDA_SHAPES = CPU_SHAPES + [(4096, 1536, 4096), (300, 5000, 777)]


def check_int8_scaled_mm(device: str) -> int:
    shapes = CUDA_SHAPES if device == "cuda" else CPU_SHAPES
    n = 0
    for M, N, K in shapes:
        for a_t in (False, True):
            for b_t in (False, True):
                a = torch.randint(-127, 128, (K, M) if a_t else (M, K), dtype=torch.int8, device=device)
                b = torch.randint(-127, 128, (K, N) if b_t else (N, K), dtype=torch.int8, device=device)
                a, b = (a.T if a_t else a), (b.T if b_t else b)
                sa = torch.rand(M, device=device) / 1000 + 1e-4
                sb = torch.rand(N, device=device) / 1000 + 1e-4
                ref = int8_mm_reference(a, b).double() * sa.double()[:, None] * sb.double()[None, :]
                for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
                    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)  # poisoned
                    out = int8_scaled_mm_triton(a, b, sa, sb, dtype)
                    assert out.shape == (M, N) and out.dtype == dtype
                    assert torch.isfinite(out).all(), f"unwritten or non-finite output at {(M, N, K)}"
                    rel = ((out.double() - ref).norm() / ref.norm()).item()
                    assert rel < tol, f"{(M, N, K)} a_t={a_t} b_t={b_t} {dtype}: rel err {rel:.2e}"
                    n += 1
    return n




def check_quantize_t(device: str) -> int:
    """The column-quantize-and-transpose kernels against the plain-torch reference (CPU op impl)."""
    from hf_lowbit.ops.fp8 import FP8_DTYPE, FP8_MAX
    from hf_lowbit.ops.int8 import INT8_MAX
    from hf_lowbit.ops.quantize_t import quantize_t
    from hf_lowbit.ops.triton_quant import quantize_t_triton

    formats = [("int8", torch.int8, INT8_MAX), ("fp8", FP8_DTYPE, FP8_MAX)]
    n = 0
    chunk = 1024 if device == "cuda" else 64  # several partial-absmax chunks either way
    for M, N in ((37, 24), (1030, 70) if device == "cuda" else (150, 40), (5, 3)):
        for transposed in (False, True):
            x = (torch.randn(N, M, device=device).T if transposed else torch.randn(M, N, device=device)) * 3
            x[:, 1] = 0  # an all-zero column
            if N > 2:
                x[M // 2, 2] = float("nan")  # a column with a NaN
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                for fmt, qdtype, qmax in formats:
                    q, s = quantize_t_triton(xd, qdtype, qmax, chunk_m=chunk)
                    rq, rs = quantize_t(xd.cpu(), fmt)
                    assert q.shape == (N, M) and q.is_contiguous() and s.shape == (N,)
                    assert torch.isnan(s[2]).item() == (N > 2) and s[1].item() > 0
                    ok = [c for c in range(N) if not (N > 2 and c == 2)]
                    torch.testing.assert_close(s[ok].cpu(), rs[ok], rtol=0, atol=0)
                    diff = (q[ok].cpu().float() - rq[ok].float()).abs()
                    flips = (diff > 0).float().mean().item()  # bit for bit: the kernel's divisions are IEEE-rounded
                    assert flips == 0, f"{(M, N)} t={transposed} {dtype} {fmt}: {flips:.2e} differ, max {diff.max()}"
                    n += 1
    return n


if __name__ == "__main__":
    print("checked", check_int8_scaled_mm("cpu"), "matmuls and", check_quantize_t("cpu"), "quantizations")
