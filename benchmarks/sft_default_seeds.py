#!/usr/bin/env python
"""The embedded default (``scripts/sft.py`` with no model: a 0.4M-parameter Llama learning 2-digit additions, 1,000
steps on a CPU) over several seeds, with and without its INT8 recipe.

    python benchmarks/sft_default_seeds.py --json docs/results/sft_default_seeds_cpu.json \\
        --markdown docs/results/sft_default_seeds_cpu.md

One run of the default says little: at this size the held-out loss after 1,000 steps depends on the seed (the
initialization and the data order) more than on the number format, so docs/usage.md quotes the spread from here
beside the committed run. Each (recipe, seed) is one ``scripts/sft.py`` process with ``--seed`` and the recipe's
flags (``fp32``: ``--int8_mixed_precision False``, the model's own float32; ``int8``: the default; ``fp8``: FP8
instead; ``int8_sr``: INT8 with stochastic rounding), ``OMP_NUM_THREADS=1``, ``--jobs`` at a time. Its
``sft_metrics.json`` gives the row. ``--steps`` shortens every run (the cosine schedule follows it), for a quick check
of the script. ``--src`` runs another checkout's ``scripts/sft.py`` (a worktree at an older commit, say: the record
names its commit), with this environment's packages.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)

from benchmarks.driver import error_cell, meta, spread, write_results  # noqa: E402

RECIPE_FLAGS = {"fp32": ["--int8_mixed_precision", "False"], "int8": [],
                "fp8": ["--int8_mixed_precision", "False", "--fp8_mixed_precision", "True"],
                "int8_sr": ["--lowbit_stochastic_rounding", "True"],
                # INT8 with the input gradient dX in full precision (the forward and the weight gradient INT8)
                "int8_no_dx": ["--lowbit_grad_input", "False"]}


def run_one(recipe: str, seed: int, steps: int | None, tmp: str, src: str = ROOT) -> dict:
    """One embedded-default run of ``src``'s code; its metrics, or the error's last lines."""
    out = os.path.join(tmp, f"{recipe}_{seed}")
    cmd = [sys.executable, os.path.join(src, "scripts", "sft.py"), "--output_dir", out, "--disable_tqdm", "True",
           "--seed", str(seed), *RECIPE_FLAGS[recipe], *(["--max_steps", str(steps)] if steps else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=src)
    row = {"recipe": recipe, "seed": seed}
    if proc.returncode != 0:
        return {**row, "error": proc.stderr[-2000:]}
    with open(os.path.join(out, "sft_metrics.json")) as f:
        m = json.load(f)
    return {**row, **{k: m[k] for k in ("initial_eval_loss", "eval_loss", "eval_perplexity", "eval_accuracy",
                                        "train_step_ms")},
            "last_train_loss": m["train_losses"][-1] if m["train_losses"] else None}  # logged every 50 steps


def _f3(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def table(rows: list[dict], recipes: list[str]) -> list[str]:
    """A row per run, then per recipe the mean, min and max of the held-out loss and accuracy."""
    lines = ["| recipe | seed | initial eval loss | eval loss | exact-match accuracy | last train loss |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['seed']} | {error_cell(r['error'])} | – | – | – |")
        else:
            lines.append(f"| {r['recipe']} | {r['seed']} | {r['initial_eval_loss']:.3f} | {r['eval_loss']:.3f} | "
                         f"{r['eval_accuracy']:.3f} | {_f3(r['last_train_loss'])} |")
    lines += ["", "| recipe | runs | eval loss mean (min – max) | accuracy mean (min – max) |", "|---|---|---|---|"]
    for recipe in recipes:
        ok = [r for r in rows if r["recipe"] == recipe and "error" not in r]
        if not ok:
            continue
        loss, acc = spread([r["eval_loss"] for r in ok]), spread([r["eval_accuracy"] for r in ok])
        lines.append(f"| {recipe} | {len(ok)} | {loss['mean']:.3f} ({loss['min']:.3f} – {loss['max']:.3f}) | "
                     f"{acc['mean']:.3f} ({acc['min']:.3f} – {acc['max']:.3f}) |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="fp32,int8", help=f"comma-separated from {', '.join(RECIPE_FLAGS)}")
    p.add_argument("--seeds", default="0,1,2,3", help="comma-separated integers")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU thread each)")
    p.add_argument("--steps", type=int, default=None, help="override the default's 1,000 steps (a quick check)")
    p.add_argument("--src", default=ROOT, help="the checkout whose scripts/sft.py runs (default: this one)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    recipes = a.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPE_FLAGS]
    if unknown:
        p.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPE_FLAGS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds: comma-separated integers, got {a.seeds!r}")
    src = os.path.abspath(a.src)
    if not os.path.isfile(os.path.join(src, "scripts", "sft.py")):
        p.error(f"--src {a.src}: no scripts/sft.py there; give a checkout of this repository")
    runs = [(r, s) for r in recipes for s in seeds]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, a.jobs)) as pool:
        rows = list(pool.map(lambda rs: run_one(*rs, a.steps, tmp, src), runs))
    data = {"meta": meta("cpu", key="device", jobs=a.jobs, steps=a.steps or 1000), "rows": rows}
    if src != os.path.abspath(ROOT):  # another checkout's code: its commit is what was measured
        data["meta"]["commit"] = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True).stdout.strip() or "unknown"
    write_results(data, table(rows, recipes), "# The embedded default over seeds (`benchmarks/sft_default_seeds.py`)",
                  a.json, a.markdown)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
