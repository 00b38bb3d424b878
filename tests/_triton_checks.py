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


if __name__ == "__main__":
    print("checked", check_int8_scaled_mm("cpu"))
