#!/usr/bin/env python
"""NF4 → INT8 operand per call: hf_lowbit's one-pass decode vs the two-step way and bitsandbytes' dequantize.

    python benchmarks/benchmark_nf4_decode.py --json docs/results/nf4_decode_h200.json \
        --markdown docs/results/nf4_decode_h200.md

For each of a Llama-8B layer's weight shapes, GPU time (ten calls captured in a CUDA graph and replayed, median of
ten replays; ``triton.testing.do_bench`` for a call that cannot be captured, said in the row's ``timing``) of: ``kernel`` /
``kernel_t``: the decode kernel alone (row-major / transposed output; multipliers made beforehand), launched
directly as Inductor's generated code launches it; ``ours``: ``hf_lowbit.kernels.nf4.nf4_to_int8`` (row-major, the forward's operand) and ``ours_t`` (transposed, the input
gradient's), with the multipliers computed eagerly (several small kernels, fused into one under compile); ``two_step``: dequantize to bf16 then quantize per row (compiled), the way
hf_lowbit did it before; ``bnb``: bitsandbytes' ``dequantize_4bit`` to bf16 (what its QLoRA runs before every bf16
matmul), when installed; ``copy``: a device copy of the INT8 weight (bandwidth reference). GB/s counts the bytes
each must move (codes + scales read, output written). ``--device cpu`` smoke-tests the script (reference only).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))  # q/o, k/v, gate/up, down: [out, in]


def bench(shapes, device: str) -> list[dict]:
    import torch
    from torch._library.triton import set_wrap_triton_enabled

    from hf_lowbit.kernels.int8 import quantize_int8
    from hf_lowbit.kernels.nf4 import (dequantize_nf4, nf4_int8_multipliers, nf4_lut, nf4_to_int8, nf4_to_int8_op,
                                   quantize_nf4)

    from benchmarks.driver import kernel_us

    def timed(fn):  # GPU time alone, in a CUDA graph (driver.kernel_us)
        return kernel_us(fn, device)

    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        bnbf = None
    two_step = torch.compile(lambda d: quantize_int8(dequantize_nf4(d), dim=1)) if device == "cuda" else (
        lambda d: quantize_int8(dequantize_nf4(d), dim=1))
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        data = quantize_nf4(w)
        scale_bytes = data.scales.numel() + data.scale_factor.numel() * 2
        int8_bytes = n * k
        src = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
        dst = torch.empty_like(src)
        nf4_bytes = data.codes.numel() + scale_bytes
        mul, _ = nf4_int8_multipliers(data)
        lut = nf4_lut(data.scale_mean.dtype, device)
        cases = {"kernel": (lambda: nf4_to_int8_op(data.codes, mul, lut, False), nf4_bytes + int8_bytes),
                 "kernel_t": (lambda: nf4_to_int8_op(data.codes, mul, lut, True), nf4_bytes + int8_bytes),
                 "ours": (lambda: nf4_to_int8(data), nf4_bytes + int8_bytes),
                 "ours_t": (lambda: nf4_to_int8(data, transposed=True), nf4_bytes + int8_bytes),
                 "two_step": (lambda: two_step(data), nf4_bytes + int8_bytes),
                 "copy": (lambda: dst.copy_(src), 2 * int8_bytes)}
        if bnbf is not None and device == "cuda":
            qw, state = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
            cases["bnb"] = (lambda: bnbf.dequantize_4bit(qw, state, quant_type="nf4"), qw.numel() + 2 * n * k)
        for name, (fn, nbytes) in cases.items():
            # eagerly a triton_op goes through wrap_triton's dispatch, tens of µs on the host a call (on the H200
            # run of 5b3e153 a 4M-weight decode read ~40 µs, launch-bound): launch the kernels directly, as the
            # code Inductor generates does
            with set_wrap_triton_enabled(False):
                us, how = timed(fn)
            rows.append({"shape": [n, k], "method": name, "us": us, "gb_s": nbytes / us / 1e3, "timing": how})
            print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_nf4_decode.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    from benchmarks.driver import meta, write_results

    shapes = SHAPES if a.device == "cuda" else ((64, 128), (32, 256))
    rows = bench(shapes, a.device)
    info = meta(a.device)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    table = ["| weight [out, in] | " + " | ".join(f"{m} µs (GB/s)" for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        cells = {r["method"]: f"{r['us']:.1f} ({r['gb_s']:.0f})" for r in rows if tuple(r["shape"]) == shape}
        table.append(f"| {shape[0]} x {shape[1]} | " + " | ".join(cells.get(m, "–") for m in methods) + " |")
    write_results({"meta": info, "rows": rows}, table, f"{info['gpu']}, torch {info['torch']}", a.json, a.markdown)


if __name__ == "__main__":
    main()
