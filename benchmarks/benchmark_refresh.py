#!/usr/bin/env python
"""The optimizer step and the weight cache's refresh of a Llama-8B model's weights, torch's way and LowBitAdamW's.

    python benchmarks/benchmark_refresh.py --json OUT/refresh_h200.json --markdown OUT/refresh_h200.md

Issue 25: with the weight cache on (gradient accumulation, or ``lowbit_weight_cache``) each low-bit weight is
updated by torch's fused AdamW and then re-quantized by the rows kernel, which reads it twice (absmax, then encode).
``LowBitAdamW`` (``lowbit_fused_adamw``) updates it with one Triton kernel that also leaves each row's absmax
(:func:`hf_lowbit.kernels.adamw.adamw_rows_`), and the refresh reads the weight once (``quantize_weight(...,
row_amax=...)``). Per weight shape of a Llama-8B decoder layer (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096,
down 4096x14336), bf16 weights, gradients and moments, INT8 and FP8: the GPU time of each part per call
(``benchmarks.driver.kernel_us``: replayed from a CUDA graph; torch's AdamW step, which its ``capturable=False``
keeps out of graphs, by ``triton.testing.do_bench``, said in the table), torch's path
(``torch.optim.AdamW(fused=True).step()`` + ``quantize_weight``) beside ours, and the GB/s of each part's least
traffic (AdamW: 14 bytes an element; the refresh: 6 with the absmax pass, 4 without). Each of our refreshes is
checked bit for bit against ``quantize_weight`` of the weight it left (on a CPU both are plain torch: the kernels'
bits are tests/_triton_checks.py's). Beside them the kernel as LowBitAdamW runs it on every other parameter of
>= 2**20 elements (no absmax, rows of 1024 elements: "AdamW alone"), and the embedding / LM head shape of the
regimes' model (32000x4096, untied). A layer's totals weight each shape by its count; a step of the regimes' 8
layers is 8 of them, and with the embedding and the head the whole optimizer step there (torch's fused AdamW took
10.5 ms of it in the regimes' profiles). ``--device cpu`` with ``--scale`` smoke-tests the plumbing under Triton's
interpreter (``TRITON_INTERPRET=1``; timings meaningless).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = (("q, o", (4096, 4096), 2), ("k, v", (1024, 4096), 2), ("gate, up", (14336, 4096), 2),
          ("down", (4096, 14336), 1))
# the rest of the regimes' model that LowBitAdamW's kernel takes (parameters of >= 2**20 elements): the embedding and
# the untied LM head (vocab 32000); with the 8 layers, the optimizer's whole step there (10.5 ms with torch's fused
# AdamW in the profiles)
MODEL_SHAPES = (("embedding, LM head", (32000, 4096), 2),)
LAYERS = 8
def measure(fmt: str, shape: tuple[int, int], a) -> dict:
    import torch

    from benchmarks.driver import kernel_us
    from hf_lowbit.kernels import get_format, quantize_weight
    from hf_lowbit.kernels.adamw import adamw_rows_
    from hf_lowbit.mixed_precision.adamw import _pieces

    R, K = (max(16, s // a.scale) for s in shape)
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda s: (torch.randn(R, K, generator=gen) * s).to(a.device, torch.bfloat16)  # noqa: E731
    f = get_format(fmt)
    bufs = lambda: (torch.empty(R, K, dtype=f.dtype, device=a.device),  # noqa: E731
                    torch.empty(R, dtype=torch.float32, device=a.device),
                    torch.empty(K, R, dtype=f.dtype, device=a.device))
    # torch's path: its fused AdamW on the weight, then the rows kernel's refresh
    theirs = torch.nn.Parameter(make(0.02))
    theirs.grad = make(1e-3)
    opt = torch.optim.AdamW([theirs], lr=1e-5, fused=a.device == "cuda")
    cache_t = bufs()
    # ours: the one-pass kernel with the row absmax, then the refresh from it
    p, g, m, v = make(0.02), make(1e-3), torch.zeros(R, K, dtype=torch.bfloat16, device=a.device), \
        torch.zeros(R, K, dtype=torch.bfloat16, device=a.device)
    amax = torch.empty(R, dtype=torch.int32, device=a.device)
    cache_o = bufs()
    steps = [0]

    def ours_adamw():
        steps[0] += 1
        adamw_rows_(p, g, m, v, steps[0], lr=1e-5, row_amax=amax)

    # the kernel as LowBitAdamW runs it on a parameter it does not refresh: no absmax, rows of 1024 elements
    pieces = [_pieces(t) for t in (make(0.02), make(1e-3), torch.zeros_like(p), torch.zeros_like(p))]

    def plain_adamw():
        steps[0] += 1
        for parts_ in zip(*pieces):
            adamw_rows_(*parts_, steps[0], lr=1e-5)

    parts = {"torch_adamw": opt.step,
             "rows_refresh": lambda: quantize_weight(fmt, theirs.detach(), out=cache_t),
             "ours_adamw": ours_adamw,
             "plain_adamw": plain_adamw,
             "amax_refresh": lambda: quantize_weight(fmt, p, out=cache_o, row_amax=amax)}
    for _ in range(a.warmup):  # compiles the kernels, fills the moments
        for fn in parts.values():
            fn()
    row = {"fmt": fmt, "shape": [R, K], "elements": R * K}
    for name, fn in parts.items():  # the GPU alone (CUDA graphs; torch's uncapturable step by do_bench, recorded)
        us, how = kernel_us(fn, a.device)
        row[f"{name}_gpu_ms"], row[f"{name}_timed_by"] = us / 1e3, how
    sweep = {}
    for tiles in (a.tiles or []):  # the one-pass kernel at other tiles (the same bits: elementwise, then a row max)
        def fn(tiles=tiles):
            steps[0] += 1
            adamw_rows_(p, g, m, v, steps[0], lr=1e-5, row_amax=amax, tiles=tiles)
        sweep["x".join(map(str, tiles))] = kernel_us(fn, a.device)[0] / 1e3
    if sweep:
        row["adamw_tiles_gpu_ms"] = sweep
    ours_adamw()
    parts["amax_refresh"]()
    want = quantize_weight(fmt, p)
    bits = (lambda t: t.view(torch.uint8)) if f.dtype != torch.int8 else (lambda t: t)
    row["refresh_bits_equal"] = all(torch.equal(bits(x), bits(y)) if x.dtype == f.dtype else torch.equal(x, y)
                                    for x, y in zip(cache_o, want))
    n = R * K
    for name, per in (("torch_adamw", 14), ("ours_adamw", 14), ("plain_adamw", 14), ("rows_refresh", 6),
                      ("amax_refresh", 4)):
        row[f"{name}_gbs"] = per * n / (row[f"{name}_gpu_ms"] * 1e6)
    return row


def _paths(r: dict) -> tuple[float, float]:
    """GPU ms of torch's path (its AdamW + the rows refresh) and of ours (the one-pass kernel + the refresh)."""
    return r["torch_adamw_gpu_ms"] + r["rows_refresh_gpu_ms"], r["ours_adamw_gpu_ms"] + r["amax_refresh_gpu_ms"]


