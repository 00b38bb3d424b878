#!/usr/bin/env python
"""Time one linear layer's forward + backward: bf16 vs hf_lowbit INT8/FP8 vs torchao INT8, one run.

    python benchmarks/benchmark_linear.py --json docs/results/linear.json --markdown docs/results/linear.md

Default shape: 16384 tokens x 4096 -> 14336 (a Llama-8B MLP up-projection with 8x2048 tokens).
Each recipe is timed eager and under torch.compile, after warm-up (compile and autotune excluded),
with CUDA events; the median of the repeats is reported. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_lowbit import MixedPrecisionConfig, mixed_precision_linear  # noqa: E402
from benchmarks.driver import median_ms, meta, plot_results, write_results  # noqa: E402


def recipes():
    out = {"bf16": lambda x, w: F.linear(x, w),
           "hf_lowbit_int8": lambda x, w: mixed_precision_linear(x, w, None, MixedPrecisionConfig("int8")),
           "hf_lowbit_fp8": lambda x, w: mixed_precision_linear(x, w, None, MixedPrecisionConfig("fp8"))}
    try:
        from torchao.prototype.quantized_training.int8_mixed_precision import (
            Int8MixedPrecisionTrainingConfig, _Int8MixedPrecisionTrainingLinearFunction)

        cfg = Int8MixedPrecisionTrainingConfig()
        out["torchao_int8"] = lambda x, w: _Int8MixedPrecisionTrainingLinearFunction.apply(x, w, None, cfg)
    except Exception as e:  # torchao missing or its API moved: say so, keep the other rows
        print(f"torchao INT8 mixed precision unavailable: {e!r}", file=sys.stderr)
    return out


def time_fwd_bwd(fn, x, w, gy, reps: int) -> float:
    def step():
        x.grad = w.grad = None
        fn(x, w).backward(gy)

    return median_ms(step, "cuda", reps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--in_features", type=int, default=4096)
    p.add_argument("--out_features", type=int, default=14336)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of the speed vs bf16 (needs matplotlib)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_linear.py needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(a.out_features, a.in_features, device="cuda") / a.in_features ** 0.5).bfloat16().requires_grad_()
    gy = torch.randn(a.tokens, a.out_features, device="cuda", dtype=torch.bfloat16)
    flops = 6 * a.tokens * a.in_features * a.out_features
    rows = []
    for name, fn in recipes().items():
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            f = torch.compile(fn) if mode == "compiled" else fn
            ms = time_fwd_bwd(f, x, w, gy, a.reps)
            rows.append({"recipe": name, "mode": mode, "ms": ms, "tflops": flops / ms / 1e9})
    base = {r["mode"]: r["ms"] for r in rows if r["recipe"] == "bf16"}
    for r in rows:
        r["speedup_vs_bf16"] = base[r["mode"]] / r["ms"]
    info = meta("cuda", shape=[a.tokens, a.in_features, a.out_features], reps=a.reps)
    table = ["| recipe | mode | fwd+bwd ms | TFLOP/s | vs bf16 |", "|---|---|---|---|---|"]
    table += [f"| {r['recipe']} | {r['mode']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['speedup_vs_bf16']:.2f}x |"
              for r in rows]
    print(json.dumps(info))
    write_results({"meta": info, "rows": rows}, table,
                  f"{info['gpu']}, torch {info['torch']}, tokens x in -> out = {info['shape']}", a.json, a.markdown)
    if a.plot and a.json:
        plot_results(a.json, a.plot)


if __name__ == "__main__":
    main()
