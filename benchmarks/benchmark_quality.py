#!/usr/bin/env python
"""Training quality of the low-bit recipes against bf16 on real text, from the same init.

    python benchmarks/benchmark_quality.py --json docs/results/quality_h200.json --plot docs/results/quality_h200.png

The text is English prose that ships with CPython (pydoc topics and standard-library docstrings,
`benchmarks.corpus.python_docs_corpus`), tokenized by a BPE trained here, packed into fixed blocks, 10%
of the documents held out (``--corpus_packages torch,transformers,sympy,networkx,numpy``: those installed
packages' docstrings join it, ~5.6M tokens instead of ~0.46M, for runs that would otherwise repeat the text —
issue 14's 1,500-step parity run, stage ``quality_parity``). Each recipe trains the same Llama-style model from the same seed on the
same batches with a plain PyTorch loop (`hf_lowbit.prepare_model`, bf16 autocast, AdamW); the script
records every step's loss, the final held-out loss, and each recipe's ratio to bf16.

LoRA recipes (``lora_*``): the model is first pre-trained in bf16 for ``--pretrain_steps`` on the corpus
(once, shared), then each LoRA recipe trains r=``--lora_r`` adapters on every decoder linear over that base,
stored as the recipe says (bf16, NF4, INT8; INT8 compute or not), for ``--steps`` steps on the fine-tuning
task (``--lora_task``):

* ``arithmetic`` (default): 2-digit additions ``"12+34=46"`` in the corpus's tokenizer, a format the
  prose-trained base has never seen; held out: 500 problems whose operand pairs never occur in training.
  An adapter must *learn* here: the row ``lora_untrained`` is the base with its adapters at init (B = 0,
  i.e. the base itself), and a recipe passes the bar (``learns``) when its held-out loss is at least
  ``--learn_bar`` (20%) below that row's. The untrained adapter fails the bar by construction, so the bar
  tells a working adapter from one that learns nothing, which the ``corpus`` task cannot: there (more of
  the pre-training text) adapters moved the held-out loss ~1.3% in 200 steps on the H200.
* ``corpus``: the pre-training corpus, in another batch order (the earlier benchmark).

Late in training (``--late_lr``): the full fine-tune recipes all start from one bf16-pretrained state
(``--pretrain_steps`` at ``--lr``) and continue for ``--steps`` at the small rate, a new batch order; issue 18's
"does stochastic rounding help" question, where the per-step update is smallest against the rounding error:

    python benchmarks/benchmark_quality.py --compile --recipes bf16,int8,int8_sr --pretrain_steps 300 --late_lr 3e-5 --steps 200

The LM head in the format (``int8_head`` / ``fp8_head``): ``int8`` / ``fp8`` with
``LowBitTrainingArguments(lowbit_include_lm_head=True)``, the library's own switch (``prepare_model`` converts the head
as it converts the decoder linears); every other recipe keeps the head bf16. After the recipe is applied the script
checks the head (a ``MixedPrecisionLinear`` in the format for these two, plain bf16 ``nn.Linear`` for the rest) and
stops with one line otherwise (e.g. FP8 skips a head whose vocab is not a multiple of 16). ``--compile_layers``
compiles the decoder layers only, so a low-bit head runs uncompiled outside them (slower: fine for a loss comparison);
``--compile`` compiles it with the rest of the model. The model's head is untied (``driver.llama_config``); a head
tied to the input embedding would be converted too, sharing that Parameter (docs/usage.md). The head's loss parity over
1,500 steps (``run.py``'s stage ``quality_parity``, the recipes in parallel as it always runs them; at 51cd30c FP8's head
+0.15% held out, INT8's +31.9%: docs/results/quality_parity_head_h200.md):

    RECIPES=bf16,int8,int8_head,fp8,fp8_head python benchmarks/run.py quality_parity OUT

LoRA rows also compare to ``lora_bf16`` (the quantized bases must learn as much as the bf16 one):

    python benchmarks/benchmark_quality.py --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_int8_int8 --steps 200
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.corpus import corpus_blocks, package_sources  # noqa: E402
from benchmarks.driver import (HEAD_VARIANTS, add_int_flags, compile_layers, llama_config, meta,  # noqa: E402
                               recipe_args, train_step, write_results)
from hf_lowbit import LowBitTrainingArguments, MixedPrecisionLinear, prepare_model  # noqa: E402
from hf_lowbit.data import arithmetic_records, pack  # noqa: E402

# full fine-tunes (driver.recipe_args); *_head: the LM head in the format too (lowbit_include_lm_head)
RECIPES = ("bf16", "int8", "fp8", "fp8_tensorwise", "int8_sr", *HEAD_VARIANTS)
LORA_RECIPES = ("lora_bf16", "lora_nf4", "lora_nf4_int8", "lora_int8_int8")


def lm_head_format(model, recipe: str) -> str:
    """The format of ``model``'s LM head after full fine-tune ``recipe`` was applied ("bf16", "int8", "fp8"); stops
    with one line unless it is the recipe's (HEAD_VARIANTS: a ``MixedPrecisionLinear`` in their format; the others:
    bf16), as ``driver.check_recipe_active`` does for the decoder linears (no forward: no random numbers drawn)."""
    head = model.get_output_embeddings()
    fmt = head.lowbit_config.format if isinstance(head, MixedPrecisionLinear) else None
    want = recipe.removesuffix("_head") if recipe in HEAD_VARIANTS else None
    if fmt != want or (want is None and type(head) is not torch.nn.Linear):
        why = " (FP8 skips a vocab not a multiple of 16: see the report above)" if want == "fp8" and not fmt else ""
        raise SystemExit(f"recipe {recipe!r} is not active: the LM head is {type(head).__name__} with "
                         f"{fmt or 'bf16'} matmuls, not {want or 'bf16'}{why}")
    return fmt or "bf16"


def train_one(recipe: str, a, train_blocks: torch.Tensor, eval_blocks: torch.Tensor, vocab: int,
              steps: int | None = None, init_state: dict | None = None, keep_state: bool = False,
              lr: float | None = None) -> dict:
    """``lr``: a full fine-tune continued from ``init_state`` at this rate (``--late_lr``: no warm-up, new batch
    order); otherwise ``--lr`` (``--lora_lr`` for LoRA) with ``--warmup`` steps of warm-up."""
    steps = a.steps if steps is None else steps
    late = lr is not None
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(llama_config(a, vocab)).to(a.device)
    if init_state is not None:
        model.load_state_dict(init_state)
    lora = recipe in LORA_RECIPES
    with tempfile.TemporaryDirectory() as tmp:
        args = LowBitTrainingArguments(output_dir=tmp, report_to="none", lowbit_min_features=a.min_features,
                                       **recipe_args(recipe))
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear")
        model = prepare_model(model, args, peft_config)
    head = None if lora else lm_head_format(model, recipe)
    fwd = model
    if a.compile_layers:  # one compiled graph per decoder layer, compiled once and reused (Inductor's cache)
        compile_layers(model, a.layers)
    elif a.compile:
        fwd = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not late:
        lr = (a.lora_lr or a.lr) if lora else a.lr
    warmup = 1 if late else a.warmup
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0 if lora else 0.1, betas=(0.9, 0.95),
                            fused=torch.device(a.device).type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(steps, 1)))))
    order = torch.Generator().manual_seed(a.seed + (1 if lora or late else 0))  # a new batch order after pre-training
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        ids = train_blocks[torch.randint(0, train_blocks.shape[0], (a.batch,), generator=order)].to(a.device)
        losses.append(train_step(model, [ids], opt, fwd=fwd, autocast=True, clip=1.0, sched=sched)[0].item())
        if step == 0 or (step + 1) % 250 == 0 or step + 1 == steps:  # where a long run's time goes (compile vs steps)
            print(f"[{recipe}] step {step + 1}/{steps} loss {losses[-1]:.4f} at {time.perf_counter() - t0:.0f} s",
                  flush=True)
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=torch.device(a.device).type, dtype=torch.bfloat16):
        eval_losses = [fwd(input_ids=b.to(a.device), labels=b.to(a.device)).loss.item()
                       for b in eval_blocks.split(a.batch)]
    tail = max(1, steps // 10)
    row = {"recipe": recipe, **({"lm_head": head} if head else {}), "losses": losses,
           "final_train_loss": sum(losses[-tail:]) / tail if losses else None,
           "eval_loss": sum(eval_losses) / len(eval_losses)}
    if keep_state:
        row["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return row


def arithmetic_task(tok, a, n_eval: int = 500) -> dict:
    """Blocks of 2-digit additions in the corpus tokenizer; held-out operand pairs never occur in training."""
    n_train = max(2000, a.steps * a.batch * a.seq // 6)  # ~6 tokens a problem: about an epoch of the run
    train, held_out = arithmetic_records(n_train, n_eval, seed=a.seed)
    text = lambda recs: [r["prompt"] + r["completion"] for r in recs]  # noqa: E731
    return {"train": pack(text(train), tok, a.seq).blocks, "eval": pack(text(held_out), tok, a.seq).blocks}


def _start_processes(recipes: list[str]):
    """Start this script once per recipe, all at once (``--parallel``); :func:`_collect` waits for them. Started
    before the parent builds its corpus, so that work runs beside the children's instead of before them."""
    import subprocess

    argv = [x for x in sys.argv[1:] if x != "--parallel"]
    for flag in ("--recipes", "--json", "--markdown", "--plot"):  # drop these and their values
        argv = [x for x in argv if not x.startswith(flag + "=")]
        while flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    tmp = tempfile.TemporaryDirectory()
    procs = {r: subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--recipes", r,
                                  "--json", os.path.join(tmp.name, f"{r}.json")]) for r in recipes}
    return procs, tmp