def table(rows: list[dict]) -> list[str]:
    head = ["format", "weight (count)", "shape", "torch AdamW GPU ms (GB/s)", "rows refresh GPU ms (GB/s)",
            "ours AdamW + absmax GPU ms (GB/s)", "refresh from absmax GPU ms (GB/s)", "GPU: ours / torch's",
            "ours AdamW alone GPU ms (GB/s)", "torch AdamW timed by", "refresh bits equal"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cell = lambda k: f"{r[k + '_gpu_ms']:.3f} ({r[k + '_gbs']:,.0f})"  # noqa: E731
        theirs, ours = _paths(r)
        out.append(f"| {r['fmt']} | {r['name']} ({r['count']} a {r['per']}) | {r['shape'][0]}x{r['shape'][1]} | "
                   f"{cell('torch_adamw')} | {cell('rows_refresh')} | {cell('ours_adamw')} | {cell('amax_refresh')} | "
                   f"{ours / theirs:.3f} | {cell('plain_adamw')} | {r['torch_adamw_timed_by']} | "
                   f"{r['refresh_bits_equal']} |")
    keys = ("torch_adamw_gpu_ms", "rows_refresh_gpu_ms", "ours_adamw_gpu_ms", "amax_refresh_gpu_ms",
            "plain_adamw_gpu_ms")
    for fmt in dict.fromkeys(r["fmt"] for r in rows):
        mine = [r for r in rows if r["fmt"] == fmt and r["per"] == "layer"]
        total = {k: sum(r[k] * r["count"] for r in mine) for k in keys}
        theirs, ours = _paths(total)
        out.append(f"| {fmt} | **a layer** | | {total['torch_adamw_gpu_ms']:.3f} | {total['rows_refresh_gpu_ms']:.3f} | "
                   f"{total['ours_adamw_gpu_ms']:.3f} | {total['amax_refresh_gpu_ms']:.3f} | {ours / theirs:.3f} "
                   f"({LAYERS} layers: {LAYERS * theirs:.2f} -> {LAYERS * ours:.2f} ms) | "
                   f"{total['plain_adamw_gpu_ms']:.3f} | | |")
        rest = [r for r in rows if r["fmt"] == fmt and r["per"] == "model"]
        if rest:  # AdamW alone over the regimes' model: torch's fused step against the kernel on every large one
            step = {k: LAYERS * total[k] + sum(r[k] * r["count"] for r in rest) for k in keys}
            out.append(f"| {fmt} | **AdamW a step of the regimes' model** ({LAYERS} layers + "
                       f"{', '.join(r['name'] for r in rest)}) | | {step['torch_adamw_gpu_ms']:.2f} | | | | "
                       f"{step['plain_adamw_gpu_ms'] / step['torch_adamw_gpu_ms']:.3f} (the kernel alone) | "
                       f"{step['plain_adamw_gpu_ms']:.2f} | | |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="int8,fp8")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--scale", type=int, default=1, help="divide every shape by this (CPU smoke runs)")
    p.add_argument("--tiles", default="",
                   help="also time the one-pass AdamW kernel at these (BLOCK_R, BLOCK_K, num_warps), e.g. "
                        "'4x256x4,16x256x8,8x512x8' (its default: hf_lowbit.kernels.adamw._TILES)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    try:
        a.tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",") if t]
    except ValueError:
        raise SystemExit(f"--tiles {a.tiles}: give BLOCK_RxBLOCK_KxWARPS triples, e.g. 16x256x8") from None
    if any(len(t) != 3 for t in a.tiles):
        raise SystemExit(f"--tiles {a.tiles}: give BLOCK_RxBLOCK_KxWARPS triples, e.g. 16x256x8")
    import torch

    from benchmarks.driver import meta, require_device, write_results

    require_device(a.device, "benchmark_refresh.py", "--device cpu --scale 64")
    rows = []
    for fmt in a.formats.split(","):
        for per, shapes in (("layer", SHAPES), ("model", MODEL_SHAPES)):
            for name, shape, count in shapes:
                rows.append({"name": name, "count": count, "per": per, **measure(fmt, shape, a)})
                print(rows[-1], flush=True)
    data = {"meta": meta(a.device if a.device == "cuda" else "cpu", warmup=a.warmup, scale=a.scale),
            "rows": rows}
    header = (f"{data['meta'].get('gpu')}, torch {torch.__version__}: AdamW + the weight cache's refresh per weight "
              f"of a Llama-8B layer and of the regimes' embedding / LM head (bf16), torch's fused AdamW + the rows "
              f"kernel against LowBitAdamW's kernel + the refresh from its row absmax, and that kernel alone (as on "
              f"a parameter it does not refresh); GPU ms per call")
    lines = table(rows)
    swept = [r for r in rows if r.get("adamw_tiles_gpu_ms")]
    if swept:
        configs = list(swept[0]["adamw_tiles_gpu_ms"])
        lines += ["", "The one-pass AdamW kernel at other tiles (`--tiles`; GPU ms per call; the default's in the first "
                  "column):", "", "| format | weight | default | " + " | ".join(configs) + " |",
                  "|" + "---|" * (3 + len(configs))]
        lines += [f"| {r['fmt']} | {r['name']} | {r['ours_adamw_gpu_ms']:.3f} | "
                  + " | ".join(f"{r['adamw_tiles_gpu_ms'][c]:.3f}" for c in configs) + " |" for r in swept]
    write_results(data, lines, header, a.json, a.markdown)
    if not all(r["refresh_bits_equal"] for r in rows):
        raise SystemExit("a refresh from the kernel's absmax differs from quantize_weight's: see the table")


if __name__ == "__main__":
    main()
