#!/usr/bin/env python
"""Issue 18's seed table with our INT8 recipe: per-matmul INT8 switches, with and without stochastic rounding.

    python benchmarks/benchmark_seed_table.py --json docs/results/seed_table_h200.json \\
        --markdown docs/results/seed_table_h200.md --plot docs/results/seed_table_h200.png

The seed (a quantized-training exploration, RTX 4070 Ti SUPER) timed Llama2-1B at 16 x 2048 tokens, LM head
excluded. Here: the TinyLlama-1.1B shape it used (hidden 2048, MLP 5632, 22 layers, 32 heads / 4 KV heads,
vocab 32000), random init, bf16 weights, fused AdamW at a constant ``--lr``, each decoder layer compiled, LM head
and embeddings in bf16 (``LinearFilter`` excludes ``lm_head``). The tokens are real text: the Python docs corpus
(``benchmarks/corpus.py``), a byte-level BPE trained on it here, packed into ``--seq`` blocks and shuffled; every
row trains the same init on the same batches, so the loss after the fixed number of steps compares the rows.

Rows (``--recipes``; names from ``driver.INT8_VARIANTS``): ``bf16``; ``int8_fwd`` (forward INT8);
``int8_fwd_gi`` (+ input gradient); ``int8`` (+ weight gradient); ``_sr`` = with stochastic rounding, which our
recipe applies to the backward's operands only (dY in both gradient matmuls, X in the weight gradient), so
``int8_fwd_sr`` computes what ``int8_fwd`` does (not a default row; the seed's forward-only SR row has no
counterpart here). The rows are one ``benchmarks/benchmark_train.py`` run on the packed text (a worker process per
row: ``--warmup`` steps (compile, autotune) untimed, then ``--steps`` timed ones give tok/s and peak memory; the loss
is that of the last step). That run rewrites its JSON (``--raw``) after every row, so a run cut short keeps the rows
it finished; ``--from_raw`` makes the table of such a file.

``--tiny``: a 2-layer 64-wide model, 64-token blocks, eager, on CPU: checks the script end to end in ~1 min.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchmarks.driver import INT8_VARIANTS, add_int_flags, meta, plot_results, write_results  # noqa: E402

DEFAULT_ROWS = "bf16,int8_fwd,int8_fwd_gi,int8_fwd_gi_sr,int8,int8_sr"
# the seed's speedups over bf16 on the RTX 4070 Ti SUPER (None: OOM), for the side-by-side column
SEED_SPEEDUP = {"int8_fwd": 1.27, "int8_fwd_sr": 1.19, "int8_fwd_gi": 1.48, "int8_fwd_gi_sr": 1.30,
                "int8": 1.68, "int8_sr": None}
SHAPE = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000)
TINY = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, seq=64, batch=4, min_features=32)


def switches(recipe: str) -> dict:
    """Which matmuls ``recipe`` runs in INT8 and whether it rounds stochastically."""
    if recipe == "bf16":
        return {"forward": "bf16", "grad_input": "bf16", "grad_weight": "bf16", "stochastic_rounding": False}
    v = INT8_VARIANTS.get(recipe, {})
    int8 = lambda key: "bf16" if v.get(key) is False else "int8"  # noqa: E731
    return {"forward": "int8", "grad_input": int8("lowbit_grad_input"), "grad_weight": int8("lowbit_grad_weight"),
            "stochastic_rounding": bool(v.get("lowbit_stochastic_rounding"))}


def seed_row(r: dict, a, commit: str) -> dict:
    """benchmark_train.py's row ``r`` as a row of the seed table."""
    row = {"recipe": r["recipe"], **switches(r["recipe"]), "batch": a.batch, "seq": a.seq, "steps": a.warmup + a.steps,
           "commit": commit, "mode": "eager step" if a.no_compile else "compiled step"}
    if "error" in r:
        row.update(error=r["error"], oom="out of memory" in r["error"].lower())
    else:
        row.update(tok_s=r["tokens_per_s"], peak_gib=r["peak_mem_gib"], loss=r["last_loss"], losses=r["losses"],
                   warmup_s=r["warmup_s"], graph_breaks=r["graph_breaks"])
        if "vs_bf16" in r:
            row.update(speedup=r["vs_bf16"], mem_vs_bf16=r["mem_vs_bf16"])
    return row