def _collect(procs: dict, tmp) -> tuple[dict[str, dict], dict]:
    """Each started recipe's row (see :func:`_start_processes`), and the first one's ``meta``."""
    import json

    with tmp:
        failed = [r for r, proc in procs.items() if proc.wait() != 0]
        if failed:
            raise SystemExit(f"--parallel: the process of recipe(s) {failed} failed (its output is above)")
        rows, first = {}, None
        for r in procs:
            with open(os.path.join(tmp.name, f"{r}.json")) as f:
                data = json.load(f)
            rows[r], first = data["rows"][0], first or data["meta"]
    return rows, first


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="bf16,int8,fp8")
    add_int_flags(p, layers=4, hidden=512, intermediate=1408, heads=8, kv_heads=4, seq=256, batch=32, steps=300,
                  warmup=30, vocab=4096, min_features=64, seed=0, max_docs=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_lr", type=float, default=None, help="learning rate of the lora_* recipes (default: --lr)")
    p.add_argument("--pretrain_steps", type=int, default=300,
                   help="bf16 pre-training of the base of the lora_* recipes (and of the others with --late_lr)")
    p.add_argument("--late_lr", type=float, default=None,
                   help="late in training: the full fine-tune recipes continue the bf16-pretrained base (--pretrain_steps "
                        "at --lr) for --steps at this small rate, cosine to 0, where rounding is most likely to hurt")
    p.add_argument("--lora_task", choices=("arithmetic", "corpus"), default="arithmetic",
                   help="what the lora_* recipes fine-tune on (see above)")
    p.add_argument("--learn_bar", type=float, default=0.2,
                   help="a LoRA recipe learns when its held-out loss is this fraction below the untrained adapter's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (as in real training)")
    p.add_argument("--compile_layers", action="store_true",
                   help="torch.compile each decoder layer instead of the whole model: one layer's compile, reused "
                        "(compiled whole, a 12-layer model's INT8 run of 1,500 steps did not finish in 330 s on "
                        "the H200; why was not measured); the LM head is outside the layers, so with int8_head / "
                        "fp8_head it runs uncompiled (slower; the loss is what this script measures)")
    p.add_argument("--parallel", action="store_true",
                   help="train the full fine-tuning recipes at once, each in its own process on the same device "
                        "(a model of this size leaves most of an H200 idle; the losses do not depend on it)")
    p.add_argument("--corpus_packages", default="",
                   help="comma-separated installed packages whose docstrings join the corpus (e.g. "
                        "torch,transformers,sympy,numpy,networkx: ~5M more tokens, for long runs that would "
                        "otherwise repeat the standard library's ~0.46M)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of the loss curves (needs matplotlib)")
    a = p.parse_args()
    unknown = [r for r in a.recipes.split(",") if r not in RECIPES and r not in LORA_RECIPES]
    if unknown:
        raise SystemExit(f"--recipes: unknown {unknown}; choose from {', '.join([*RECIPES, *LORA_RECIPES])}")

    recipes = a.recipes.split(",")
    packages = tuple(x for x in a.corpus_packages.split(",") if x)
    try:
        package_sources(packages)
    except ValueError as e:
        raise SystemExit(f"--corpus_packages: {e}") from None
    started = None
    if a.parallel and sum(r in RECIPES for r in recipes) > 1:
        started = _start_processes([r for r in recipes if r in RECIPES])
    pre = task = None
    if started and all(r in RECIPES for r in recipes):  # every recipe trains in a child, on the children's corpus
        parallel, child_meta = _collect(*started)
        rows, corpus_meta = [parallel[r] for r in recipes], child_meta["corpus"]
        pre_eval = child_meta["pretrained_eval_loss"]
    else:
        tok, train_blocks, eval_blocks, corpus_meta = corpus_blocks(a.seq, a.vocab, seed=a.seed, max_docs=a.max_docs,
                                                                    packages=packages)
        pretrained = None
        if any(r in LORA_RECIPES for r in recipes) or a.late_lr:
            pre = train_one("bf16", a, train_blocks, eval_blocks, len(tok), steps=a.pretrain_steps, keep_state=True)
            pretrained = pre.pop("state")
            print(f"pre-trained base: {a.pretrain_steps} steps, held-out loss {pre['eval_loss']:.4f}", flush=True)
        pre_eval = None if pre is None else pre["eval_loss"]
        if any(r in LORA_RECIPES for r in recipes):
            task = {"train": train_blocks, "eval": eval_blocks}
            if a.lora_task == "arithmetic":
                task = arithmetic_task(tok, a)
            recipes = ([r for r in recipes if r not in LORA_RECIPES] + ["lora_untrained"]
                       + [r for r in recipes if r in LORA_RECIPES])
        rows = []
        parallel = _collect(*started)[0] if started else {}
        for r in recipes:
            if r in parallel:
                rows.append(parallel[r])
            elif r in LORA_RECIPES or r == "lora_untrained":  # the untrained adapter: B = 0, i.e. the base itself
                rows.append(train_one("lora_bf16" if r == "lora_untrained" else r, a, task["train"], task["eval"],
                                      len(tok), init_state=pretrained, steps=0 if r == "lora_untrained" else None))
                rows[-1]["recipe"] = r
            else:
                rows.append(train_one(r, a, train_blocks, eval_blocks, len(tok),
                                      init_state=pretrained if a.late_lr else None, lr=a.late_lr))
    untrained = next((x for x in rows if x["recipe"] == "lora_untrained"), None)
    for r in rows:  # full fine-tunes vs bf16, LoRA recipes vs lora_bf16
        base = next((x for x in rows if x["recipe"] == ("lora_bf16" if r["recipe"] in LORA_RECIPES else "bf16")), None)
        if base and r["final_train_loss"] is not None:
            r["final_train_loss_vs_bf16"] = r["final_train_loss"] / base["final_train_loss"] - 1
            r["eval_loss_vs_bf16"] = r["eval_loss"] / base["eval_loss"] - 1
        if untrained is not None and r["recipe"] in (*LORA_RECIPES, "lora_untrained"):
            r["eval_loss_vs_untrained"] = r["eval_loss"] / untrained["eval_loss"] - 1
            r["learns"] = r["eval_loss_vs_untrained"] <= -a.learn_bar
    info = meta(a.device, key="device", corpus=corpus_meta, pretrained_eval_loss=pre_eval,
                lora_task=({"name": a.lora_task, "train_tokens": task["train"].numel(),
                            "eval_tokens": task["eval"].numel(), "learn_bar": a.learn_bar} if task else None),
                config={k: v for k, v in vars(a).items() if k not in ("json", "markdown", "plot")})
    table = ["| recipe | final train loss (last 10%) | vs bf16 | held-out loss | vs bf16 | vs untrained adapter |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        train_loss = "–" if r["final_train_loss"] is None else f"{r['final_train_loss']:.4f}"
        vs_untrained = ("–" if "learns" not in r else
                        f"{r['eval_loss_vs_untrained']:+.1%} ({'learns' if r['learns'] else 'FAILS the bar'})")
        table.append(f"| {r['recipe']} | {train_loss} | {r.get('final_train_loss_vs_bf16', 0):+.2%} | "
                     f"{r['eval_loss']:.4f} | {r.get('eval_loss_vs_bf16', 0):+.2%} | {vs_untrained} |")
    write_results({"meta": info, "rows": rows}, table, f"{info['device']}, torch {info['torch']}, {info['corpus']}",
                  a.json, a.markdown)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for r in rows:
            if not r["losses"]:
                continue
            ax.plot(r["losses"], label=f"{r['recipe']} (held-out {r['eval_loss']:.3f})", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"{info['device']}: {a.layers}x{a.hidden} Llama, Python docs corpus", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
