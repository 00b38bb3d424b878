#!/usr/bin/env python
"""A Llama-8B MLP's SwiGLU with its row quantizations: Inductor's fusion against hf_lowbit's Triton kernels.

    python benchmarks/benchmark_swiglu.py --json OUT/swiglu_h200.json --markdown OUT/swiglu_h200.md

Issue 25: in the recorded 8x2048 profile (``layers_b8_cast``) Inductor's SwiGLU kernels that also quantize their
outputs per token ran at ~2x their traffic floor (backward 1.40 ms a call against bf16's 0.54 and a floor of 0.65;
forward 0.69 against 0.32 / 0.38). Here, at 2048 and 16384 tokens x 14,336 (bf16), GPU time per call
(``benchmarks.driver.kernel_us``: replayed from a CUDA graph) of:

- forward, ``h = silu(g) * u`` and ``h``'s row codes: ``bf16`` (the SwiGLU alone, compiled: no quantization),
  ``inductor`` (the recipe's plain torch, compiled: what the low-bit layers run today), ``inductor_mk`` (the same
  with ``triton.multi_kernel=1``: Inductor's persistent variant of the reduction, picked by timing), ``ours`` (the
  op ``hf_lowbit::swiglu_quant``'s kernel at each ``--tiles``);
- backward, ``dg``, ``du`` and the row codes of ``dg·diag(s_g)``, ``du·diag(s_u)`` (the gate / up input gradients'
  operands): the same four;
- the column side of the weight gradients (``h``, ``dg``, ``du`` quantized per column for ``dW``): today
  ``quantize_t`` of each (an absmax pass + an encode pass) after ours, against ours with ``col_amax`` (the column
  absmax taken in the kernel by atomics; ``hf_lowbit.mixed_precision.swiglu.COL_AMAX``) + the encode pass alone.

Each of ours is checked against the plain-torch reference: codes and scales bit for bit given its own SwiGLU values,
and those values against Inductor's (the count of elements that differ, by one step of bf16 where the GPU's ``exp``
does). GB/s: each path's least traffic (forward 7 bytes an element, backward 12). ``--device cpu --scale 256`` under
``TRITON_INTERPRET=1`` smoke-tests the plumbing (timings meaningless; no ``torch.compile`` there: Inductor's paths
run eagerly).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

N = 14336  # a Llama-8B MLP's intermediate size
FWD_BYTES, BWD_BYTES = 7, 12  # least traffic an element: g, u in, h and codes out; dh, g, u in, dg, du, 2 codes out
DEFAULT_TILES = "1x1024x4,1x2048x8,2x2048x8,4x1024x8,1x16384x16,1x16384x32"
COL_TILES = "8x512x8,16x256x8,32x128x8"  # ours with col_amax: many rows a program (one atomic per column per program)


def _inputs(M: int, n: int, device: str):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda s: (torch.randn(M, n, generator=gen) * s).to(device, torch.bfloat16)  # noqa: E731
    g, u, dh = make(2.0), make(1.0), make(1e-3)
    mg = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(device)  # a weight's row scales: absmax / qmax
    mu = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(device)
    return g, u, dh, mg, mu


def _torch_paths(fmt: str, compile_: bool, multi_kernel: bool):
    """The recipe's plain torch of both directions (as the decoder layer and its autograd compute them)."""
    import torch
    import torch.nn.functional as F

    from hf_lowbit.kernels import FORMATS

    f = FORMATS[fmt]

    def fwd_bf16(g, u):
        return F.silu(g) * u

    def fwd_q(g, u):
        h = F.silu(g) * u
        q, s = f.quantize(h, dim=1)
        return h, q, s

    def bwd_bf16(dh, g, u):
        return torch.ops.aten.silu_backward(dh * u, g), dh * F.silu(g)

    def bwd_q(dh, g, u, mg, mu):
        dg, du = bwd_bf16(dh, g, u)
        qg, sg = f.quantize(dg.float() * mg, dim=1)
        qu, su = f.quantize(du.float() * mu, dim=1)
        return dg, du, qg, sg, qu, su

    fns = dict(fwd_bf16=fwd_bf16, fwd_q=fwd_q, bwd_bf16=bwd_bf16, bwd_q=bwd_q)
    if not compile_:
        return fns
    opts = {"triton.multi_kernel": 1} if multi_kernel else None
    return {k: torch.compile(fn, dynamic=False, options=opts) for k, fn in fns.items()}


def _row_codes(f, vals):
    """``Format.quantize(vals, dim=1)`` with the scale divided by a tensor: eager CUDA torch divides a tensor by a
    Python number as a multiply by its reciprocal (one ulp off in some rows: the 0232f11 run's false mismatches)."""
    import torch

    amax = vals.float().abs().amax(1, keepdim=True)
    scale = amax.clamp(min=1e-30) / torch.full_like(amax, f.qmax)
    return f.encode(vals, scale), scale.reshape(-1)


def _bits(t):
    import torch

    return t.view(torch.uint8) if t.dtype not in (torch.int8, torch.float32, torch.int32) else t


