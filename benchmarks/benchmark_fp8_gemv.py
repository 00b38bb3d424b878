#!/usr/bin/env python
"""FP8 row-wise linear at decode (M = 1 and 8 rows): our Triton GEMV vs torchao's path vs bf16 ``F.linear``.

    python benchmarks/benchmark_fp8_gemv.py --json docs/results/fp8_gemv_h200.json \
        --markdown docs/results/fp8_gemv_h200.md

For each of a Llama-8B layer's weight shapes and its LM heads ([out, in]: 4096x4096 q/o, 1024x4096 k/v, 14336x4096
gate/up, 4096x14336 down, 32000x4096 and 128256x4096), GPU time (ten calls captured in a CUDA graph and replayed,
median of ten replays: ``benchmarks.driver.graph_ms``; ``triton.testing.do_bench`` for a call that cannot be
captured, said in the row's ``timing``) of:

* ``gemv``: ``hf_lowbit.kernels.triton_fp8_gemv.fp8_gemv_triton`` with its defaults (H200 tiles, split K chosen
  per shape, the absmax in the GEMV up to 4 rows), launched directly as Inductor's generated code launches it;
  ``gemv_alt_amax``: the same with the other absmax choice (scale kernel first at M = 1, in the GEMV at M = 8);
* ``scaled_mm``: torchao's arithmetic as the compiled export runs it: the row quantization compiled (Inductor fuses
  it) and ``torch._scaled_mm`` with row-wise scales and fast accumulation;
* ``torchao``: ``F.linear`` with torchao's own ``Float8Tensor`` weight (its eager kernels), when torchao quantizes;
* ``bf16``: ``F.linear`` on the bf16 weight.

GB/s counts the weight's bytes only (1 a weight for FP8, 2 for bf16): the traffic that bounds a decode step (H200:
~4.8 TB/s). ``--sweep`` adds the GEMV at other tiles (``SWEEP``; ``gemv_{BLOCK_N}x{BLOCK_K}_w{warps}_s{stages}``).
Each row records the GEMV's error against ``scaled_mm`` (relative Frobenius norm). ``--device cpu``
smoke-tests the script on tiny shapes (the op's CPU reference in place of the kernel; wall-clock times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (32000, 4096), (128256, 4096))
CPU_SHAPES = ((48, 64), (32, 160))
ROWS = (1, 8)


def _torchao_weight(w):
    """torchao's own row-wise FP8 weight for bf16 ``w`` (``Float8DynamicActivationFloat8WeightConfig(PerRow())``)."""
    from torch import nn
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight.data.copy_(w)
    quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return lin.weight


# --sweep: (BLOCK_N, BLOCK_K, num_warps, num_stages) beside the H200 default (64, 256, 4, 4)
SWEEP = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 512, 4, 3), (128, 256, 8, 3), (32, 512, 4, 4), (16, 512, 2, 4))


