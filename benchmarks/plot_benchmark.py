#!/usr/bin/env python
"""Bar plot (speed vs bf16) of a JSON from benchmarks/benchmark_linear.py, benchmark_train.py or
benchmark_seed_table.py (needs matplotlib).

    python benchmarks/plot_benchmark.py docs/results/linear_h200.json docs/results/linear_h200.png
"""

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(src) as f:
        data = json.load(f)
    meta = data["meta"]
    rows = [r for r in data["rows"] if "error" not in r]
    for r in rows:  # benchmark_train rows: one mode, ratio under "vs_bf16" (benchmark_seed_table: "speedup")
        r.setdefault("mode", "compiled step")
        r.setdefault("speedup_vs_bf16", r.get("vs_bf16", r.get("speedup", 0)))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        vals = [next((r["speedup_vs_bf16"] for r in rows if r["recipe"] == rec and r["mode"] == mode), 0)
                for rec in recipes]
        bars = ax.bar([i + j * width for i in range(len(recipes))], vals, width, label=mode)
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(recipes))], recipes,
                  rotation=20 if len(recipes) > 5 else 0, fontsize=8 if len(recipes) > 5 else None)
    ax.set_ylabel("speed vs bf16 (same mode)")
    if "shape" in meta:
        m, k, n = meta["shape"]
        ax.set_title(f"{meta['gpu']}: one linear fwd+bwd, {m} tokens x {k} -> {n}", fontsize=10)
    else:
        c = meta["config"]
        ax.set_title(f"{meta['gpu']}: training step, {c['layers']} layers h{c['hidden']}, "
                     f"{c['batch']}x{c['seq']} tokens", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