def measure(fmt: str, M: int, a) -> list[dict]:
    import torch

    from benchmarks.driver import kernel_us
    from hf_lowbit.kernels import FORMATS, quantize_t
    from hf_lowbit.kernels.triton_quant import quantize_t_triton
    from hf_lowbit.kernels.triton_swiglu import swiglu_backward_quant_triton, swiglu_quant_triton

    f = FORMATS[fmt]
    n = max(16, N // a.scale)
    g, u, dh, mg, mu = _inputs(M, n, a.device)
    cuda = a.device == "cuda"
    base = {"fmt": fmt, "tokens": M, "width": n}
    rows = []

    def time(direction: str, impl: str, fn, tiles: str = "", **more):
        us, how = kernel_us(fn, a.device)
        per = FWD_BYTES if direction == "forward" else BWD_BYTES
        rows.append({**base, "direction": direction, "impl": impl, "tiles": tiles, "gpu_ms": us / 1e3,
                     "timed_by": how, "floor_gbs": per * M * n / (us * 1e3), **more})
        print(rows[-1], flush=True)

    inductor = _torch_paths(fmt, cuda, False)
    h_ind = inductor["fwd_q"](g, u)[0]
    dg_ind = inductor["bwd_q"](dh, g, u, mg, mu)[0]
    time("forward", "bf16", lambda: inductor["fwd_bf16"](g, u))
    time("forward", "inductor", lambda: inductor["fwd_q"](g, u))
    time("backward", "bf16", lambda: inductor["bwd_bf16"](dh, g, u))
    time("backward", "inductor", lambda: inductor["bwd_q"](dh, g, u, mg, mu))
    if cuda and not a.no_multi_kernel:
        mk = _torch_paths(fmt, True, True)
        time("forward", "inductor_mk", lambda: mk["fwd_q"](g, u))
        time("backward", "inductor_mk", lambda: mk["bwd_q"](dh, g, u, mg, mu))
    for t in a.tiles:
        name = "x".join(map(str, t))
        out = swiglu_quant_triton(g, u, f.dtype, f.qmax, tiles=t)
        want = _row_codes(f, out[0])  # the codes of our own h
        exact = torch.equal(_bits(out[1]), _bits(want[0])) and torch.equal(out[2], want[1])
        time("forward", "ours", lambda t=t: swiglu_quant_triton(g, u, f.dtype, f.qmax, tiles=t), name,
             codes_exact=exact, values_differ_from_inductor=int((out[0] != h_ind).sum()))
        out = swiglu_backward_quant_triton(dh, g, u, f.dtype, f.qmax, mg, mu, tiles=t)
        exact = all(torch.equal(_bits(x), _bits(y.reshape(x.shape))) for x, y in zip(
            out[2:6], (*_row_codes(f, out[0].float() * mg), *_row_codes(f, out[1].float() * mu))))
        time("backward", "ours", lambda t=t: swiglu_backward_quant_triton(dh, g, u, f.dtype, f.qmax, mg, mu, tiles=t),
             name, codes_exact=exact, values_differ_from_inductor=int((out[0] != dg_ind).sum()))
    # the column side: today quantize_t of h (forward) and of dg, du (backward) after ours; or each column absmax
    # taken in our kernel, then quantize_t's encode pass alone
    kw = {"variant": "atomic_rcp"}
    h = swiglu_quant_triton(g, u, f.dtype, f.qmax)[0]
    dg, du = swiglu_backward_quant_triton(dh, g, u, f.dtype, f.qmax, mg, mu)[:2]
    time("columns_forward", "quantize_t", lambda: quantize_t(h, fmt))
    time("columns_backward", "quantize_t", lambda: (quantize_t(dg, fmt), quantize_t(du, fmt)))

    def amax_exact(vals, amax):  # the kernel's column absmax, and quantize_t's bits from it in one read
        enc = quantize_t_triton(vals, f.dtype, f.qmax, col_amax=amax, **kw)
        return torch.equal(amax, (vals.float().view(torch.int32) & 0x7FFFFFFF).amax(0)) and \
            all(torch.equal(_bits(x), _bits(y)) for x, y in zip(enc, quantize_t(vals, fmt)))

    for t in a.col_tiles:
        name = "x".join(map(str, t))
        fo = swiglu_quant_triton(g, u, f.dtype, f.qmax, col_amax=True, tiles=t)
        time("forward", "ours_col_amax", lambda t=t: swiglu_quant_triton(g, u, f.dtype, f.qmax, col_amax=True, tiles=t),
             name, codes_exact=amax_exact(fo[0], fo[3]))
        time("columns_forward", "encode_only",
             lambda o=fo: quantize_t_triton(o[0], f.dtype, f.qmax, col_amax=o[3], **kw), name)
        out = swiglu_backward_quant_triton(dh, g, u, f.dtype, f.qmax, mg, mu, col_amax=True, tiles=t)
        time("backward", "ours_col_amax", lambda t=t: swiglu_backward_quant_triton(
            dh, g, u, f.dtype, f.qmax, mg, mu, col_amax=True, tiles=t), name,
             codes_exact=amax_exact(out[0], out[6]) and amax_exact(out[1], out[7]))
        time("columns_backward", "encode_only", lambda o=out: (
            quantize_t_triton(o[0], f.dtype, f.qmax, col_amax=o[6], **kw),
            quantize_t_triton(o[1], f.dtype, f.qmax, col_amax=o[7], **kw)), name)
    return rows


def table(rows: list[dict]) -> list[str]:
    head = ["format", "tokens", "direction", "bf16 (no quant) ms", "inductor ms", "inductor multi-kernel ms",
            "ours best ms (tiles)", "ours / inductor", "ours GB/s of floor", "codes exact", "values differing"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    key = lambda r: (r["fmt"], r["tokens"])  # noqa: E731
    for k in dict.fromkeys(key(r) for r in rows):
        mine = [r for r in rows if key(r) == k]
        for d in ("forward", "backward"):
            by = {r["impl"]: r for r in mine if r["direction"] == d and r["impl"] != "ours"}
            ours = [r for r in mine if r["direction"] == d and r["impl"] == "ours"]
            best = min(ours, key=lambda r: r["gpu_ms"])
            cell = lambda i: f"{by[i]['gpu_ms']:.3f}" if i in by else "–"  # noqa: E731
            out.append(f"| {k[0]} | {k[1]} | {d} | {cell('bf16')} | {cell('inductor')} | {cell('inductor_mk')} | "
                       f"{best['gpu_ms']:.3f} ({best['tiles']}) | {best['gpu_ms'] / by['inductor']['gpu_ms']:.2f} | "
                       f"{best['floor_gbs']:,.0f} | {all(r['codes_exact'] for r in ours)} | "
                       f"{max(r['values_differ_from_inductor'] for r in ours):,} |")
    out += ["", "Column side of the weight gradients (h, and dg and du, per column): quantize_t after our kernel (an "
            "absmax pass + an encode pass each), against our kernel with the column absmax + the encode pass alone "
            "(ms per layer call, the kernel included):", "",
            "| format | tokens | direction | ours + quantize_t | tiles | ours with col_amax + encode | codes exact |",
            "|---|---|---|---|---|---|---|"]
    for k in dict.fromkeys(key(r) for r in rows):
        mine = [r for r in rows if key(r) == k]
        for d in ("forward", "backward"):
            best = min((r for r in mine if r["direction"] == d and r["impl"] == "ours"), key=lambda r: r["gpu_ms"])
            qt = next(r for r in mine if r["direction"] == f"columns_{d}" and r["impl"] == "quantize_t")
            for r in (r for r in mine if r["direction"] == d and r["impl"] == "ours_col_amax"):
                enc = next(e for e in mine if e["direction"] == f"columns_{d}" and e["impl"] == "encode_only"
                           and e["tiles"] == r["tiles"])
                out.append(f"| {k[0]} | {k[1]} | {d} | {best['gpu_ms'] + qt['gpu_ms']:.3f} ({best['tiles']}) | "
                           f"{r['tiles']} | {r['gpu_ms'] + enc['gpu_ms']:.3f} | {r['codes_exact']} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="int8,fp8")
    p.add_argument("--tokens", default="2048,16384")
    p.add_argument("--tiles", default=DEFAULT_TILES, help="ours at these BLOCK_RxBLOCK_NxWARPS")
    p.add_argument("--col_tiles", default=COL_TILES, help="ours with col_amax at these")
    p.add_argument("--no_multi_kernel", action="store_true", help="skip Inductor's multi-kernel paths")
    p.add_argument("--scale", type=int, default=1, help="divide the width by this (CPU smoke runs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    for flag in ("tiles", "col_tiles"):
        try:
            tiles = [tuple(int(x) for x in t.split("x")) for t in getattr(a, flag).split(",") if t]
        except ValueError:
            tiles = []
        if not tiles or any(len(t) != 3 for t in tiles):
            raise SystemExit(f"--{flag} {getattr(a, flag)!r}: give BLOCK_RxBLOCK_NxWARPS triples, e.g. 1x2048x8")
        setattr(a, flag, tiles)
    import torch

    from benchmarks.driver import meta, require_device, write_results

    require_device(a.device, "benchmark_swiglu.py", "--device cpu --scale 256")
    rows = []
    for fmt in a.formats.split(","):
        for M in (int(t) // (a.scale if a.device == "cpu" else 1) for t in a.tokens.split(",")):
            rows += measure(fmt, max(M, 4), a)
    data = {"meta": meta(a.device if a.device == "cuda" else "cpu", scale=a.scale), "rows": rows}
    header = (f"{data['meta'].get('gpu')}, torch {torch.__version__}: a Llama-8B MLP's SwiGLU with its row "
              f"quantizations (bf16, width {max(16, N // a.scale)}), Inductor's fusion against hf_lowbit's kernels; "
              f"GPU ms per call")
    write_results(data, table(rows), header, a.json, a.markdown)
    if not all(r.get("codes_exact", True) for r in rows):
        raise SystemExit("a kernel's codes differ from the reference's: see the table")


if __name__ == "__main__":
    main()