def bench(shapes, rows_m, device: str, sweep: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch._library.triton import set_wrap_triton_enabled

    from hf_lowbit.kernels.fp8_gemv import fp8_rowwise_linear, quantize_fp8_rows
    from hf_lowbit.kernels.triton_fp8_gemv import FUSE_AMAX_MAX_M

    from benchmarks.driver import kernel_us

    def timed(fn):
        return kernel_us(fn, device)

    if device == "cuda":
        from hf_lowbit.kernels.triton_fp8_gemv import fp8_gemv_triton

        def scaled_mm_fn(x, q_w, s_w):
            q, s = quantize_fp8_rows(x)
            return torch._scaled_mm(q, q_w.T, scale_a=s.reshape(-1, 1), scale_b=s_w.reshape(1, -1),
                                    out_dtype=x.dtype, use_fast_accum=True)

        torch._dynamo.config.recompile_limit = 64  # 12 (shape, M) pairs; after the first recompile shapes go dynamic
        scaled_mm = torch.compile(scaled_mm_fn)
    else:
        def fp8_gemv_triton(x, w, s, pre_scale=None):  # the op's CPU path: the float32 reference
            return fp8_rowwise_linear(x, w, s)

        def scaled_mm(x, q_w, s_w):
            return fp8_rowwise_linear(x, q_w, s_w)

    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        q_w, s_w = quantize_fp8_rows(w)  # torchao's weight codes and row scales (the same formula)
        wt = None
        if device == "cuda":
            try:
                wt = _torchao_weight(w)
            except Exception as e:  # noqa: BLE001 - the row says it is missing
                print(f"  torchao did not quantize {n}x{k}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        for m in rows_m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            alt = not (m > FUSE_AMAX_MAX_M)
            cases = {"gemv": (lambda: fp8_gemv_triton(x, q_w, s_w), n * k),
                     "gemv_alt_amax": (lambda: fp8_gemv_triton(x, q_w, s_w, pre_scale=alt), n * k),
                     "scaled_mm": (lambda: scaled_mm(x, q_w, s_w), n * k),
                     "bf16": (lambda: F.linear(x, w), 2 * n * k)}
            if wt is not None:
                cases["torchao"] = (lambda: F.linear(x, wt), n * k)
            if sweep and device == "cuda":  # each tile config with the split-K heuristic for its BLOCK_N
                for bn, bk, nw, ns in SWEEP:
                    cases[f"gemv_{bn}x{bk}_w{nw}_s{ns}"] = (
                        lambda bn=bn, bk=bk, nw=nw, ns=ns: fp8_gemv_triton(
                            x, q_w, s_w, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns), n * k)
            ref = scaled_mm(x, q_w, s_w).float()
            got = fp8_gemv_triton(x, q_w, s_w).float()
            err = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            for name, (fn, nbytes) in cases.items():
                try:
                    with set_wrap_triton_enabled(False):  # launch the kernels directly, as Inductor's code does
                        us, how = timed(fn)
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: said, not fatal
                    print(f"  {name} {n}x{k} M={m}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append({"shape": [n, k], "m": m, "method": name, "us": us, "gb_s": nbytes / us / 1e3,
                             "weight_bytes": nbytes, "timing": how, "rel_err_gemv_vs_scaled_mm": err})
                print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = ["| weight [out, in] | M | " + " | ".join(f"{m} µs (GB/s)" for m in methods) + " | gemv vs bf16 | "
           "gemv vs scaled_mm |", "|---|---|" + "---|" * (len(methods) + 2)]
    for shape, m in dict.fromkeys((tuple(r["shape"]), r["m"]) for r in rows):
        sel = {r["method"]: r for r in rows if tuple(r["shape"]) == shape and r["m"] == m}
        cells = [f"{sel[x]['us']:.1f} ({sel[x]['gb_s']:.0f})" if x in sel else "–" for x in methods]
        ratio = lambda a, b: f"{sel[b]['us'] / sel[a]['us']:.2f}x" if a in sel and b in sel else "–"  # noqa: E731
        out.append(f"| {shape[0]} x {shape[1]} | {m} | " + " | ".join(cells)
                   + f" | {ratio('gemv', 'bf16')} | {ratio('gemv', 'scaled_mm')} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation rows M, comma-separated (<= 16)")
    p.add_argument("--sweep", action="store_true", help="also time the GEMV at the SWEEP tile configs")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_fp8_gemv.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    from benchmarks.driver import meta, write_results

    rows_m = [int(m) for m in a.rows.split(",")]
    if any(not 1 <= m <= 16 for m in rows_m):
        raise SystemExit("--rows: the decode kernel takes 1..16 rows")
    rows = bench(SHAPES if a.device == "cuda" else CPU_SHAPES, rows_m, a.device, a.sweep)
    info = meta(a.device)
    write_results({"meta": info, "rows": rows}, table(rows),
                  f"FP8 row-wise decode linear, {info['gpu']}, torch {info['torch']}", a.json, a.markdown)


if __name__ == "__main__":
    main()
