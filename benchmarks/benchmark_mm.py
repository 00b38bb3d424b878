#!/usr/bin/env python
"""The low-bit matmul kernels and the quantization kernels, against bf16 and the copy bandwidth, one run each.

    python benchmarks/benchmark_mm.py --json docs/results/mm_h200.json --markdown docs/results/mm_h200.md
    python benchmarks/benchmark_mm.py --backends --sweep --quant --json docs/results/mm_backends_h200.json \\
        --markdown docs/results/mm_backends_h200.md

Every matmul of training in its layout (reduction dim contiguous, as the tensor cores need it):
  fwd    Y  = X·Wᵀ   (X reduced over dim 1, W over dim 1)
  dgrad  dX = dY·W   (dY over dim 1, W over dim 0)
  wgrad  dW = dYᵀ·X  (both over dim 0, the tokens)

Default (``--shapes``, ``--tokens`` 16384, median of CUDA events; ``--device cpu`` smoke-tests it): bf16
(torch.matmul on the same layout), the low-bit matmul op alone on pre-quantized operands, and quantize + matmul
compiled together (what training runs); then quantization alone in GB/s (bytes read + written) beside a
device-to-device copy measured in the same run.

``--backends`` (CUDA): which kernel should run each matmul of a Llama-8B-shaped decoder layer at fine-tuning
micro-batches (``--tokens``, default here 2048): on operands already quantized, cuBLAS bf16; our Triton INT8 kernel
with the scales in its epilogue (launched directly, after autotuning, as Inductor's generated code launches it);
cuBLAS INT8 (``torch._int_mm``) followed by the scale multiply, compiled together; cuBLAS FP8 row-wise
(``torch._scaled_mm``). GPU time only (10 calls captured in a CUDA graph, median of 10 replays: with events around
single calls a first run timed the Python launch as much as these ~0.1 ms kernels). ``--sweep``: also every tile
configuration in ``SWEEP`` (a superset of the kernel's autotune list) on each matmul, launched directly without the
autotuner, to see which tiles the list lacks. ``--quant``: also the quantization kernels on the shapes training
feeds them (``quantize_t`` on each weight-gradient operand, the weight cache's refresh of both layouts on each
weight), as the bandwidth of the bytes they must move (read once, write once).

``--quant_sweep`` (CUDA; ``--tokens`` default 2048): the quantization kernels' tiles and variants (``QUANT_SWEEP``)
on a Llama-8B layer's shapes, each candidate checked equal to the default path's output before it is timed (int8
codes; the activations also with fp8 codes, default against the atomic variants only); the best config per shape and
the one config per kernel kind with the least time over a layer, to pick defaults from.

``--dual`` (CUDA; ``--tokens`` default 2048): the output gradient's two quantizations on a Llama-8B layer's dY shapes
(``tokens x 4096 / 1024 / 14336``), today's pair (the compiled plain-torch row quantization of ``g * w_scale``, as
Inductor runs it for dX, then ``quantize_t_triton(g)`` for dW: three reads of g) against ``quantize_dual_triton``
(two reads) at each tile config of ``DUAL_SWEEP``, each checked equal to today's outputs before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import graph_ms, median_ms, meta, write_results  # noqa: E402
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


def layouts(a) -> None:
    """The default: each layout on LLM shapes, and quantization against the copy (see the module docstring)."""
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
    info = meta(a.device, key="device", tokens=a.tokens)
    table = ["| in x out | layout | recipe | ms | TFLOP/s | vs bf16 |", "|---|---|---|---|---|---|"]
    table += [f"| {r['shape']} | {r['layout']} | {r['recipe']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
              f"{r.get('vs_bf16', 1.0):.2f}x |" for r in rows]
    table += ["", "| kernel | ms | GB/s | vs copy |", "|---|---|---|---|"]
    table += [f"| {q['kernel']} | {q['ms']:.3f} | {q['gb_s']:.0f} | {q.get('vs_copy', 1.0):.2f} |" for q in quant]
    write_results({"meta": info, "matmuls": rows, "quantize": quant}, table,
                  f"{info['device']}, torch {info['torch']}, {a.tokens} tokens", a.json, a.markdown)


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
    import triton

    from hf_lowbit.kernels.triton_int8 import _configs, _int8_scaled_mm_kernel

    m, k = qa.shape
    n = qb.shape[0]
    out = torch.empty(m, n, device=qa.device, dtype=torch.bfloat16)
    listed = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
              for c in _configs()]
    res = {}
    for bm, bn, bk, w, st in dict.fromkeys(listed + SWEEP):
        def launch():
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            _int8_scaled_mm_kernel.fn[grid](qa, qb, sa, sb, out, sa, sa, m, n, k, 0, qa.stride(0), qa.stride(1),
                                            qb.stride(0), qb.stride(1), out.stride(0), out.stride(1), 0, 0, 0, 0,
                                            A_K_CONTIG=True, B_K_CONTIG=True, HAS_ADD=False, BLOCK_R=16,
                                            ADD_IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
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
    from hf_lowbit.kernels.triton_quant import quantize_t_triton

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


# --quant_sweep: tile configurations of the quantization kernels (issue 25). (BLOCK_M, BLOCK_N, num_warps) of the
# two-kernel path's partial absmax ("amax") and quantize ("quant") kernels (timed as their full cross), of the
# one-kernel column-strip variant ("fused"); (BLOCK_R, BLOCK_K, num_warps) of the row-wise weight-refresh kernel
# ("rows"). The first of amax and quant are today's defaults. Each config is one compile (~0.5 s), ~25 in all.
QUANT_SWEEP = {
    "amax": [(64, 64, 4), (128, 64, 4), (64, 128, 4), (32, 128, 4), (128, 128, 8)],
    "quant": [(128, 64, 8), (64, 64, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4)],
    "fused": [(64, 32, 4), (128, 32, 4), (64, 16, 2), (128, 64, 8), (256, 32, 8), (32, 64, 4)],
    "rows": [(16, 128, 4), (32, 128, 8), (8, 256, 4), (16, 256, 8), (32, 64, 4), (64, 64, 8)],
    # the two-pass variants from the kernels' sm_90 code (triton_quant's docstring): absmax merged by an atomic max
    # (no partials loop before each quantize tile's load) and, "atomic_rcp", one IEEE division per column instead of
    # per element; (amax tiles, quant tiles) pairs: today's defaults and the two-kernel sweep's best at 16384 tokens
    "atomic": [((64, 64, 4), (128, 64, 8)), ((32, 128, 4), (64, 64, 4))],
    "atomic_rcp": [((64, 64, 4), (128, 64, 8)), ((32, 128, 4), (64, 64, 4))],
}
# a Llama-8B layer's quantize_t calls by operand shape (the weight-gradient operands of its 7 linears: X of q, k, v,
# o, gate, up is [T, 4096], of down [T, 14336]; dY of q, o, down [T, 4096], of k, v [T, 1024], of gate, up
# [T, 14336]) and its weight refreshes by weight shape [out, in]: "best overall" weighs each shape by its count
QUANT_ACTS = {4096: ("X, dY", 9), 14336: ("X, dY", 3), 1024: ("dY", 2)}
QUANT_WEIGHTS = {(4096, 4096): ("W of q, o", 2), (1024, 4096): ("W of k, v", 2), (14336, 4096): ("W of gate, up", 2),
                 (4096, 14336): ("W of down", 1)}


def _cfg(t) -> str:
    return f"{t[0]}x{t[1]}w{t[2]}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (1-byte codes compared as bytes: torch.equal has no fp8 kernel everywhere)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements whose bits differ (NaN against NaN counts as equal; 1.0 if shape or dtype differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return 1.0
    if a.element_size() == 1:
        return (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
    return ((a != b) & ~(a.isnan() & b.isnan())).float().mean().item()


def _check_then_time(row: dict, fn, ref, time_fn, moved: int, mismatch: str | None = None,
                     time_unequal: bool = False) -> dict:
    """A sweep candidate: ``fn()``'s outputs checked bit-equal to ``ref`` first, then (if equal and ``time_fn``)
    timed, GB/s from ``moved`` bytes. A mismatch (``error``: ``mismatch``, if given; ``differ``: the fraction of
    each output's elements that differ) or an exception (a config that does not compile or run) is recorded in the
    row (``equal`` False), not timed unless ``time_unequal``."""
    try:
        out = fn()
        row["equal"] = all(_same(a, b) for a, b in zip(out, ref))
        if not row["equal"]:
            row["differ"] = [_differ(a, b) for a, b in zip(out, ref)]
        if not row["equal"] and mismatch:
            row["error"] = mismatch + " (element fractions: " + ", ".join(f"{d:.2e}" for d in row["differ"]) + ")"
        if (row["equal"] or time_unequal) and time_fn is not None:
            row["ms"] = time_fn(fn)
            row["gb_s"] = moved / row["ms"] / 1e6
    except Exception as e:  # noqa: BLE001 - record it, go on with the other candidates
        row.update(equal=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    return row


def _best_layer_config(timed: list[dict], need: dict, key, base: float, base_name: str) -> dict | None:
    """Of ``timed`` candidate rows, the config with the least layer-weighted time (``ms * count`` summed) over the
    shapes in ``need`` (key -> count), among configs timed on all of them; against ``base`` (the reference's
    layer time, recorded as ``base_name``). None if no config was timed on every shape."""
    per: dict = {}
    for r in timed:
        per.setdefault(r["config"], {})[key(r)] = r["ms"] * r["count"]
    full = {c: sum(v.values()) for c, v in per.items() if set(v) == set(need)}
    if not full:
        return None
    c = min(full, key=full.get)
    return {"config": c, "layer_ms": full[c], base_name: base, "speedup": base / full[c]}


def _error_lines(rows: list[dict], what: str, describe) -> list[str]:
    """The markdown line listing candidates that were not equal or failed (none: no line)."""
    errors = [r for r in rows if not r["equal"]]
    if not errors:
        return []
    return ["", f"{len(errors)} {what}, or failed (not timed): " + "; ".join(
        f"{describe(r)}: {r.get('error', 'not equal')}" for r in errors)]


def quant_candidates(kind: str, grid: dict = QUANT_SWEEP) -> list[tuple[str, str, dict]]:
    """``(variant, config name, quantize_t_triton keywords)`` of every candidate for an activation operand
    (``kind="act"``: the two-kernel cross, the fused variant and the atomic ones; ``"act_fp8"``, fp8 codes: the
    default and the atomic ones, each with the hardware cast and, ``*_soft``, the float32 rounding) or a weight refresh (``"weight"``: the default and the rows kernel). The first is
    today's default."""
    from hf_lowbit.kernels.triton_quant import _AMAX_TILES, _QUANT_TILES

    atomic = [(v, f"amax {_cfg(a)} / quant {_cfg(q)}", {"variant": v, "amax_tiles": a, "quant_tiles": q})
              for v in ("atomic", "atomic_rcp") for a, q in grid.get(v, [])]
    if kind == "act_fp8":  # the atomic variants' codes by the hardware cast (their default on CUDA) and by float32
        # rounding first ("_soft", fp8_cast="soft": what they ran before 2026-12-03; the CPU's only choice)
        soft = [(v + "_soft", c, {**kw, "fp8_cast": "soft"}) for v, c, kw in atomic]
        return [("two_kernel", f"default (amax {_cfg(_AMAX_TILES)} / quant {_cfg(_QUANT_TILES)})", {})] + atomic + soft
    if kind == "act":
        cands = [("two_kernel", f"amax {_cfg(a)} / quant {_cfg(q)}", {"amax_tiles": a, "quant_tiles": q})
                 for a in grid["amax"] for q in grid["quant"] if (a, q) != (_AMAX_TILES, _QUANT_TILES)]
        return [("two_kernel", f"default (amax {_cfg(_AMAX_TILES)} / quant {_cfg(_QUANT_TILES)})", {})] + cands + [
            ("fused", _cfg(t), {"variant": "fused", "tiles": t}) for t in grid["fused"]] + atomic
    return [("two_kernel", f"default (amax {_cfg(_AMAX_TILES)} / quant {_cfg(_QUANT_TILES)})", {})] + [
        ("rows", _cfg(t), {"variant": "rows", "tiles": t}) for t in grid["rows"]]


def quant_sweep_rows(tokens: int, device: str = "cuda", acts=QUANT_ACTS, weights=QUANT_WEIGHTS,
                     grid: dict = QUANT_SWEEP, time_fn=None) -> list[dict]:
    """Every candidate of :func:`quant_candidates` on each operand shape: its output checked equal (codes and
    scales, both layouts for weights) to the default path's on the same input, then timed with ``time_fn(fn)``
    (ms; None: not timed, the CPU smoke test). A mismatch or an error is a row with ``equal`` False (or
    ``error``) and no time."""
    from torch._library.triton import set_wrap_triton_enabled

    from hf_lowbit.kernels.fp8 import FP8_DTYPE, FP8_MAX
    from hf_lowbit.kernels.triton_quant import quantize_t_triton

    torch.manual_seed(0)
    rows = []
    jobs = [("act", (tokens, n), what, count) for n, (what, count) in acts.items()]
    # fp8 codes (float32 rounding cost the quantize kernel ~7-14 more instructions an element): default and atomic ones
    jobs += [("act_fp8", (tokens, n), what + " (fp8)", count) for n, (what, count) in acts.items()]
    jobs += [("weight", shape, what, count) for shape, (what, count) in weights.items()]
    for kind, shape, what, count in jobs:
        t = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        x = t.T if kind == "weight" else t  # the weight refresh quantizes w.T (per row of w, both layouts)
        qdtype, qmax = (FP8_DTYPE, FP8_MAX) if kind == "act_fp8" else (torch.int8, 127.0)
        extra = {"both_layouts": True} if kind == "weight" else {}
        moved = t.numel() * (4 if kind == "weight" else 3)  # bf16 read once, codes written once per layout
        with set_wrap_triton_enabled(False):  # launch directly: wrap_triton's eager dispatch is slower than these
            ref = quantize_t_triton(x, qdtype, qmax, **extra)
            for i, (variant, config, kw) in enumerate(quant_candidates(kind, grid)):
                row = {"tokens": tokens, "group": kind, "operand": what, "count": count, "shape": list(shape),
                       "variant": variant, "config": config, "default": i == 0,
                       "ms": None, "gb_s": None}
                fn = functools.partial(quantize_t_triton, x, qdtype, qmax, **extra, **kw)
                rows.append(_check_then_time(row, fn, ref, time_fn, moved))
                if time_fn is not None:
                    print({k: row[k] for k in ("shape", "variant", "config", "ms", "equal")}, flush=True)
    return rows


def quant_sweep_summary(rows: list[dict]) -> tuple[list[str], dict]:
    """A markdown table (per shape and variant: the best config, its speedup over today's default) and, per variant
    and operand group, the one config with the least layer-weighted time over all its shapes (``count`` calls of
    each shape per layer), the default to pick."""
    timed = [r for r in rows if r["ms"] is not None]
    key = lambda r: (r["group"], tuple(r["shape"]))  # noqa: E731 - at 4096 tokens X and W can both be 4096x4096
    default = {key(r): r for r in timed if r["default"]}
    table = ["| shape | operand | default ms | default GB/s | variant | best config | ms | GB/s | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in dict.fromkeys(key(r) for r in rows):
        d, shape = default.get(k), k[1]
        for variant in dict.fromkeys(r["variant"] for r in rows if key(r) == k):
            cand = [r for r in timed if key(r) == k and r["variant"] == variant]
            if not cand or d is None:
                continue
            b = min(cand, key=lambda r: r["ms"])
            table.append(f"| {'×'.join(map(str, shape))} | {b['operand']} | {d['ms']:.4f} | {d['gb_s']:,.0f} | "
                         f"{variant} | {b['config']} | {b['ms']:.4f} | {b['gb_s']:,.0f} | {d['ms'] / b['ms']:.2f}x |")
    best = {}
    for group, label in (("act", "activations"), ("act_fp8", "activations, fp8"), ("weight", "weights")):
        need = {key(r): r["count"] for r in rows if r["group"] == group}
        if not all(s in default for s in need):
            continue
        base = sum(default[s]["ms"] * c for s, c in need.items())
        for variant in dict.fromkeys(r["variant"] for r in rows if r["group"] == group):
            b = _best_layer_config([r for r in timed if r["group"] == group and r["variant"] == variant], need, key,
                                   base, "default_layer_ms")
            if b:
                best[f"{variant} ({label})"] = b
    table += ["", "Best overall config per kernel kind (the least time over a Llama-8B layer's calls, each shape "
              "weighted by its count per layer): " + "; ".join(
                  f"{k}: {v['config']}, {v['layer_ms']:.3f} ms vs the default's {v['default_layer_ms']:.3f} ms "
                  f"({v['speedup']:.2f}x)" for k, v in best.items())]
    table += _error_lines(rows, "candidates not equal to the default's output",
                          lambda r: f"{'×'.join(map(str, r['shape']))} {r['variant']} {r['config']}")
    return table, best


def quant_sweep(a) -> None:
    """``--quant_sweep``: each candidate of :data:`QUANT_SWEEP` on a Llama-8B layer's quantization shapes."""
    rows = quant_sweep_rows(a.tokens, time_fn=graph_ms)
    table, best = quant_sweep_summary(rows)
    info = meta("cuda", key="device", tokens=a.tokens, grid={k: [list(t) for t in v] for k, v in QUANT_SWEEP.items()})
    write_results({"meta": info, "rows": rows, "best": best}, table, f"{info['device']}, torch {info['torch']}, "
                  f"{a.tokens} tokens, quantization kernels' tiles", a.json, a.markdown)


# --dual (issue 25): (BLOCK_M, BLOCK_N, num_warps) of quantize_dual_triton's absmax pass and encode pass, timed as
# their full cross; the first of each is the default. A Llama-8B layer's dY shapes by width (count per layer).
DUAL_SWEEP = {"amax": [(64, 64, 4), (32, 128, 4), (64, 128, 8), (128, 64, 8)],
              "quant": [(64, 64, 4), (128, 64, 8), (64, 128, 8), (32, 128, 4)]}
DUAL_SHAPES = {4096: ("dY of q, o, down", 3), 1024: ("dY of k, v", 2), 14336: ("dY of gate, up", 2)}


def dual_candidates(grid: dict = DUAL_SWEEP) -> list[tuple[str, dict]]:
    """``(config name, quantize_dual_triton keywords)`` of every tile config; the first is the default."""
    from hf_lowbit.kernels.triton_quant import _DUAL_AMAX_TILES, _DUAL_QUANT_TILES

    cands = [(f"default (amax {_cfg(_DUAL_AMAX_TILES)} / quant {_cfg(_DUAL_QUANT_TILES)})", {})]
    return cands + [(f"amax {_cfg(a)} / quant {_cfg(q)}", {"amax_tiles": a, "quant_tiles": q})
                    for a in grid["amax"] for q in grid["quant"] if (a, q) != (_DUAL_AMAX_TILES, _DUAL_QUANT_TILES)]


def quant_dual_rows(tokens: int, device: str = "cuda", shapes=DUAL_SHAPES, formats=("int8", "fp8"),
                    grid: dict = DUAL_SWEEP, time_fn=None, compile_rows: bool = True) -> list[dict]:
    """For each format and dY shape ``[tokens, n]``: today's pair (``kind="today"``: the plain-torch row
    quantization of ``g * mul``, compiled unless ``compile_rows`` is False, and ``quantize_t_triton(g)``; also
    each half alone; ``equal``: its outputs bit-equal to the references, the fraction of row codes that are not in
    ``row_codes_differ_from_cpu``) and every :func:`dual_candidates` config of ``quantize_dual_triton``
    (``kind="dual"``), whose four outputs are checked bit-equal to the references (plain-torch rows on the CPU,
    ``quantize_t_triton``) first. Timed with ``time_fn(fn)`` (ms; None: not timed, the CPU
    smoke test); a mismatch is a row with ``equal`` False, ``differ`` and ``error``, timed all the same; an error
    is not timed. GB/s counts
    the least traffic: g read once, both codes written once (``numel * (g's bytes + 2)``)."""
    from torch._library.triton import set_wrap_triton_enabled

    from hf_lowbit.kernels import get_format
    from hf_lowbit.kernels.triton_quant import quantize_dual_triton, quantize_t_triton

    torch.manual_seed(0)
    rows = []
    for fmt in formats:
        f = get_format(fmt)

        def rows_quant(g, mul, f=f):  # what Inductor fuses for the input gradient (scaled_matmul_input_grad)
            q, s = f.quantize(g.float() * mul.reshape(1, -1), dim=1)
            return q, s.reshape(-1)

        for n, (what, count) in shapes.items():
            g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
            mul = torch.rand(n, device=device) * 1e-3 + 1e-4  # a weight's row scales (absmax / qmax)
            moved = g.numel() * (g.element_size() + 2)
            base = {"tokens": tokens, "fmt": fmt, "shape": [tokens, n], "operand": what, "count": count}
            torch._dynamo.reset()
            rows_fn = torch.compile(rows_quant, dynamic=False) if compile_rows else rows_quant
            with set_wrap_triton_enabled(False):  # launch the Triton kernels directly (wrap_triton's eager dispatch)
                cols_fn = lambda: quantize_t_triton(g, f.dtype, f.qmax)  # noqa: E731
                today = lambda: (*rows_fn(g, mul), *cols_fn())  # noqa: E731
                # the references: plain torch on the CPU, whose divisions are IEEE-rounded as the kernels' are (on the
                # H200 eager CUDA's row scales differed by an ulp in ~6% of rows, its codes agreeing: its division by
                # the Python scalar qmax is not), and quantize_t_triton; today's compiled rows are compared with
                # them too (Inductor's row codes differed in ~1e-7 of codes at every real shape)
                ref = (*(t.to(device) for t in rows_quant(g.cpu(), mul.cpu())), *cols_fn())
                out = today()
                same = all(_same(a, b) for a, b in zip(out, ref))
                differ = (out[0].view(torch.uint8) != ref[0].view(torch.uint8)).float().mean().item()
                halves = (("rows + quantize_t", today), ("rows (compiled plain torch) alone", lambda: rows_fn(g, mul)),
                          ("quantize_t alone", cols_fn))
                for config, fn in halves:
                    row = {**base, "kind": "today", "config": config, "default": False, "equal": same,
                           "row_codes_differ_from_cpu": differ, "ms": None, "gb_s": None}
                    if time_fn is not None:
                        row["ms"] = time_fn(fn)
                        row["gb_s"] = moved / row["ms"] / 1e6 if fn is today else None
                    rows.append(row)
                for i, (config, kw) in enumerate(dual_candidates(grid)):
                    row = {**base, "kind": "dual", "config": config, "default": i == 0, "ms": None, "gb_s": None}
                    fn = lambda: quantize_dual_triton(g, f.dtype, f.qmax, mul, **kw)  # noqa: E731
                    rows.append(_check_then_time(row, fn, ref, time_fn, moved, "outputs differ from the CPU references",
                                                 time_unequal=True))
                    if time_fn is not None:
                        print({k: row[k] for k in ("fmt", "shape", "config", "ms", "equal")}, flush=True)
    return rows


def quant_dual_summary(rows: list[dict]) -> tuple[list[str], dict]:
    """A markdown table (per format and shape: today's pair and its halves, the default and the best dual config,
    speedups over today's pair) and, per format, the one dual config with the least layer-weighted time over the
    shapes (``count`` per layer) against today's pair over the same shapes."""
    timed = [r for r in rows if r["ms"] is not None]
    key = lambda r: (r["fmt"], tuple(r["shape"]))  # noqa: E731
    today = {key(r): r for r in timed if r["kind"] == "today" and r["config"] == "rows + quantize_t"}
    half = {(key(r), r["config"]): r["ms"] for r in timed if r["kind"] == "today"}
    table = ["| fmt | shape | operand | today ms (rows + quantize_t) | rows ms | quantize_t ms | today GB/s | "
             "dual default ms | best dual config | ms | GB/s | speedup |", "|---" * 12 + "|"]
    for k in dict.fromkeys(key(r) for r in rows):
        t = today.get(k)
        cand = [r for r in timed if key(r) == k and r["kind"] == "dual"]
        if t is None or not cand:
            continue
        b = min(cand, key=lambda r: r["ms"])
        d = next((r for r in cand if r["default"]), None)
        table.append(f"| {k[0]} | {'×'.join(map(str, k[1]))} | {t['operand']} | {t['ms']:.4f} | "
                     f"{half.get((k, 'rows (compiled plain torch) alone'), float('nan')):.4f} | "
                     f"{half.get((k, 'quantize_t alone'), float('nan')):.4f} | {t['gb_s']:,.0f} | "
                     f"{d['ms'] if d else float('nan'):.4f} | {b['config']} | {b['ms']:.4f} | {b['gb_s']:,.0f} | "
                     f"{t['ms'] / b['ms']:.2f}x |")
    best = {}
    for fmt in dict.fromkeys(r["fmt"] for r in rows):
        need = {key(r): r["count"] for r in rows if r["fmt"] == fmt}
        if not all(k in today for k in need):
            continue
        base = sum(today[k]["ms"] * c for k, c in need.items())
        b = _best_layer_config([r for r in timed if r["fmt"] == fmt and r["kind"] == "dual"], need, key, base,
                               "today_layer_ms")
        if b:
            best[fmt] = b
    table += ["", "Best dual config per format over a Llama-8B layer's dY quantizations (each shape weighted by its "
              "count per layer): " + "; ".join(
                  f"{k}: {v['config']}, {v['layer_ms']:.3f} ms vs today's {v['today_layer_ms']:.3f} ms "
                  f"({v['speedup']:.2f}x)" for k, v in best.items())]
    table += _error_lines([r for r in rows if r["kind"] == "dual"], "dual configs not equal to the CPU references "
                          "(timed all the same; fractions of row codes, row scales, column codes, column scales)",
                          lambda r: f"{r['fmt']} {'×'.join(map(str, r['shape']))} {r['config']}")
    pair = [r for r in rows if r["kind"] == "today" and r["config"] == "rows + quantize_t"]
    table += ["", "Today's compiled row codes vs plain torch on the CPU (fraction of codes that differ): " + "; ".join(
        f"{r['fmt']} {'×'.join(map(str, r['shape']))}: {r['row_codes_differ_from_cpu']:.2e}" for r in pair)]
    return table, best


def quant_dual(a) -> None:
    """``--dual``: today's two quantizations of dY against the dual kernels (:data:`DUAL_SWEEP`)."""
    rows = quant_dual_rows(a.tokens, formats=tuple(a.formats.split(",")), time_fn=graph_ms)
    table, best = quant_dual_summary(rows)
    info = meta("cuda", key="device", tokens=a.tokens, grid={k: [list(t) for t in v] for k, v in DUAL_SWEEP.items()})
    write_results({"meta": info, "rows": rows, "best": best}, table, f"{info['device']}, torch {info['torch']}, "
                  f"{a.tokens} tokens, dY quantized per row and per column: today's pair vs the dual kernels",
                  a.json, a.markdown)


def _int_mm_scaled(a, b_t, sa, sb):
    return (torch._int_mm(a, b_t).float() * sa[:, None] * sb[None, :]).to(torch.bfloat16)


def backends(a) -> None:
    """``--backends``: each matmul of a Llama-8B layer on each backend (see the module docstring)."""
    from hf_lowbit.kernels.fp8 import FP8_DTYPE
    from hf_lowbit.kernels.triton_int8 import int8_scaled_mm_triton

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
    info = meta("cuda", key="device", tokens=a.tokens, totals_ms=totals)
    write_results({"meta": info, "rows": rows, "quant": quant}, table, f"{info['device']}, torch {info['torch']}, "
                  f"{a.tokens} tokens", a.json, a.markdown)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", action="store_true", help="each matmul of a Llama-8B layer on each backend (CUDA)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per matmul (default 16384; --backends, --quant_sweep, --dual: 2048)")
    p.add_argument("--shapes", default="4096x4096,4096x1024,4096x14336,14336x4096", help="in x out, comma-separated")
    p.add_argument("--formats", default="int8,fp8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="--backends: also time every tile configuration of SWEEP")
    p.add_argument("--quant", action="store_true", help="--backends: also the quantization kernels on training's shapes")
    p.add_argument("--quant_sweep", action="store_true",
                   help="the quantization kernels' tiles and variants on a Llama-8B layer's shapes (CUDA; QUANT_SWEEP)")
    p.add_argument("--dual", action="store_true",
                   help="dY's row and column quantizations: today's pair vs the dual kernels (CUDA; DUAL_SWEEP)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the default mode)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    a.tokens = a.tokens or (2048 if a.backends or a.quant_sweep or a.dual else 16384)
    if (a.device == "cuda" or a.backends or a.quant_sweep or a.dual) and not torch.cuda.is_available():
        raise SystemExit("benchmark_mm.py needs a CUDA GPU (--device cpu only smoke-tests the default mode)")
    (quant_dual if a.dual else quant_sweep if a.quant_sweep else backends if a.backends else layouts)(a)


if __name__ == "__main__":
    main()
