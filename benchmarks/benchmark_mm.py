#!/usr/bin/env python
"""Scaled low-bit matmuls and quantization kernels against bf16 and the copy bandwidth, one run.

    python benchmarks/benchmark_mm.py --json docs/results/mm_h200.json --markdown docs/results/mm_h200.md

For each LLM shape (tokens x in -> out of the Llama-8B-shaped bench) and each layout training needs:
  fwd    Y  = X·Wᵀ   (X reduced over dim 1, W over dim 1)
  dgrad  dX = dY·W   (dY over dim 1, W over dim 0)
  wgrad  dW = dYᵀ·X  (both over dim 0, the tokens)
it times bf16 (torch.matmul on the same layout), the low-bit matmul kernel alone on pre-quantized
operands, and quantize + matmul compiled together (what training runs). Quantization alone is
timed in GB/s (bytes read + written) beside a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import median_ms, write_results  # noqa: E402
from hf_lowbit.kernels import get_format, quantize_t, scaled_matmul  # noqa: E402

LAYOUTS = {"fwd": (1, 1), "dgrad": (1, 0), "wgrad": (0, 0)}


def operands(layout: str, m: int, k: int, n: int, device: str):
    """(x, x_dim, w, w_dim) for one layout, with the result [rows, cols] and reduction length."""
    g = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    if layout == "fwd":  # X[m,k] · W[n,k]ᵀ -> [m,n], reduce k
        return g(m, k), 1, g(n, k), 1, (m, n, k)
    if layout == "dgrad":  # dY[m,n] · W[n,k] -> [m,k], reduce n
        return g(m, n), 1, g(n, k), 0, (m, k, n)
    return g(m, n), 0, g(m, k), 0, (n, k, m)  # wgrad: dY[m,n]ᵀ · X[m,k] -> [n,k], reduce m


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", default="4096x4096,4096x1024,4096x14336,14336x4096", help="in x out, comma-separated")
    p.add_argument("--formats", default="int8,fp8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_mm.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    torch.manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for layout in LAYOUTS:
            x, xd, w, wd, (rows_, cols, red) = operands(layout, a.tokens, k, n, a.device)
            flops = 2 * rows_ * cols * red
            xm = x.T if xd == 0 else x
            wm = w if wd == 0 else w.T
            ms = median_ms(lambda: xm @ wm, a.device, a.reps)
            rows.append({"shape": shape, "layout": layout, "recipe": "bf16", "ms": ms, "tflops": flops / ms / 1e9})
            for fmt in a.formats.split(","):
                quantize, mm = get_format(fmt).quantize, get_format(fmt).scaled_mm
                qx, sx = quantize(x, dim=xd)
                qw, sw = quantize(w, dim=wd)
                qx, sx = (qx.T.contiguous(), sx.T) if xd == 0 else (qx, sx)
                qw, sw = (qw.T.contiguous(), sw.T) if wd == 0 else (qw, sw)
                sx, sw = sx.reshape(-1).contiguous(), sw.reshape(-1).contiguous()
                kernel_ms = median_ms(lambda: mm(qx, qw, sx, sw, torch.bfloat16), a.device, a.reps)
                torch._dynamo.reset()
                fused = torch.compile(lambda x, w: scaled_matmul(fmt, x, xd, w, wd, torch.bfloat16))
                total_ms = median_ms(lambda: fused(x, w), a.device, a.reps)
                for recipe, t in ((f"{fmt} kernel", kernel_ms), (f"{fmt} quantize+matmul", total_ms)):
                    rows.append({"shape": shape, "layout": layout, "recipe": recipe, "ms": t,
                                 "tflops": flops / t / 1e9, "vs_bf16": ms / t})
    # quantization alone against the copy bandwidth
    big = torch.randn(a.tokens, 4096, device=a.device, dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    copy_ms = median_ms(lambda: dst.copy_(big), a.device, a.reps)
    nbytes = big.numel() * big.element_size()
    quant = [{"kernel": "copy (bf16)", "ms": copy_ms, "gb_s": 2 * nbytes / copy_ms / 1e6}]
    for fmt in a.formats.split(","):
        quantize = get_format(fmt).quantize
        for dim in (1, 0):  # what training runs: Inductor-fused plain torch along dim 1, quantize_t along dim 0
            torch._dynamo.reset()
            f = torch.compile(lambda t: quantize_t(t, fmt) if dim == 0 else quantize(t, dim=1))
            t = median_ms(lambda: f(big), a.device, a.reps)
            moved = nbytes + big.numel()  # read bf16, write 1-byte codes (scales are negligible)
            quant.append({"kernel": f"quantize {fmt} dim={dim}" + (" (quantize_t, transposed)" if dim == 0 else ""),
                          "ms": t, "gb_s": moved / t / 1e6, "vs_copy": (moved / t) / (2 * nbytes / copy_ms)})
    meta = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__,
            "python": platform.python_version(), "tokens": a.tokens, "command": " ".join(sys.argv)}
    table = ["| in x out | layout | recipe | ms | TFLOP/s | vs bf16 |", "|---|---|---|---|---|---|"]
    table += [f"| {r['shape']} | {r['layout']} | {r['recipe']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
              f"{r.get('vs_bf16', 1.0):.2f}x |" for r in rows]
    table += ["", "| kernel | ms | GB/s | vs copy |", "|---|---|---|---|"]
    table += [f"| {q['kernel']} | {q['ms']:.3f} | {q['gb_s']:.0f} | {q.get('vs_copy', 1.0):.2f} |" for q in quant]
    write_results({"meta": meta, "matmuls": rows, "quantize": quant}, table,
                  f"{meta['device']}, torch {meta['torch']}, {a.tokens} tokens", a.json, a.markdown)


if __name__ == "__main__":
    main()
