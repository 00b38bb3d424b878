#!/usr/bin/env python
"""How much of the perplexity that post-training quantization (PTQ) loses does QAT recover?

    python benchmarks/eval_qat.py --json docs/results/qat_h200.json --markdown docs/results/qat_h200.md

1. Pretrain a Llama-style model from scratch on real text (English prose that ships with CPython,
   `benchmarks.corpus.python_docs_corpus`, BPE trained here, 10% of the documents held out): the base.
2. From the base, fine-tune the same number of steps on the same batches twice: plain (bf16
   autocast) and with QAT fake quantization (`hf_lowbit.qat`), then convert both with torchao.
3. Held-out perplexity of: the base; the base PTQ'd; the bf16 fine-tune; the bf16 fine-tune PTQ'd
   (what PTQ loses); the QAT fine-tune converted (what QAT keeps). All evaluated in float32.

recovered = (ppl[ft PTQ] - ppl[QAT converted]) / (ppl[ft PTQ] - ppl[ft bf16]), and the same in held-out loss
(log perplexity): PTQ's loss increase (% of the bf16 fine-tune's loss) and the share QAT recovers, per seed and
their mean, min, max and standard deviation.

Where PTQ hurts: `--include_lm_head` quantizes the LM head too (PTQ and QAT alike), `--group_size` as large as
`--hidden` makes most weights one group per row, `--group_size -1` quantizes every weight per channel (one scale per
row, whatever the layer's `in_features`; `8da4w` and `int4_weight_only`), and `--scheme` picks the format
(`int4_tinygemm` converts on a CUDA GPU only). Measured settings are in docs/qat.md.

Where PTQ hurts, a second task: `--task arithmetic --digits D` pretrains and fine-tunes on generated additions of
operands 0 .. 10^D - 1 (`hf_lowbit.data.arithmetic_records`, the embedded default of `hf-lowbit-sft` at D = 2;
character tokenizer, one problem per row: "123+456=579</s>", right-padded), the loss on the answer and its EOS only;
the held-out problems (`--task_eval`) are operand pairs that no training problem has (`--task_train` drawn from the
others), both from `--seed` alone. Held-out "perplexity" is then the answer tokens' (exp of their mean NLL), and each
model's exact-match accuracy (every answer token and the EOS the argmax given the right prefix: what greedy decoding
gets right) is reported beside it.

The corpus is small (~400k tokens), so the defaults train for few epochs (a model that memorizes the
training half tells nothing about held-out text); `--repeats N` repeats steps 1-3 from N seeds (same
data and tokenizer) and reports the mean perplexities, the recovery of the means and each seed's.

Seeds: the corpus split and the tokenizer come from `--seed` S alone; the models of a run are seeded
S+K .. S+K+N-1 for `--repeats N --repeat_from K` (K = 0 by default), each record in the JSON's "repeats" naming
its seed. Where one seed fills a device call, run the seeds in separate calls and join them:

    python benchmarks/eval_qat.py ... --repeats 1 --repeat_from 0 --json OUT/s0.json   # seed S
    python benchmarks/eval_qat.py ... --repeats 1 --repeat_from 1 --json OUT/s1.json   # seed S+1, another call
    python benchmarks/eval_qat.py --merge OUT/s0.json OUT/s1.json --json OUT/all.json --markdown OUT/all.md

`--merge` writes what one `--repeats 2` run would (the same summary, seeds in order; meta.seeds, and meta.merged the
files with their seeds). It refuses runs whose recorded flags (meta.config) differ in anything but --repeats,
--repeat_from and the corpus cache's path, and a seed that two files hold; a file that does not exist is said and
left out. A partial JSON (a run cut short, meta.partial) merges too: the seeds it finished.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.corpus import corpus_blocks  # noqa: E402
from benchmarks.driver import (add_int_flags, llama_config, meta, save_json, spread, train_step,  # noqa: E402
                               write_results)
from hf_lowbit.qat import PER_CHANNEL, QAT_SCHEMES, QATConfig, convert_qat, prepare_qat  # noqa: E402
from hf_lowbit.qat.linear import group_label  # noqa: E402


_T0 = time.time()


def log(msg: str) -> None:
    """A progress line with the seconds since start (flushed: a device call cut short keeps what was printed)."""
    print(f"[{time.time() - _T0:6.0f} s] {msg}", flush=True)


def batch_order(n_blocks: int, steps: int, batch: int, seed: int):
    """The block indices of each of :func:`train`'s ``steps`` batches: ``batch`` drawn at random (with replacement)
    from ``n_blocks``, by a generator seeded ``seed``."""
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randint(0, n_blocks, (batch,), generator=order)


def dynamo_counts() -> tuple[int, int]:
    """(frames Dynamo has compiled, graph breaks it has met) so far in this process: recompiles count as frames."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], sum(counters["graph_break"].values())


