#!/usr/bin/env python
"""Which kernel should run each low-bit matmul of a decoder layer at fine-tuning micro-batches?

    python benchmarks/benchmark_mm_backends.py --tokens 2048 --json OUT/mm_backends.json --markdown OUT/mm_backends.md

For the seven linears of a Llama-8B-shaped layer and the three matmuls of each (fwd ``X·Wᵀ``, dgrad
``dY·W``, wgrad ``dYᵀ·X``), on operands already quantized and laid out as training feeds them (reduction
dim contiguous), it times: cuBLAS bf16; our Triton INT8 kernel with the scales in its epilogue
(launched directly, after autotuning, as Inductor's generated code launches it); cuBLAS INT8 (``torch._int_mm``) followed by the scale
multiply, compiled together; cuBLAS FP8 row-wise (``torch._scaled_mm``). GPU time only (10 calls captured in a
CUDA graph, median of 10 replays: with events around single calls a first run timed the Python launch as much as
these ~0.1 ms kernels), one run, so the columns compare.

``--sweep``: also times every tile configuration in ``SWEEP`` (a superset of the kernel's autotune list) on each
matmul, launched directly without the autotuner, to see which tiles the list lacks. ``--quant``: also times the
quantization kernels on the shapes training feeds them (``quantize_t`` on each weight-gradient operand, the
weight cache's refresh of both layouts on each weight), as the bandwidth of the bytes they must move (read once, write
once).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import graph_ms, write_results  # noqa: E402
from hf_lowbit.kernels.fp8 import FP8_DTYPE  # noqa: E402
from hf_lowbit.kernels.triton_int8 import _configs, _int8_scaled_mm_kernel, int8_scaled_mm_triton  # noqa: E402
from hf_lowbit.kernels.triton_quant import quantize_t_triton  # noqa: E402

LINEARS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
           "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}  # name -> (in, out)


def _direct(fn, *args):
    """Launch the Triton kernel itself: eagerly, ``wrap_triton``'s dispatch costs more host time than these
    kernels take, so timing the op measured the launch (a first run read ~0.10 ms for every small shape)."""
    from torch._library.triton import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        return fn(*args)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried by --sweep beside the autotune list (the kernel's _configs)
SWEEP = [(128, 128, 256, 8, 3), (128, 128, 128, 8, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4),
         (128, 256, 64, 8, 5), (64, 256, 128, 4, 4), (128, 128, 128, 4, 5), (256, 64, 128, 8, 4),
         (64, 128, 256, 4, 3), (128, 64, 256, 4, 3)]


def _sweep(qa, qb, sa, sb) -> dict:
    """Milliseconds of each tile configuration (autotune list + SWEEP) on one matmul; None where it does not fit."""
    m, k = qa.shape
    n = qb.shape[0]
    out = torch.empty(m, n, device=qa.device, dtype=torch.bfloat16)
    listed = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
              for c in _configs()]
    res = {}
    for bm, bn, bk, w, st in dict.fromkeys(listed + SWEEP):
        def launch():
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            _int8_scaled_mm_kernel.fn[grid](qa, qb, sa, sb, out, m, n, k, qa.stride(0), qa.stride(1), qb.stride(0),
                                            qb.stride(1), out.stride(0), out.stride(1), A_K_CONTIG=True,
                                            B_K_CONTIG=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                            num_warps=w, num_stages=st)
        key = f"{bm}x{bn}x{bk}/w{w}/s{st}" + ("" if (bm, bn, bk, w, st) in listed else " (new)")
        try:
            res[key] = graph_ms(launch)
        except Exception as e:  # noqa: BLE001 - too much shared memory for this tile: record why, go on
            res[key] = None
            print(f"  {key}: {type(e).__name__}", flush=True)
    return res


def _quant_rows(tokens: int) -> list[dict]:
    """quantize_t on each weight-gradient operand and the weight refresh (both layouts) on each weight: ms and the
    bandwidth of the minimal traffic (bf16 read once, codes written once per layout)."""
    from torch._library.triton import set_wrap_triton_enabled

    from hf_lowbit.kernels import quantize_weight

    rows = []
    for name, (k_in, n_out) in LINEARS.items():
        for what, shape in (("X (wgrad)", (tokens, k_in)), ("dY (wgrad)", (tokens, n_out))):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            with set_wrap_triton_enabled(False):
                ms = graph_ms(lambda: quantize_t_triton(x, torch.int8, 127.0))
            rows.append({"linear": name, "operand": what, "shape": list(shape), "ms": ms,
                         "gb_s": x.numel() * 3 / ms / 1e6})
        w = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16)
        ms = graph_ms(lambda: quantize_weight("int8", w))
        rows.append({"linear": name, "operand": "W (cache refresh, both layouts)", "shape": [n_out, k_in], "ms": ms,
                     "gb_s": w.numel() * 4 / ms / 1e6})
        print(rows[-3:], flush=True)
    return rows


def _int_mm_scaled(a, b_t, sa, sb):
    return (torch._int_mm(a, b_t).float() * sa[:, None] * sb[None, :]).to(torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sweep", action="store_true", help="also time every tile configuration of SWEEP")
    p.add_argument("--quant", action="store_true", help="also time the quantization kernels on training's shapes")
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
            t = {"bf16": graph_ms(lambda: x @ w.T),
                 "triton_int8": graph_ms(lambda: _direct(int8_scaled_mm_triton, qa, qb, sa, sb, torch.bfloat16)),
                 "cublas_int8": graph_ms(lambda: int_mm(qa, qb.T, sa, sb)),
                 "cublas_fp8": graph_ms(lambda: torch._scaled_mm(fa, fb.T, scale_a=sa[:, None], scale_b=sb[None, :],
                                                                  out_dtype=torch.bfloat16))}
            for key in t:
                totals[key] += t[key]
            rows.append({"linear": name, "matmul": mm, "m": m, "n": n, "k": k, **{f"{k_}_ms": v for k_, v in t.items()},
                         "tops": {k_: 2 * m * n * k / v / 1e9 for k_, v in t.items()}})
            if a.sweep:
                rows[-1]["sweep_ms"] = sw = _sweep(qa, qb, sa, sb)
                best = min((v, c) for c, v in sw.items() if v is not None)
                rows[-1]["sweep_best"] = {"config": best[1], "ms": best[0]}
                totals["sweep_best"] = totals.get("sweep_best", 0.0) + best[0]
            print(rows[-1], flush=True)
    table = ["| linear | matmul | M×N×K | bf16 ms | Triton INT8 ms | cuBLAS INT8 (+scale) ms | cuBLAS FP8 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['linear']} | {r['matmul']} | {r['m']}×{r['n']}×{r['k']} | {r['bf16_ms']:.3f} | "
                     f"{r['triton_int8_ms']:.3f} | {r['cublas_int8_ms']:.3f} | {r['cublas_fp8_ms']:.3f} |")
    table.append(f"| **one layer** | all | | {totals['bf16']:.2f} | {totals['triton_int8']:.2f} | "
                 f"{totals['cublas_int8']:.2f} | {totals['cublas_fp8']:.2f} |")
    if a.sweep:
        table += ["", "| linear | matmul | autotuned ms | best tile of the sweep | its ms |", "|---|---|---|---|---|"]
        table += [f"| {r['linear']} | {r['matmul']} | {r['triton_int8_ms']:.3f} | {r['sweep_best']['config']} | "
                  f"{r['sweep_best']['ms']:.3f} |" for r in rows]
        table.append(f"| **one layer** | | {totals['triton_int8']:.2f} | | {totals['sweep_best']:.2f} |")
    quant = _quant_rows(a.tokens) if a.quant else []
    if quant:
        table += ["", "| linear | operand | shape | ms | GB/s (bf16 read once + codes written once per layout) |",
                  "|---|---|---|---|---|"]
        table += [f"| {r['linear']} | {r['operand']} | {'×'.join(map(str, r['shape']))} | {r['ms']:.4f} | "
                  f"{r['gb_s']:,.0f} |" for r in quant]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "tokens": a.tokens, "totals_ms": totals, "command": " ".join(sys.argv)}
    write_results({"meta": meta, "rows": rows, "quant": quant}, table, f"{meta['device']}, torch {meta['torch']}, {a.tokens} tokens",
                  a.json, a.markdown)


if __name__ == "__main__":
    main()
