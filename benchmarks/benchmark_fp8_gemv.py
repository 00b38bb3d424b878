#!/usr/bin/env python
"""FP8 row-wise linear at decode (M = 1 and 8 rows): our Triton GEMV's designs vs torchao's path vs bf16 ``F.linear``.

    python benchmarks/benchmark_fp8_gemv.py --json docs/results/fp8_gemv_h200.json \
        --markdown docs/results/fp8_gemv_h200.md

For each of a Llama-8B layer's weight shapes and its LM heads ([out, in]: 4096x4096 q/o, 1024x4096 k/v, 14336x4096
gate/up, 4096x14336 down, 32000x4096 and 128256x4096), GPU time (ten calls captured in a CUDA graph and replayed,
median of ten replays: ``benchmarks.driver.graph_ms``; ``triton.testing.do_bench`` for a call that cannot be
captured, said in the row's ``timing``) of:

* ``fused``: ``hf_lowbit.kernels.triton_fp8_gemv.fp8_gemv_triton(design="fused")``, the first design (the
  activation quantized inside the GEMV, the dot at every M, the absmax in the GEMV up to 4 rows; H200 tiles, split
  K chosen per shape), launched directly as Inductor's generated code launches it; ``fused_alt_amax``: the same
  with the other absmax choice (scale kernel first at M = 1, in the GEMV at M = 8);
* ``codes``: ``design="codes"``: the activation quantized once by the row kernel (codes + scales), the GEMV
  streaming the weight, row sums in float32 at M = 1 and the dot above; ``codes_dot`` (M = 1 only): the same
  with the dot at M = 1 too;
* ``scaled_mm``: torchao's arithmetic as the compiled export runs it: the row quantization compiled (Inductor fuses
  it) and ``torch._scaled_mm`` with row-wise scales and fast accumulation;
* ``torchao``: ``F.linear`` with torchao's own ``Float8Tensor`` weight (its eager kernels), when torchao quantizes;
* ``bf16``: ``F.linear`` on the bf16 weight.

GB/s counts the weight's bytes only (1 a weight for FP8, 2 for bf16): the traffic that bounds a decode step (H200:
~4.8 TB/s). The table's last columns: the faster design against bf16 and ``scaled_mm`` (which one: ``best``).
``--sweep`` adds the ``codes`` design at other tiles (``CODES_SWEEP``: row sums at M = 1, the dot above;
``codes_{BLOCK_N}x{BLOCK_K}_w{warps}_s{stages}``, stages 1 = plain loads, no cp.async). Each row records the
op's default design's error against ``scaled_mm`` (relative Frobenius norm). ``--device cpu``
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


DESIGN_METHODS = ("fused", "fused_alt_amax", "codes", "codes_dot")
# --sweep: the "codes" design's (BLOCK_N, BLOCK_K, num_warps, num_stages) beside its H200 defaults
# (triton_fp8_gemv.H200_CODES_TILES), keyed 1 (M = 1: row sums, 64 float32 accumulators a thread in each) or 16
# (M > 1: the dot); num_stages 1: plain ld.global.v4 loads, else cp.async steps in flight (num_stages - 1)
CODES_SWEEP = (
    (1, (16, 512, 4, 4)), (1, (64, 256, 8, 4)), (1, (32, 512, 8, 4)), (1, (64, 128, 4, 6)), (1, (32, 256, 4, 1)),
    (1, (32, 256, 4, 6)), (1, (128, 128, 8, 4)), (1, (16, 256, 2, 6)),
    (16, (64, 256, 4, 4)), (16, (64, 128, 4, 6)), (16, (128, 256, 8, 3)), (16, (64, 512, 4, 3)),
)


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
        def fp8_gemv_triton(x, w, s, **kwargs):  # the op's CPU path: the float32 reference
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
            cases = {"fused": (lambda: fp8_gemv_triton(x, q_w, s_w, design="fused"), n * k),
                     "fused_alt_amax": (lambda: fp8_gemv_triton(x, q_w, s_w, design="fused", pre_scale=alt), n * k),
                     "codes": (lambda: fp8_gemv_triton(x, q_w, s_w, design="codes"), n * k)}
            if m == 1:
                cases["codes_dot"] = (lambda: fp8_gemv_triton(x, q_w, s_w, design="codes", use_dot=True), n * k)
            cases.update({"scaled_mm": (lambda: scaled_mm(x, q_w, s_w), n * k),
                          "bf16": (lambda: F.linear(x, w), 2 * n * k)})
            if wt is not None:
                cases["torchao"] = (lambda: F.linear(x, wt), n * k)
            if sweep and device == "cuda":  # each tile config with the split-K heuristic for its BLOCK_N
                for kind, (bn, bk, nw, ns) in CODES_SWEEP:
                    if (kind == 1) != (m == 1):
                        continue
                    cases[f"codes_{bn}x{bk}_w{nw}_s{ns}"] = (
                        lambda bn=bn, bk=bk, nw=nw, ns=ns: fp8_gemv_triton(
                            x, q_w, s_w, design="codes", block_n=bn, block_k=bk, num_warps=nw, num_stages=ns), n * k)
            ref = scaled_mm(x, q_w, s_w).float()
            rel = lambda y: ((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()  # noqa: E731
            default_err = rel(fp8_gemv_triton(x, q_w, s_w))
            for name, (fn, nbytes) in cases.items():
                # a design's own error against scaled_mm; the other methods' rows: the op's default design's
                err = rel(fn()) if name in DESIGN_METHODS or name.startswith("codes_") else default_err
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
    out = ["| weight [out, in] | M | " + " | ".join(f"{m} µs (GB/s)" for m in methods) + " | best | best vs bf16 | "
           "best vs scaled_mm | codes vs fused |", "|---|---|" + "---|" * (len(methods) + 4)]
    for shape, m in dict.fromkeys((tuple(r["shape"]), r["m"]) for r in rows):
        sel = {r["method"]: r for r in rows if tuple(r["shape"]) == shape and r["m"] == m}
        cells = [f"{sel[x]['us']:.1f} ({sel[x]['gb_s']:.0f})" if x in sel else "–" for x in methods]
        ratio = lambda a, b: f"{sel[b]['us'] / sel[a]['us']:.2f}x" if a in sel and b in sel else "–"  # noqa: E731
        designs = [x for x in sel if x in DESIGN_METHODS or x.startswith("codes_")]
        best = min(designs, key=lambda x: sel[x]["us"]) if designs else None
        out.append(f"| {shape[0]} x {shape[1]} | {m} | " + " | ".join(cells) + f" | {best or '–'} | "
                   f"{ratio(best, 'bf16')} | {ratio(best, 'scaled_mm')} | {ratio('codes', 'fused')} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation rows M, comma-separated (<= 16)")
    p.add_argument("--sweep", action="store_true", help="also time the codes design at the CODES_SWEEP tiles")
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
