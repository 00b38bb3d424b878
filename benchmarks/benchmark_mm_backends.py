#!/usr/bin/env python
"""Which kernel should run each low-bit matmul of a decoder layer at fine-tuning micro-batches?

    python benchmarks/benchmark_mm_backends.py --tokens 2048 --json OUT/mm_backends.json --markdown OUT/mm_backends.md

For the seven linears of a Llama-8B-shaped layer and the three matmuls of each (fwd ``X·Wᵀ``, dgrad
``dY·W``, wgrad ``dYᵀ·X``), on operands already quantized and laid out as training feeds them (reduction
dim contiguous), it times: cuBLAS bf16; our Triton INT8 kernel with the scales in its epilogue
(launched directly, after autotuning, as Inductor's generated code launches it); cuBLAS INT8 (``torch._int_mm``) followed by the scale
multiply, compiled together; cuBLAS FP8 row-wise (``torch._scaled_mm``). Kernel time only (CUDA events,
median of 20), one run, so the columns compare.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import median_ms, write_results  # noqa: E402
from hf_lowbit.ops.fp8 import FP8_DTYPE  # noqa: E402
from hf_lowbit.ops.triton_int8 import int8_scaled_mm_triton  # noqa: E402

LINEARS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
           "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}  # name -> (in, out)


def _direct(fn, *args):
    """Launch the Triton kernel itself: eagerly, ``wrap_triton``'s dispatch costs more host time than these
    kernels take, so timing the op measured the launch (a first run read ~0.10 ms for every small shape)."""
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        return fn(*args)


def _int_mm_scaled(a, b_t, sa, sb):
    return (torch._int_mm(a, b_t).float() * sa[:, None] * sb[None, :]).to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    dev = "cuda"
    int_mm = torch.compile(_int_mm_scaled)
    rows, totals = [], {"bf16": 0.0, "triton_int8": 0.0, "cublas_int8": 0.0, "cublas_fp8": 0.0}
    for name, (k_in, n_out) in LINEARS.items():
        # (rows, cols, reduction) of each matmul's output
        for mm, (m, n, k) in {"fwd": (a.tokens, n_out, k_in), "dgrad": (a.tokens, k_in, n_out),
                              "wgrad": (n_out, k_in, a.tokens)}.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            qa = torch.randint(-127, 128, (m, k), device=dev, dtype=torch.int8)
            qb = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
            sa, sb = torch.rand(m, device=dev) + 0.5, torch.rand(n, device=dev) + 0.5
            fa, fb = x.to(FP8_DTYPE), w.to(FP8_DTYPE)
            t = {"bf16": median_ms(lambda: x @ w.T),
                 "triton_int8": median_ms(lambda: _direct(int8_scaled_mm_triton, qa, qb, sa, sb, torch.bfloat16)),
                 "cublas_int8": median_ms(lambda: int_mm(qa, qb.T, sa, sb)),
                 "cublas_fp8": median_ms(lambda: torch._scaled_mm(fa, fb.T, scale_a=sa[:, None], scale_b=sb[None, :],
                                                                  out_dtype=torch.bfloat16))}
            for key in totals:
                totals[key] += t[key]
            rows.append({"linear": name, "matmul": mm, "m": m, "n": n, "k": k, **{f"{k_}_ms": v for k_, v in t.items()},
                         "tops": {k_: 2 * m * n * k / v / 1e9 for k_, v in t.items()}})
            print(rows[-1], flush=True)
    table = ["| linear | matmul | M×N×K | bf16 ms | Triton INT8 ms | cuBLAS INT8 (+scale) ms | cuBLAS FP8 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['linear']} | {r['matmul']} | {r['m']}×{r['n']}×{r['k']} | {r['bf16_ms']:.3f} | "
                     f"{r['triton_int8_ms']:.3f} | {r['cublas_int8_ms']:.3f} | {r['cublas_fp8_ms']:.3f} |")
    table.append(f"| **one layer** | all | | {totals['bf16']:.2f} | {totals['triton_int8']:.2f} | "
                 f"{totals['cublas_int8']:.2f} | {totals['cublas_fp8']:.2f} |")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "tokens": a.tokens, "totals_ms": totals, "command": " ".join(sys.argv)}
    write_results({"meta": meta, "rows": rows}, table, f"{meta['device']}, torch {meta['torch']}, {a.tokens} tokens",
                  a.json, a.markdown)


if __name__ == "__main__":
    main()
