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

Rows (``--recipes``; names from ``benchmark_train.INT8_VARIANTS``): ``bf16``; ``int8_fwd`` (forward INT8);
``int8_fwd_gi`` (+ input gradient); ``int8`` (+ weight gradient); ``_sr`` = with stochastic rounding, which our
recipe applies to the backward's operands only (dY in both gradient matmuls, X in the weight gradient), so
``int8_fwd_sr`` computes what ``int8_fwd`` does (not a default row; the seed's forward-only SR row has no
counterpart here). Each row is one ``benchmarks/benchmark_train.py`` worker process: ``--warmup`` steps (compile,
autotune) untimed, then ``--steps`` timed ones give tok/s and peak memory; the loss is that of the last step.
The JSON is rewritten after every row, so a run cut short keeps the rows it finished.

``--tiny``: a 2-layer 64-wide model, 64-token blocks, eager, on CPU: checks the script end to end in ~1 min.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchmarks.benchmark_train import INT8_VARIANTS  # noqa: E402

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


def token_blocks(seq: int, vocab: int, seed: int = 0):
    """The corpus packed into ``seq``-token blocks (shuffled) by a BPE of at most ``vocab`` tokens, and its size."""
    import torch

    from benchmarks.corpus import build_bpe_tokenizer, python_docs_corpus
    from hf_lowbit.data import pack

    docs = python_docs_corpus()
    tok = build_bpe_tokenizer(docs, vocab)
    blocks = pack(docs, tok, seq).blocks
    return blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))], len(tok)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=DEFAULT_ROWS, help=f"comma-separated rows, from bf16, int8, {', '.join(INT8_VARIANTS)}")
    for name, default in (*SHAPE.items(), ("batch", 16), ("seq", 2048), ("warmup", 5), ("steps", 10),
                          ("min_features", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, constant")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke test of the script: {TINY}, eager")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no_compile", action="store_true", help="run eagerly (smoke tests only)")
    p.add_argument("--timeout", type=int, default=150, help="seconds per row (its own process)")
    p.add_argument("--json", default=None, help="results (rewritten after every row)")
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

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_seed_table.py needs a CUDA GPU (--tiny runs a CPU smoke test)")
    from benchmarks.driver import git_commit, run_worker, write_results

    blocks, tok_vocab = token_blocks(a.seq, min(a.vocab, 32000))
    needed = (a.warmup + a.steps) * a.batch
    data = os.path.join(tempfile.mkdtemp(), "blocks.pt")
    torch.save(blocks[:needed].clone(), data)
    meta = {"commit": git_commit(), "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
            "config": {k: getattr(a, k) for k in (*SHAPE, "batch", "seq", "warmup", "steps", "lr", "min_features")},
            "data": {"corpus": "Python docs (benchmarks/corpus.py)", "blocks": len(blocks), "tokenizer_vocab": tok_vocab,
                     # > 1: the run cycles through the corpus (the same batches for every row either way)
                     "epochs": round(needed / len(blocks), 2)},
            "seed_speedup": SEED_SPEEDUP}
    shape = ["--device", a.device, "--data", data, "--lr", str(a.lr)]
    for k in (*SHAPE, "batch", "seq", "warmup", "steps", "min_features"):
        shape += [f"--{k}", str(getattr(a, k))]
    shape += ["--no_compile"] if a.no_compile else []
    rows = []
    for recipe in recipes:
        cmd = [sys.executable, os.path.join(HERE, "benchmark_train.py"), *shape, "--recipe", recipe]
        got = run_worker(cmd, {"recipe": recipe}, a.timeout)
        row = {"recipe": recipe, **switches(recipe), "batch": a.batch, "seq": a.seq, "steps": a.warmup + a.steps,
               "commit": meta["commit"], "mode": "eager step" if a.no_compile else "compiled step"}
        if "error" in got:
            row["error"] = got["error"]
            row["oom"] = "out of memory" in got["error"].lower()
            if recipe == "bf16" and row["oom"]:
                print(f"bf16 does not fit {a.batch} x {a.seq} tokens on this GPU: rerun with a smaller --batch "
                      f"(e.g. --batch {a.batch // 2})", flush=True)
        else:
            row.update(tok_s=got["tokens_per_s"], peak_gib=got["peak_mem_gib"], loss=got["last_loss"],
                       losses=got["losses"], warmup_s=got["warmup_s"], graph_breaks=got["graph_breaks"])
        rows.append(row)
        base = next((r for r in rows if r["recipe"] == "bf16" and "error" not in r), None)
        for r in rows:
            if base is not None and "error" not in r:
                r["speedup"] = r["tok_s"] / base["tok_s"]
                r["mem_vs_bf16"] = r["peak_gib"] / base["peak_gib"]
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
        if a.json:
            os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = [f"| forward | grad input | grad weight | SR | tok/s | speedup | seed's speedup | peak GiB | "
             f"loss after {a.warmup + a.steps} steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seed = SEED_SPEEDUP.get(r["recipe"], 1.0 if r["recipe"] == "bf16" else "–")
        seed = "OOM" if seed is None else seed if isinstance(seed, str) else f"{seed:.2f}"
        head = (f"| {r['forward']} | {r['grad_input']} | {r['grad_weight']} | "
                f"{'yes' if r['stochastic_rounding'] else 'no' if r['recipe'] != 'bf16' else '–'} |")
        if "error" in r:
            why = "OOM" if r["oom"] else "error: " + (r["error"].strip().splitlines() or ["?"])[-1][:60]
            table.append(f"{head} {why} | – | {seed} | – | – |")
        else:
            table.append(f"{head} {r['tok_s']:,.0f} | {r.get('speedup', float('nan')):.2f} | {seed} | "
                         f"{r['peak_gib']:.1f} | {r['loss']:.3f} |")
    c = meta["config"]
    write_results({"meta": meta, "rows": rows}, table,
                  f"{meta['gpu']}, torch {meta['torch']}, {c['layers']} layers h{c['hidden']} MLP {c['intermediate']} "
                  f"{c['heads']}/{c['kv_heads']} heads vocab {c['vocab']}, {a.batch} x {a.seq} tokens, "
                  f"{a.warmup} + {a.steps} steps at lr {a.lr}", a.json, a.markdown)
    if a.plot and a.json:
        from benchmarks.plot_benchmark import main as plot

        plot(a.json, a.plot)


if __name__ == "__main__":
    main()