def table(rows: list[dict], a) -> list[str]:
    out = [f"| forward | grad input | grad weight | SR | tok/s | speedup | seed's speedup | peak GiB | "
           f"loss after {a.warmup + a.steps} steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seed = SEED_SPEEDUP.get(r["recipe"], 1.0 if r["recipe"] == "bf16" else "–")
        seed = "OOM" if seed is None else seed if isinstance(seed, str) else f"{seed:.2f}"
        head = (f"| {r['forward']} | {r['grad_input']} | {r['grad_weight']} | "
                f"{'yes' if r['stochastic_rounding'] else 'no' if r['recipe'] != 'bf16' else '–'} |")
        if "error" in r:
            why = "OOM" if r["oom"] else "error: " + (r["error"].strip().splitlines() or ["?"])[-1][:60]
            out.append(f"{head} {why} | – | {seed} | – | – |")
        else:
            out.append(f"{head} {r['tok_s']:,.0f} | {r.get('speedup', float('nan')):.2f} | {seed} | "
                       f"{r['peak_gib']:.1f} | {r['loss']:.3f} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=DEFAULT_ROWS, help=f"comma-separated rows, from bf16, int8, {', '.join(INT8_VARIANTS)}")
    add_int_flags(p, **SHAPE, batch=16, seq=2048, warmup=5, steps=10, min_features=64)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, constant")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke test of the script: {TINY}, eager")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no_compile", action="store_true", help="run eagerly (smoke tests only)")
    p.add_argument("--timeout", type=int, default=150, help="seconds per row (its own process)")
    p.add_argument("--raw", default=None, help="benchmark_train.py's JSON, rewritten after every row (default: temporary)")
    p.add_argument("--from_raw", default=None, help="make the table of this --raw file, running nothing")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of the speedups (needs matplotlib)")
    a = p.parse_args()
    if a.tiny:
        for k, v in TINY.items():
            setattr(a, k, v)
        a.device, a.no_compile = "cpu", True
    recipes = a.recipes.split(",")
    unknown = [r for r in recipes if r not in ("bf16", "int8", *INT8_VARIANTS)]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; choose from bf16, int8, {', '.join(INT8_VARIANTS)}")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available() and not a.from_raw:
        raise SystemExit("benchmark_seed_table.py needs a CUDA GPU (--tiny runs a CPU smoke test)")
    from benchmarks.corpus import corpus_blocks

    tmp = tempfile.mkdtemp()
    raw = a.from_raw or a.raw or os.path.join(tmp, "rows.json")
    blocks, data = None, {}
    if not a.from_raw:
        tok, blocks, _, _ = corpus_blocks(a.seq, min(a.vocab, 32000), eval_fraction=None)
        blocks = blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))]
        data = {"corpus": "Python docs (benchmarks/corpus.py)", "blocks": len(blocks), "tokenizer_vocab": len(tok),
                # > 1: the run cycles through the corpus (the same batches for every row either way)
                "epochs": round((a.warmup + a.steps) * a.batch / len(blocks), 2)}
        torch.save(blocks[:(a.warmup + a.steps) * a.batch].clone(), os.path.join(tmp, "blocks.pt"))
        cmd = [sys.executable, os.path.join(HERE, "benchmark_train.py"), "--device", a.device, "--recipes", a.recipes,
               "--data", os.path.join(tmp, "blocks.pt"), "--lr", str(a.lr), "--timeout", str(a.timeout), "--json", raw,
               *[x for k in (*SHAPE, "batch", "seq", "warmup", "steps", "min_features") for x in (f"--{k}", str(getattr(a, k)))],
               *(["--no_compile"] if a.no_compile else [])]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
    with open(raw) as f:
        train = json.load(f)
    info = meta(a.device, config={k: getattr(a, k) for k in (*SHAPE, "batch", "seq", "warmup", "steps", "lr", "min_features")},
                data=data, seed_speedup=SEED_SPEEDUP)
    info["commit"] = train["meta"]["commit"]
    rows = [seed_row(r, a, info["commit"]) for r in train["rows"]]
    if any(r["recipe"] == "bf16" and r.get("oom") for r in rows):
        print(f"bf16 does not fit {a.batch} x {a.seq} tokens on this GPU: rerun with a smaller --batch "
              f"(e.g. --batch {a.batch // 2})", flush=True)
    c = info["config"]
    write_results({"meta": info, "rows": rows}, table(rows, a),
                  f"{info['gpu']}, torch {info['torch']}, {c['layers']} layers h{c['hidden']} MLP {c['intermediate']} "
                  f"{c['heads']}/{c['kv_heads']} heads vocab {c['vocab']}, {a.batch} x {a.seq} tokens, "
                  f"{a.warmup} + {a.steps} steps at lr {a.lr}", a.json, a.markdown)
    if a.plot and a.json:
        plot_results(a.json, a.plot)


if __name__ == "__main__":
    main()