def train(model, blocks, a, steps: int, lr: float, seed: int, fwd=None, label: str = "train",
          stats: dict | None = None) -> list[float]:
    """AdamW with warm-up + cosine, bf16 autocast, random batches drawn from ``seed`` (same for every run).

    Logs one line for the phase (``label``): the first step's seconds (compile and autotuning included), the median
    of the others, the frames Dynamo compiled in the first step and after it (recompiles), its graph breaks; the
    same numbers go into ``stats`` if given. Each step ends with ``.item()`` on its loss, which waits for the device.
    """
    fwd = model if fwd is None else fwd  # a compiled module has no truth value (no len)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / steps))))
    losses, seconds = [], []
    start, after_first = dynamo_counts(), None
    model.train()
    for idx in batch_order(blocks.shape[0], steps, a.batch, seed):
        t = time.perf_counter()
        ids = blocks[idx].to(a.device)
        batch = (ids, targets(a, ids)) if arithmetic(a) else ids
        losses.append(train_step(model, [batch], opt, fwd=fwd, autocast=True, clip=1.0, sched=sched)[0].item())
        seconds.append(time.perf_counter() - t)
        after_first = after_first or dynamo_counts()
    end = dynamo_counts()
    after_first = after_first or end
    rest = sorted(seconds[1:])
    out = {"first_step_s": seconds[0] if seconds else None, "step_s": rest[len(rest) // 2] if rest else None,
           "frames_first_step": after_first[0] - start[0], "recompiles": end[0] - after_first[0],
           "graph_breaks": end[1] - start[1]}
    if stats is not None:
        stats.update(out)
    if steps:
        from torch._inductor import config as inductor_config

        tuning = ", Inductor coordinate-descent autotuning on" if inductor_config.coordinate_descent_tuning else ""
        log(f"{label}: step 1 {out['first_step_s']:.1f} s, {out['frames_first_step']} frame(s) compiled; then "
            + (f"{out['step_s'] * 1e3:.1f} ms/step (median of {len(rest)}); " if rest else "")
            + f"{out['recompiles']} recompiles, {out['graph_breaks']} graph breaks{tuning}")
    return losses


@torch.no_grad()
def perplexity(model, blocks, a) -> float:
    """exp(mean token loss) over the held-out blocks, float32, no autocast (``--task arithmetic``: over the answer
    tokens and their EOS, :func:`targets`)."""
    model.eval()
    if arithmetic(a):
        return math.exp(answer_eval(model, blocks, a)[0])
    total = count = 0.0
    for b in blocks.split(a.batch):
        b = b.to(a.device)
        total += model(input_ids=b, labels=b).loss.item() * b.numel()
        count += b.numel()
    return math.exp(total / count)


# ------------------------------------------------------------------------------------------ --task arithmetic
def arithmetic(a) -> bool:
    """Whether the run's task is ``--task arithmetic`` (scripts that share :func:`perplexity` have no --task)."""
    return getattr(a, "task", "corpus") == "arithmetic"


@functools.cache
def char_tokenizer():
    """The character tokenizer of ``hf-lowbit-sft``'s embedded arithmetic (digits, '+', '='; pad 0, EOS 3)."""
    from hf_lowbit.data.records import ARITHMETIC_CHARS, build_char_tokenizer

    return build_char_tokenizer(ARITHMETIC_CHARS)


def answer_labels(ids: torch.Tensor, eq_id: int, pad_id: int) -> torch.Tensor:
    """``ids`` with -100 on the prompt (up to and including its first '=') and on the padding: the labels of the
    answer tokens and their EOS only."""
    after = (ids == eq_id).int().cumsum(1) - (ids == eq_id).int() > 0  # strictly after the first '='
    return ids.masked_fill(~after | (ids == pad_id), -100)


def targets(a, ids: torch.Tensor) -> torch.Tensor:
    """The labels of ``ids``: ids themselves, or the answer's alone with ``--task arithmetic``."""
    if not arithmetic(a):
        return ids
    tok = char_tokenizer()
    return answer_labels(ids, tok.convert_tokens_to_ids("="), tok.pad_token_id)


def problem_rows(records: list[dict], digits: int) -> torch.Tensor:
    """One row per problem, ``prompt + completion + EOS`` right-padded to 3 * digits + 4 tokens (the longest:
    D + '+' + D + '=' + D + 1 + EOS)."""
    tok = char_tokenizer()
    rows = torch.full((len(records), 3 * digits + 4), tok.pad_token_id, dtype=torch.long)
    ids = tok([r["prompt"] + r["completion"] for r in records], add_special_tokens=False)["input_ids"]
    for i, row in enumerate(ids):
        row = row + [tok.eos_token_id]
        rows[i, : len(row)] = torch.tensor(row)
    return rows


def arithmetic_data(a):
    """``(tokenizer, training rows, held-out rows, record)`` of ``--task arithmetic``: ``a.task_train`` problems of
    ``a.digits``-digit operands drawn from the pairs not held out, ``a.task_eval`` held-out pairs, split by
    ``a.seed`` (``hf_lowbit.data.arithmetic_records``)."""
    from hf_lowbit.data.records import arithmetic_records

    if a.digits < 1:
        raise SystemExit(f"--digits {a.digits}: need at least 1")
    train_records, eval_records = arithmetic_records(a.task_train, a.task_eval, seed=a.seed,
                                                     max_operand=10 ** a.digits - 1)
    train_rows, eval_rows = problem_rows(train_records, a.digits), problem_rows(eval_records, a.digits)
    record = {"task": "arithmetic", "digits": a.digits, "train_problems": len(train_records),
              "distinct_train_pairs": len({r["prompt"] for r in train_records}), "eval_problems": len(eval_records)}
    log(f"arithmetic: {a.digits}-digit additions, {record['train_problems']} training problems "
        f"({record['distinct_train_pairs']} distinct), {record['eval_problems']} held-out pairs")
    return char_tokenizer(), train_rows, eval_rows, record


@torch.no_grad()
def answer_eval(model, rows, a) -> tuple[float, float]:
    """(mean NLL of the answer tokens and EOS, share of rows whose every answer token and EOS is the argmax) over
    ``rows``, float32, no autocast."""
    model.eval()
    total = count = correct = 0.0
    for b in rows.split(max(a.batch, 256)):
        b = b.to(a.device)
        labels = targets(a, b)[:, 1:]
        logits = model(input_ids=b).logits[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                 reduction="sum").item()
        mask = labels != -100
        count += mask.sum().item()
        correct += ((logits.argmax(-1) == labels) | ~mask).all(1).sum().item()
    return total / count, correct / rows.shape[0]


def recovery(ppl: dict) -> tuple[float, float]:
    """(perplexity PTQ loses, the share of it QAT recovers) from the held-out perplexities ``ppl``."""
    lost = ppl["fine-tuned PTQ"] - ppl["fine-tuned bf16"]
    return lost, (ppl["fine-tuned PTQ"] - ppl["QAT fine-tuned, converted"]) / lost if lost > 0 else float("nan")


def loss_recovery(ppl: dict) -> dict:
    """The same in held-out loss (mean token NLL = log perplexity): PTQ's loss increase relative to the bf16
    fine-tune's loss, and the share of that increase QAT recovers."""
    bf16, ptq_, qat = (math.log(ppl[k]) for k in ("fine-tuned bf16", "fine-tuned PTQ", "QAT fine-tuned, converted"))
    lost = ptq_ - bf16
    return {"loss_bf16": bf16, "loss_ptq": ptq_, "loss_qat": qat, "ptq_loss_increase": lost / bf16,
            "qat_loss_increase": (qat - bf16) / bf16,
            "recovered_loss": (ptq_ - qat) / lost if lost > 0 else float("nan")}


def ptq(model, config: QATConfig, exclude: tuple[str, ...] = ("lm_head",)):
    """A converted copy of ``model`` (no training): torchao's quantization of its weights as they are.

    ``exclude``: module names or globs left as they are (the LM head is quantized anyway with
    ``config.include_lm_head``)."""
    q = copy.deepcopy(model)
    prepare_qat(q, config, exclude=exclude, include_lm_head=config.include_lm_head)
    convert_qat(q, config)
    return q


def add_corpus_flags(p: argparse.ArgumentParser) -> None:
    """--corpus_packages, --corpus_cache, --corpus_only (:func:`load_corpus` reads them)."""
    p.add_argument("--corpus_packages", default="",
                   help="comma-separated installed packages whose docstrings join the corpus (e.g. "
                        "torch,transformers,sympy,networkx,numpy, ~5.6M tokens: room for a larger model to train without "
                        "repeating the text)")
    p.add_argument("--corpus_cache", default=None, metavar="DIR",
                   help="keep the tokenized corpus in DIR and reuse it (built once, e.g. on the CPU machine, and "
                        "carried to the GPU: the package corpus takes minutes to build)")
    p.add_argument("--corpus_only", action="store_true",
                   help="build (or check) the --corpus_cache entry for these flags, then stop")


def load_corpus(a):
    """The corpus of the flags (``a.seq``, ``a.vocab``, ``a.seed``, ``a.max_docs`` and :func:`add_corpus_flags`'):
    ``(tokenizer, train blocks, held-out blocks, its record)``, with a progress line; a package that is not installed
    stops the run."""
    try:
        tok, train_blocks, eval_blocks, corpus = corpus_blocks(
            a.seq, a.vocab, seed=a.seed, max_docs=a.max_docs,
            packages=tuple(x for x in a.corpus_packages.split(",") if x), cache_dir=a.corpus_cache)
    except ValueError as e:  # a package that is not installed
        raise SystemExit(f"--corpus_packages: {e}") from None
    log(f"corpus: {corpus['documents']} documents, {train_blocks.numel()} training and {eval_blocks.numel()} "
        f"held-out tokens")
    return tok, train_blocks, eval_blocks, corpus


def halves(train_blocks):
    """(pre-training blocks, fine-tuning blocks): disjoint halves of the training blocks."""
    half = train_blocks.shape[0] // 2
    return train_blocks[:half], train_blocks[half:]


def pretrain(a, model_config, blocks, seed: int, label: str = "pre-training", stats: dict | None = None):
    """A model of ``model_config`` seeded by ``seed``, pre-trained ``a.pretrain_steps`` steps at ``a.pretrain_lr``
    on ``blocks`` (batches drawn from ``seed``; compiled with ``a.compile``): ``(model, its per-step losses)``."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(model_config).to(a.device)
    losses = train(base, blocks, a, a.pretrain_steps, a.pretrain_lr, seed, torch.compile(base) if a.compile else None,
                   label=label, stats=stats)
    return base, losses


def build_parser() -> argparse.ArgumentParser:
    """The script's flags (tools/arith_ptq_pilot.py adds its own to them)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # defaults sized to the corpus (~200k tokens per half): ~3 pre-training epochs, ~1 fine-tuning epoch
    add_int_flags(p, layers=4, hidden=512, intermediate=1536, heads=8, kv_heads=4, seq=256, batch=8, pretrain_steps=300,
                  finetune_steps=100, vocab=4096, seed=0, repeats=1, max_docs=0, eval_blocks=0)
    p.add_argument("--scheme", default="8da4w", choices=list(QAT_SCHEMES))
    p.add_argument("--group_size", type=int, default=256, metavar="N",
                   help=f"weight group size along in_features (int4_tinygemm: 32-256; layers it does not divide stay "
                        f"in float), or {PER_CHANNEL} for per channel: one scale per weight row, every layer (8da4w, "
                        "int4_weight_only)")
    p.add_argument("--pretrain_lr", type=float, default=2e-3)
    p.add_argument("--finetune_lr", type=float, default=3e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    add_corpus_flags(p)
    p.add_argument("--task", choices=("corpus", "arithmetic"), default="corpus",
                   help="corpus: the text corpus (default); arithmetic: generated additions, the loss and accuracy on "
                        "the answers, held-out operand pairs never trained on (--digits, --task_train, --task_eval; "
                        "--seq and --vocab unused)")
    p.add_argument("--digits", type=int, default=3, help="--task arithmetic: operands 0 .. 10^D - 1")
    p.add_argument("--task_train", type=int, default=100000, metavar="N",
                   help="--task arithmetic: training problems (halves: pre-training, fine-tuning)")
    p.add_argument("--task_eval", type=int, default=2000, metavar="N",
                   help="--task arithmetic: held-out problems (operand pairs no training problem has)")
    p.add_argument("--include_lm_head", action="store_true",
                   help="quantize the LM head too (PTQ and QAT): int4 everywhere but the input embedding")
    p.add_argument("--repeat_from", type=int, default=0, metavar="K",
                   help="skip the first K repeats: this run's model seeds are --seed+K .. --seed+K+REPEATS-1 (the "
                        "corpus split and tokenizer still from --seed), e.g. --repeats 1 --repeat_from 2: the third "
                        "seed alone, one device call per seed, joined by --merge")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="join the seeds of several runs' JSON (full or partial) into one summary, as one run of all "
                        "their seeds would write it (the other flags but --json and --markdown are ignored); refused if "
                        "their configurations differ (but for --repeats, --repeat_from, the corpus cache's path and "
                        "the output paths) or a seed repeats; a missing file is left out")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    return p


def main():
    a = build_parser().parse_args()
    if a.merge:
        merge(a.merge, a.json, a.markdown)
        return
    if a.repeats < 1 or a.repeat_from < 0:
        raise SystemExit(f"--repeats {a.repeats} --repeat_from {a.repeat_from}: need REPEATS >= 1 and K >= 0")
    t0 = time.time()
    prepared = setup(a)
    if prepared is None:  # --corpus_only
        return
    config, model_config, pre_blocks, ft_blocks, eval_blocks, info = prepared
    repeats = []
    for i in range(a.repeats):
        seed = a.seed + a.repeat_from + i
        repeats.append(run_once(a, config, model_config, pre_blocks, ft_blocks, eval_blocks, seed))
        if i + 1 < a.repeats and a.json:  # the seeds done so far, in case the run is cut short (rewritten at the end)
            save_json(a.json, {"meta": meta(a.device, key="device", seconds=time.time() - t0, partial=True, **info),
                               "repeats": repeats})
    summarize(repeats, meta(a.device, key="device", seconds=time.time() - t0, **info), a.json, a.markdown)


def setup(a):
    """What every seed of a run shares, from its flags: ``(QATConfig, the model's LlamaConfig, pre-training blocks,
    fine-tuning blocks, held-out blocks, the JSON's meta)``; ``None`` with ``--corpus_only`` (the corpus built)."""
    try:
        config = QATConfig(a.scheme, a.group_size, include_lm_head=a.include_lm_head)
    except ValueError as e:
        raise SystemExit(f"--group_size {a.group_size} --scheme {a.scheme}: {e}") from None

    if arithmetic(a):
        tok, train_blocks, eval_blocks, corpus = arithmetic_data(a)
    else:
        tok, train_blocks, eval_blocks, corpus = load_corpus(a)
    if a.corpus_only:
        return None
    if a.eval_blocks:  # a smaller held-out set (smoke runs)
        eval_blocks = eval_blocks[: a.eval_blocks]
    # pretraining and fine-tuning see disjoint halves of the training blocks
    pre_blocks, ft_blocks = halves(train_blocks)

    # an arithmetic row is 3 * digits + 4 tokens: the positions the model needs
    model_config = llama_config(argparse.Namespace(**{**vars(a), "seq": train_blocks.shape[1]}) if arithmetic(a) else a,
                                len(tok))
    epochs = {"pretrain": a.pretrain_steps * a.batch / pre_blocks.shape[0],
              "finetune": a.finetune_steps * a.batch / ft_blocks.shape[0]}
    if max(epochs.values()) > 4 and not arithmetic(a):  # arithmetic: held-out pairs are never trained on
        print(f"warning: {epochs['pretrain']:.1f} pre-training / {epochs['finetune']:.1f} fine-tuning epochs over this "
              "small corpus: the model memorizes it and held-out perplexity says little", flush=True)
    # what every JSON records, the partial ones too (--merge checks the config and builds the header from it)
    # the task's flags are recorded only with --task arithmetic: a corpus run's JSON is what it was before them
    info = {"corpus": {**{k: corpus[k] for k in ("documents", "packages", "built_on", "cache", "task", "digits",
                                                 "train_problems", "distinct_train_pairs", "eval_problems")
                          if k in corpus},
                       "pretrain_tokens": pre_blocks.numel(), "finetune_tokens": ft_blocks.numel(),
                       "eval_tokens": eval_blocks.numel()},
            "epochs": epochs, "weights": f"{a.scheme}, {config.granularity}",
            "config": {k: v for k, v in vars(a).items() if k not in ("json", "markdown", "merge")
                       and (arithmetic(a) or k not in TASK_FLAGS)}}
    return config, model_config, pre_blocks, ft_blocks, eval_blocks, info


# the flags of --task arithmetic (recorded in meta.config only when it is the task)
TASK_FLAGS = ("task", "digits", "task_train", "task_eval")

# the configuration flags that may differ between runs whose seeds --merge joins (the output paths are not recorded;
# the corpus cache is where the same tokenized corpus is kept, not what it holds)
MERGE_FREE = ("repeats", "repeat_from", "corpus_cache")


def merge(paths: list[str], json_path: str | None, markdown_path: str | None) -> None:
    """Join the per-seed records of the runs in ``paths`` (full or partial JSON) and summarize them as one run of
    all their seeds would: refused if two runs' ``meta.config`` differ outside :data:`MERGE_FREE` or a seed
    occurs twice; a file that does not exist is said and left out."""
    first, repeats, merged, where = None, [], [], {}
    for path in paths:
        if not os.path.exists(path):  # a call that did not run (or ran out of time before its first seed)
            print(f"--merge: {path} does not exist; merging the others", flush=True)
            continue
        with open(path) as f:
            part = json.load(f)
        info = part.get("meta", {})
        if "config" not in info:
            raise SystemExit(f"--merge: {path} records no meta.config (written before --merge existed): cannot check "
                             "that its runs match the others")
        if first is None:
            first = (path, info)
        config, ref = ({k: v for k, v in c.items() if k not in MERGE_FREE} for c in (info["config"], first[1]["config"]))
        if config != ref:
            diff = ", ".join(f"{k} {config.get(k, '(none)')!r} vs {ref.get(k, '(none)')!r}"
                             for k in sorted(set(config) | set(ref)) if config.get(k) != ref.get(k))
            raise SystemExit(f"--merge: {path}: its configuration differs from {first[0]}'s: {diff}")
        for r in part["repeats"]:
            if r["seed"] in where:
                raise SystemExit(f"--merge: {path}: seed {r['seed']} is in {where[r['seed']]} too")
            where[r["seed"]] = path
        repeats += part["repeats"]
        merged.append({"file": os.path.basename(path), "seeds": [r["seed"] for r in part["repeats"]],
                       **{k: info.get(k) for k in ("commit", "command", "seconds", "partial") if k in info}})
    if first is None:
        raise SystemExit(f"--merge: none of {' '.join(paths)} exists")
    if not repeats:
        raise SystemExit(f"--merge: {' '.join(m['file'] for m in merged)} hold no finished seed")
    if len({m.get("commit") for m in merged}) > 1:
        print("--merge: the runs measured different commits: " + ", ".join(f"{m['file']} {m.get('commit')}"
                                                                            for m in merged), flush=True)
    info = {k: v for k, v in first[1].items() if k not in ("command", "seconds", "partial")}
    repeats.sort(key=lambda r: r["seed"])
    # the flags the runs share (each run's seed selection: meta.merged), the seeds joined, the time they took in all
    info.update(config={k: v for k, v in info["config"].items() if k not in ("repeats", "repeat_from")},
                seeds=[r["seed"] for r in repeats], seconds=sum(m.get("seconds") or 0 for m in merged), merged=merged,
                command=" ".join(sys.argv))
    summarize(repeats, info, json_path, markdown_path)


def summarize(repeats: list[dict], info: dict, json_path: str | None, markdown_path: str | None) -> dict:
    """The result of the per-seed records ``repeats`` (``run_once``'s): mean perplexities, the recovery of the means,
    the held-out loss's spread over the seeds, and its table; ``info`` is the JSON's meta (its ``config``: the
    run's flags). Written to ``json_path`` / ``markdown_path``; returned."""
    c, n = info["config"], len(repeats)
    # mean perplexity of each model over the repeats; the recovery of the means (pooled over repeats)
    rows = {k: sum(r["perplexity"][k] for r in repeats) / n for k in repeats[0]["perplexity"]}
    lost, recovered = recovery(rows)
    loss = {k: spread([r["loss"][k] for r in repeats]) for k in repeats[0]["loss"]}
    result = {"meta": info, "perplexity": rows, "ptq_loss": lost, "recovered": recovered, "loss": loss,
              "repeats": repeats}
    what = "held-out answer perplexity" if c.get("task") == "arithmetic" else "held-out perplexity"
    head = (f"| model ({c['scheme']}, {group_label(c['group_size'])}{', LM head too' if c['include_lm_head'] else ''}) | "
            f"{what}" + (f", mean of {n} seeds | per seed |" if n > 1 else " |"))
    table = [head, "|---|---|" + ("---|" if n > 1 else "")]
    for k, v in rows.items():
        table.append(f"| {k} | {v:.3f} |" + (" " + " / ".join(f"{r['perplexity'][k]:.3f}" for r in repeats) + " |"
                                              if n > 1 else ""))
    table.append(f"| **QAT recovers** | **{recovered:.0%}** of the {lost:.3f} perplexity PTQ loses |" + (
        " " + " / ".join(f"{r['recovered']:.0%}" for r in repeats) + " |" if n > 1 else ""))
    inc, rec = loss["ptq_loss_increase"], loss["recovered_loss"]
    seeds = ", ".join(str(r["seed"]) for r in repeats)
    table += ["", f"Held-out loss ({n} seed{'s' if n > 1 else ''}: {seeds}; mean, min-max, std):", "",
              "| | mean | min | max | std | per seed |", "|---|---|---|---|---|---|"]
    for key, label in (("ptq_loss_increase", "PTQ loss increase"), ("qat_loss_increase", "QAT (converted) loss increase"),
                       ("recovered_loss", "**QAT recovers** (of PTQ's loss increase)")):
        st = loss[key]
        table.append(f"| {label} | {st['mean']:.2%} | {st['min']:.2%} | {st['max']:.2%} | {st['std']:.2%} | "
                     + " / ".join(f"{r['loss'][key]:.2%}" for r in repeats) + " |")
    if "accuracy" in repeats[0]:  # --task arithmetic: exact match on the held-out problems
        acc = {k: spread([r["accuracy"][k] for r in repeats]) for k in repeats[0]["accuracy"]}
        result["accuracy"] = acc
        table += ["", f"Held-out exact-match accuracy ({n} seed{'s' if n > 1 else ''}; mean, min-max, std):", "",
                  "| model | mean | min | max | std | per seed |", "|---|---|---|---|---|---|"]
        for k, st in acc.items():
            table.append(f"| {k} | {st['mean']:.2%} | {st['min']:.2%} | {st['max']:.2%} | {st['std']:.2%} | "
                         + " / ".join(f"{r['accuracy'][k]:.2%}" for r in repeats) + " |")
    print(f"PTQ loss increase {inc['mean']:.2%} (min {inc['min']:.2%}); QAT recovers {rec['mean']:.0%} "
          f"(min {rec['min']:.0%}, max {rec['max']:.0%}, std {rec['std']:.0%}) over {n} seed(s)", flush=True)
    epochs = info["epochs"]
    merged = f", merged from {len(info['merged'])} runs" if info.get("merged") else ""
    write_results(result, table, f"{info['device']}, torch {info['torch']}, {info['corpus']}, epochs "
                  f"{epochs['pretrain']:.1f} + {epochs['finetune']:.1f}, {info['seconds']:.0f} s{merged}",
                  json_path, markdown_path)
    return result


def run_once(a, config: QATConfig, model_config, pre_blocks, ft_blocks, eval_blocks, seed: int) -> dict:
    """Pretrain a base from ``seed``, fine-tune it plain and with QAT on the same batches, evaluate all."""
    base, pre_losses = pretrain(a, model_config, pre_blocks, seed, label=f"seed {seed}: pre-training")
    log(f"seed {seed}: pre-trained {a.pretrain_steps} steps, last loss {pre_losses[-1]:.3f}")
    acc = {} if arithmetic(a) else None  # exact match of each model, --task arithmetic

    def evaluate(key, model):
        if acc is None:
            rows[key] = perplexity(model, eval_blocks, a)
            return
        nll, acc[key] = answer_eval(model, eval_blocks, a)
        rows[key] = math.exp(nll)

    rows = {}
    evaluate("base bf16", base)
    evaluate("base PTQ", ptq(base, config))
    log(f"seed {seed}: base perplexity {rows['base bf16']:.3f}, its PTQ {rows['base PTQ']:.3f}"
        + (f"; exact match {acc['base bf16']:.2%}, its PTQ {acc['base PTQ']:.2%}" if acc is not None else ""))
    runs = {}
    for kind in ("bf16", "qat"):
        model = copy.deepcopy(base)
        if kind == "qat":
            report = prepare_qat(model, config, include_lm_head=config.include_lm_head)
            print(report.summary(), flush=True)
        runs[kind] = train(model, ft_blocks, a, a.finetune_steps, a.finetune_lr, seed + 1,
                           torch.compile(model) if a.compile else None, label=f"seed {seed}: fine-tuning ({kind})")
        log(f"seed {seed}: fine-tuned ({kind}) {a.finetune_steps} steps, last loss {runs[kind][-1]:.3f}")
        if kind == "bf16":
            evaluate("fine-tuned bf16", model)
            evaluate("fine-tuned PTQ", ptq(model, config))
        else:
            evaluate("QAT fine-tuned, fake quant", model)
            convert_qat(model, config)
            evaluate("QAT fine-tuned, converted", model)
    _, recovered = recovery(rows)
    loss = loss_recovery(rows)
    print(f"seed {seed}: {rows}, QAT recovers {recovered:.0%} of the perplexity, {loss['recovered_loss']:.0%} of the "
          f"{loss['ptq_loss_increase']:.2%} loss PTQ adds", flush=True)
    if acc is not None:
        print(f"seed {seed}: exact-match accuracy " + ", ".join(f"{k} {v:.2%}" for k, v in acc.items()), flush=True)
    return {"seed": seed, "perplexity": rows, "recovered": recovered, "loss": loss, "pretrain_losses": pre_losses,
            "finetune_losses": runs, **({"accuracy": acc} if acc is not None else {})}

if __name__ == "__main__":
    main()
