"""hf_lowbit's int4 kernels against tinygemm and bf16, one linear at a time, GPU time alone (issue 26).

    python benchmarks/benchmark_int4.py --json OUT/int4_mm_h200.json --markdown OUT/int4_mm_h200.md

For each Llama-8B layer shape ``[out, in]`` (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336)
and the LM heads (32000 and 128256 x 4096), at M = 1 and 8 rows (``--ms``): ``ours`` (``hf_lowbit::int4_linear`` on our packed layout:
the first split-K GEMV, tinygemm's numerics), ``tile`` (``hf_lowbit::int4_tile_linear(decode="triton")``: the
tile GEMV reading tinygemm's own layout, the redesign), ``tinygemm`` (``aten._weight_int4pack_mm`` on torchao's tile-packed
weight of the same codes, what an int4_tinygemm export runs), ``bf16`` (``F.linear``, cuBLAS), and at M = 2048
(``--prefill``) the prefill path (``ours``: dequantize our layout + cuBLAS; ``tile``: dequantize tinygemm's tile
layout + cuBLAS, what ``Int4ServingLinear`` serves now). Each: µs (ten calls in one CUDA graph, replayed:
``benchmarks.driver.graph_ms``), and GB/s counted as the bytes a call must read (the weight as stored: int4 codes
+ bf16 scales and zeros, or bf16; plus x and y). Also the split-K factor ours chose, and the largest difference
of ours against tinygemm's output (the same weight: float32 sums in different orders). Also ``--sweep``: the
tile GEMV's tiles (BLOCK_N, BLOCK_K, warps, stages: ``TILE_SWEEP_TILES``) and split-K on each shape at M = 1, to
set ``TILE_DECODE_TILES``, and the same for the factored GEMVs (``FACTORED_TILES``, ``MMA_TILES``). ``factored``
(M = 1 only: ``int4_tile_linear(decode="triton_factored")``) is the tile layout's GEMV with the scale and zero taken
out of the sum, ~4.3 SASS instructions a code against the tile GEMV's 7.9 (``tools/int4_gemv_sass.py``); it does
not round the weight to bf16, so its difference from tinygemm includes the weights' bf16 rounding (reported beside
the others). ``mma`` (M ≤ 16: ``decode="triton_mma"``) forms tinygemm's bf16 weight and multiplies on tensor cores,
~3.3 a code, its products accumulated across steps without a wait. The defaults decide ``Int4ServingLinear``'s ``decode`` ("tinygemm" until ``tile`` is
faster at M = 1 and 8). ``gemlite`` (when installed: ``tools/device_prep.sh`` puts its wheel in ``.whl``; its
default "fast" autotune, ``--gemlite_autotune`` to change it) is the Triton int4 GEMV peer: ``GemLiteLinear`` (A16W4,
bf16) packed from the same codes, its zeros ``z - 8·scale`` so that it computes tinygemm's ``(q - 8)·scale + z``
(one more bf16 rounding of the zero term: its max diff is reported beside ours).
CUDA only: on a CPU it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (32000, 4096), (128256, 4096))


def _weights(N: int, K: int, gs: int):
    """Codes, scales and zeros (random, a trained weight's size) in our layout and as torchao's tinygemm weight."""
    import torch
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    from hf_lowbit.kernels.int4 import pack_int4

    q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.int32)
    s = (torch.rand(N, K // gs, device="cuda") * 0.01 + 1e-3).bfloat16()
    z = (torch.randn(N, K // gs, device="cuda") * 0.01).bfloat16()
    qdata = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(), 8)
    return pack_int4(q), s, z, qdata, pack_tinygemm_scales_and_zeros(s, z), q


def _gemlite(q, s, z, group_size: int):
    """gemlite's A16W4 linear on the same codes, or None where gemlite is not installed (the peer column is then
    left out). Packed in its fma mode (``W = q·scales + zeros``), whose zeros it derives as ``-zeros·scales``: they
    are overwritten with tinygemm's ``z - 8·scale`` after packing."""
    try:
        from gemlite import DType, GemLiteLinear
    except ImportError:
        return None
    import torch

    N, K = q.shape
    lin = GemLiteLinear(4, group_size=group_size, in_features=K, out_features=N, input_dtype=DType.BF16,
                        output_dtype=DType.BF16)
    lin.pack(q.to(torch.uint8), s, torch.zeros_like(s), None)
    with torch.no_grad():
        lin.zeros.copy_((z.float() - 8 * s.float()).to(lin.zeros.dtype).t())
    return lin


def bench(a) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.driver import graph_ms
    from hf_lowbit.kernels.int4 import int4_dequantize, int4_linear, int4_tile_linear
    from hf_lowbit.kernels.triton_int4 import (
        MMA_SWEEP_TILES,
        TILE_SWEEP_TILES,
        _TILE_MAX_SPLIT_K,
        _decode_tiles,
        _sms,
        _tile_decode_tiles,
        decode_split_k,
        int4_tile_decode_triton,
    )

    rows = []
    for N, K in a.shapes:
        if K % 1024:  # tinygemm's packing wants K a multiple of 1024 (torchao pads to it)
            print(f"skip {N}x{K}: K not a multiple of 1024", flush=True)
            continue
        packed, s, z, qdata, sz, q = _weights(N, K, a.group_size)
        gl = _gemlite(q, s, z, a.group_size)
        del q
        w_bf16 = int4_dequantize(packed, s, z, a.group_size)
        int4_bytes = packed.numel() + 2 * s.numel() + 2 * z.numel()
        for M in a.ms + ([a.prefill] if a.prefill else []):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            io = 2 * M * (K + N)
            ours = int4_linear(x, packed, s, z, a.group_size)
            tile = int4_tile_linear(x, qdata, sz, a.group_size, N, "triton")
            # our other GEMVs where they run (else their fallback, not timed): the factored one at one row, the
            # tensor-core one up to 16 rows
            ours_more = {name: decode for name, decode, ok in (("factored", "triton_factored", M == 1),
                                                                ("mma", "triton_mma", M <= 16)) if ok}
            extra = {name: int4_tile_linear(x, qdata, sz, a.group_size, N, decode) for name, decode in ours_more.items()}
            tiny = torch.ops.aten._weight_int4pack_mm(x, qdata, a.group_size, sz)
            ref = F.linear(x, w_bf16)
            row = {"N": N, "K": K, "M": M, "group_size": a.group_size,
                   "max_diff_vs_tinygemm": (ours.float() - tiny.float()).abs().max().item(),
                   "tile_max_diff_vs_tinygemm": (tile.float() - tiny.float()).abs().max().item(),
                   "max_abs_tinygemm": tiny.float().abs().max().item(),
                   **{f"{name}_max_diff_vs_tinygemm": (y.float() - tiny.float()).abs().max().item()
                      for name, y in extra.items()},
                   "max_diff_vs_bf16_linear": (ours.float() - ref.float()).abs().max().item()}
            if M <= 16:
                bn, bk, _ = _decode_tiles(M, a.group_size, None)
                row["split_k"] = decode_split_k(N, K, bn, bk, _sms(x.device))
                tbn, tbk, _, _ = _tile_decode_tiles(M, None)
                row["tile_split_k"] = decode_split_k(N, K, tbn, tbk, _sms(x.device), _TILE_MAX_SPLIT_K)
            peers = [("ours", lambda: int4_linear(x, packed, s, z, a.group_size), int4_bytes),
                     ("tile", lambda: int4_tile_linear(x, qdata, sz, a.group_size, N, "triton"), int4_bytes),
                     ("tinygemm", lambda: torch.ops.aten._weight_int4pack_mm(x, qdata, a.group_size, sz), int4_bytes),
                     ("bf16", lambda: F.linear(x, w_bf16), 2 * N * K)]
            for name, decode in ours_more.items():
                peers.append((name, lambda d=decode: int4_tile_linear(x, qdata, sz, a.group_size, N, d), int4_bytes))
            if gl is not None:
                try:
                    row["gemlite_max_diff_vs_tinygemm"] = (gl(x).float() - tiny.float()).abs().max().item()
                    peers.append(("gemlite", lambda: gl(x), int4_bytes))
                except Exception as e:  # noqa: BLE001 - a peer that fails on this shape is recorded, not fatal
                    row["gemlite_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for name, fn, wbytes in peers:
                us = graph_ms(fn) * 1000
                row[f"{name}_us"] = us
                row[f"{name}_gb_s"] = (wbytes + io) / us / 1e3
            row["ours_vs_tinygemm"] = row["tinygemm_us"] / row["ours_us"]
            row["ours_vs_bf16"] = row["bf16_us"] / row["ours_us"]
            row["tile_vs_tinygemm"] = row["tinygemm_us"] / row["tile_us"]
            row["tile_vs_bf16"] = row["bf16_us"] / row["tile_us"]
            for peer in ("factored", "mma", "gemlite"):
                if f"{peer}_us" in row:
                    row[f"{peer}_vs_tinygemm"] = row["tinygemm_us"] / row[f"{peer}_us"]
                    row[f"{peer}_vs_bf16"] = row["bf16_us"] / row[f"{peer}_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        if a.sweep:
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            for kernel in a.sweep_kernels:
                # the mma GEMV needs BLOCK_K <= the group (a larger one would silently time its fallback)
                for tiles in MMA_SWEEP_TILES if kernel == "mma" else TILE_SWEEP_TILES:
                    for split in (1, 2, 4, 8):
                        key = {"N": N, "K": K, "M": 1, "kernel": kernel, "sweep": list(tiles), "split_k": split}
                        try:
                            us = graph_ms(lambda: int4_tile_decode_triton(x, qdata, sz, a.group_size, N, split, tiles,
                                                                          kernel)) * 1000
                        except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded, not fatal
                            rows.append({**key, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                            continue
                        rows.append({**key, "ours_us": us, "ours_gb_s": (int4_bytes + 2 * (K + N)) / us / 1e3})
            for kernel in a.sweep_kernels:
                best = min((r for r in rows if r.get("sweep") and r["N"] == N and r["K"] == K and "ours_us" in r
                            and r["kernel"] == kernel), key=lambda r: r["ours_us"], default=None)
                print(f"sweep {N}x{K} {kernel} best: {best}", flush=True)
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> list[str]:
    head = ["N x K", "M", "split-K", "ours µs", "GB/s", "tile µs", "GB/s", "tinygemm µs", "GB/s", "bf16 µs", "GB/s",
            "ours vs tinygemm", "tile vs tinygemm", "tile vs bf16", "max diff vs tinygemm: ours, tile (max abs y)",
            "factored µs", "GB/s", "factored vs tinygemm", "factored vs bf16", "factored max diff vs tinygemm",
            "mma µs", "GB/s", "mma vs tinygemm", "mma vs bf16", "mma max diff vs tinygemm",
            "gemlite µs", "GB/s", "gemlite vs tinygemm", "gemlite vs bf16", "gemlite max diff vs tinygemm"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("sweep"):
            continue
        out.append("| " + " | ".join([
            f"{r['N']}x{r['K']}", str(r["M"]), str(r.get("split_k", "–")),
            f"{r['ours_us']:.1f}", f"{r['ours_gb_s']:.0f}", f"{r['tile_us']:.1f}", f"{r['tile_gb_s']:.0f}",
            f"{r['tinygemm_us']:.1f}", f"{r['tinygemm_gb_s']:.0f}", f"{r['bf16_us']:.1f}", f"{r['bf16_gb_s']:.0f}",
            f"{r['ours_vs_tinygemm']:.2f}x", f"{r['tile_vs_tinygemm']:.2f}x", f"{r['tile_vs_bf16']:.2f}x",
            f"{r['max_diff_vs_tinygemm']:.2e}, {r['tile_max_diff_vs_tinygemm']:.2e} ({r['max_abs_tinygemm']:.2e})"]
            + [cell for name in ("factored", "mma") for cell in (
                [f"{r[name + '_us']:.1f}", f"{r[name + '_gb_s']:.0f}", f"{r[name + '_vs_tinygemm']:.2f}x",
                 f"{r[name + '_vs_bf16']:.2f}x", f"{r[name + '_max_diff_vs_tinygemm']:.2e}"] if name + "_us" in r
                else ["–"] * 5)]
            + ([f"{r['gemlite_us']:.1f}", f"{r['gemlite_gb_s']:.0f}", f"{r['gemlite_vs_tinygemm']:.2f}x",
                f"{r['gemlite_vs_bf16']:.2f}x", f"{r['gemlite_max_diff_vs_tinygemm']:.2e}"] if "gemlite_us" in r
               else [r.get("gemlite_error", "not installed")[:60], "–", "–", "–", "–"]))
            + " |")
    sweep = sorted((r for r in rows if r.get("sweep") and "ours_us" in r),
                   key=lambda r: (r["N"], r["K"], r.get("kernel", "tile"), r["ours_us"]))
    if sweep:
        out += ["", "| N x K | GEMV | tiles (BLOCK_N, BLOCK_K, warps, stages) | split-K | µs | GB/s |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['N']}x{r['K']} | {r.get('kernel', 'tile')} | {tuple(r['sweep'])} | {r['split_k']} | "
                f"{r['ours_us']:.1f} | {r['ours_gb_s']:.0f} |" for r in sweep]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="out x in, comma-separated")
    p.add_argument("--ms", default="1,8", help="decode rows")
    p.add_argument("--prefill", type=int, default=2048, help="rows of the prefill case (0: none)")
    p.add_argument("--group_size", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="also the tile and factored GEMVs' tiles and split-K at M = 1")
    p.add_argument("--sweep_kernels", default="tile,factored,mma",
                   help="the GEMVs --sweep times (comma-separated: tile, factored, mma)")
    p.add_argument("--gemlite_autotune", default="fast", choices=("fast", "max", "default"),
                   help="gemlite's autotune setting (its default: fast; max: ~20 s a shape)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    a.shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    a.ms = [int(m) for m in a.ms.split(",")]
    a.sweep_kernels = [k for k in a.sweep_kernels.split(",") if k]
    from hf_lowbit.kernels.triton_int4 import TILE_KERNELS

    bad = [k for k in a.sweep_kernels if k not in TILE_KERNELS]
    if bad:
        p.error(f"--sweep_kernels: {bad} not among {TILE_KERNELS}")
    import torch

    if not torch.cuda.is_available():
        print("benchmark_int4.py: no CUDA device (tinygemm and the kernels' timings need one); nothing measured")
        return
    try:
        import gemlite

        gemlite.set_autotune(a.gemlite_autotune)
        print(f"gemlite {getattr(gemlite, '__version__', '?')}, autotune {a.gemlite_autotune}", flush=True)
    except ImportError:
        print("gemlite not installed: its column is left out", flush=True)
    rows = bench(a)
    print("\n".join(markdown(rows)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": os.environ.get("HF_LOWBIT_COMMIT"), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(markdown(rows)) + "\n")


if __name__ == "__main__":
    main()
