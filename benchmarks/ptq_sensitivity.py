#!/usr/bin/env python
"""Where does int4 post-training quantization (PTQ) hurt? Pretrain a few base models, PTQ each several ways.

    python benchmarks/ptq_sensitivity.py --plan                     # the configurations, their H200 estimates
    python benchmarks/ptq_sensitivity.py --compile --corpus_packages torch,transformers,sympy,networkx,numpy \\
        --corpus_cache .corpus_cache --vocab 8192 --eval_blocks 512 --json OUT/ptq.json --markdown OUT/ptq.md

Issue 26 wants a model whose int4 PTQ costs >= 2% held-out loss, to measure what QAT recovers of it
(`eval_qat.py`, stage `qat_ptq_hurts`). The 143M Llama pre-trained ~1 epoch at lr 2e-3 lost only 0.08% (H200,
c73fbe2). This sweep looks for a setting from data: no fine-tuning and no QAT, only

1. pretraining each base model of `--configs` exactly as `eval_qat.py` pretrains its base (its `pretrain()`: same
   corpus, same pre-training half of the training blocks, seed `--seed`, AdamW with warm-up + cosine, bf16
   autocast), so a row here is `eval_qat.py`'s "base bf16" / "base PTQ" for the flags the row lists;
2. held-out loss (mean token NLL, float32: `eval_qat.perplexity()`) of the base, and its loss on as many blocks it
   was trained on (the train / held-out gap: a base that only memorized shows a large gap);
3. for each PTQ variant of `--variants` (torchao's convert through `hf_lowbit.qat`, `eval_qat.ptq()`), the
   PTQ'd model's held-out loss and its increase, (PTQ loss - base loss) / base loss.

Each base record also holds what the literature ties to PTQ damage: tokens per parameter ("Scaling Laws for
Precision", Kumar et al. 2024: more tokens per parameter, more damage), the pre-training rate, and the weights'
outliers (max |w| / std and excess kurtosis of the linears).

A variant is `SCHEME:GROUP[:nohead]`: SCHEME an int4 scheme of `hf_lowbit.qat.QAT_SCHEMES` (`int4_weight_only`:
symmetric, weights only; `8da4w`: the same weights, int8 dynamic activations; both torchao's IntxUnpacked layout,
converted on any device; `int4_tinygemm`: asymmetric, bf16 activations, groups 32/64/128/256 only, converts on a
CUDA GPU only, so its rows are skipped elsewhere with one line saying why); GROUP a group size along
`in_features`, `hidden` (the model's hidden size, as `eval_qat.py --group_size HIDDEN` would quantize: layers
whose `in_features` is not a multiple of it stay unquantized, each row says which) or `ch` (per channel: one
scale per output row, whatever each layer's `in_features`: `QATConfig(group_size=PER_CHANNEL)`, torchao's
`PerAxis(0)`; `eval_qat.py --group_size -1`, which QAT-trains it too); `:nohead` leaves the LM head in float (else
it is quantized too). The
input embedding is never quantized (as in `eval_qat.py`). The QAT schemes are int4 only: there are no
lower-bit reference rows.

`--deadline_s S` skips a base whose expected end falls past S seconds since the process started (expected: as long as the last
base of the same shape and steps took, else its H200 estimate), so a device call ends with its files written; the
JSON and markdown are rewritten (atomically) after every base, with `meta.partial` until the last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import re
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch import nn  # noqa: E402

from benchmarks.driver import llama_config, meta, write_results  # noqa: E402
from benchmarks.eval_qat import (add_corpus_flags, batch_order, halves, load_corpus, log, perplexity,  # noqa: E402
                                 pretrain, ptq)
from hf_lowbit.qat import PER_CHANNEL, QAT_SCHEMES, QATConfig, cuda_capability_problem  # noqa: E402

# the base models (pretraining only): shape, batch (of --seq tokens), steps, peak rate. Estimates: plan().
PRESETS = {
    # small model, many tokens per parameter (~4.8 epochs of the package corpus's pre-training half), high rate
    "s6x512_lr1e-2": dict(layers=6, hidden=512, intermediate=1536, heads=8, kv_heads=4, batch=32, steps=1500, lr=1e-2),
    "s6x512_lr3e-3": dict(layers=6, hidden=512, intermediate=1536, heads=8, kv_heads=4, batch=32, steps=1500, lr=3e-3),
    # the 143M Llama of qat_ptq_hurts (~1.2 epochs) at higher rates than the 2e-3 that cost 0.08%
    "m12x1024_lr8e-3": dict(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4, batch=8, steps=1500,
                            lr=8e-3),
    "m12x1024_lr4e-3": dict(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4, batch=8, steps=1500,
                            lr=4e-3),
    # the setting measured at c73fbe2 (PTQ int4_tinygemm g256 + LM head: +0.08% after fine-tuning), for reference
    "m12x1024_lr2e-3": dict(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4, batch=8, steps=1500,
                            lr=2e-3),
}
# same shapes next to each other (one compile each); the lr 2e-3 control last, where --deadline_s may skip it
DEFAULT_CONFIGS = "s6x512_lr1e-2,s6x512_lr3e-3,m12x1024_lr8e-3,m12x1024_lr4e-3,m12x1024_lr2e-3"
CONFIG_KEYS = {"layers": int, "hidden": int, "intermediate": int, "heads": int, "kv_heads": int, "batch": int,
               "steps": int, "lr": float}
DEFAULT_VARIANTS = ("int4_weight_only:32,int4_weight_only:64,int4_weight_only:128,int4_weight_only:256,"
                    "int4_weight_only:hidden,int4_weight_only:ch,int4_weight_only:128:nohead,int4_weight_only:ch:nohead,"
                    "int4_tinygemm:64,int4_tinygemm:128,int4_tinygemm:256,int4_tinygemm:256:nohead,"
                    "8da4w:256,8da4w:ch")
INT4_SCHEMES = ("int4_weight_only", "8da4w", "int4_tinygemm")

# H200 time estimates (seconds), calibrated on qat_ptq_hurts seed 0 (c73fbe2, docs/results/qat_ptq_hurts_h200_seed0
# .log): the 143M model (12 x 1024, MLP 2816, vocab 8192), 1500 compiled steps of 8 x 256 tokens, was pre-trained
# 83 s after start: 2.69e15 model FLOPs (6 x 142.6M matmul parameters x 3.07M tokens + attention); counted as
# COMPILE_S of compiling and the rest at TRAIN_FLOPS. Base + PTQ'd held-out evaluation (2 x 574k tokens, float32,
# batch 8, the convert included) took 15 s: 3.3e14 FLOPs at EVAL_FLOPS. Smaller models run their matmuls less
# efficiently (fewer FLOPs per launch), so their FLOP-scaled estimates are low bounds: STEP_FLOOR_S per step at least.
COMPILE_S, TRAIN_FLOPS, EVAL_FLOPS, STEP_FLOOR_S, VARIANT_OVERHEAD_S, STARTUP_S = 25.0, 46e12, 22e12, 0.012, 0.5, 15.0
# the pre-training half of the package corpus (torch,transformers,sympy,networkx,numpy; vocab 8192, seq 256, seed
# 0) as built for c73fbe2's run: the epochs --plan prints (a run counts its own corpus)
PACKAGE_PRETRAIN_TOKENS = 2_559_744


def parse_config(name: str, override: dict) -> dict:
    """A base model's configuration: the preset ``name`` with ``override`` (``--override``) applied."""
    if name not in PRESETS:
        raise SystemExit(f"--configs: unknown configuration {name!r}; presets: {', '.join(PRESETS)}")
    cfg = {**PRESETS[name], **override}
    label = name + ("" if not override else " (" + ",".join(f"{k}={v}" for k, v in override.items()) + ")")
    return {"name": label, **cfg}


def parse_override(text: str) -> dict:
    """``k=v,k=v`` (keys of :data:`CONFIG_KEYS`) -> dict, values typed."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in CONFIG_KEYS:
            raise SystemExit(f"--override: {item!r} is not KEY=VALUE with KEY one of {', '.join(CONFIG_KEYS)}")
        try:
            out[key] = CONFIG_KEYS[key](value)
        except ValueError:
            raise SystemExit(f"--override: {item!r}: {value!r} is not a {CONFIG_KEYS[key].__name__}") from None
    return out


def parse_variant(spec: str) -> dict:
    """``SCHEME:GROUP[:nohead]`` -> {"name", "scheme", "group" (int, "hidden" or "ch"), "include_lm_head"}."""
    parts = spec.strip().split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "nohead"):
        raise SystemExit(f"--variants: {spec!r} is not SCHEME:GROUP or SCHEME:GROUP:nohead")
    scheme, group = parts[0], parts[1]
    if scheme not in INT4_SCHEMES:
        raise SystemExit(f"--variants: {spec!r}: scheme must be one of the int4 schemes {', '.join(INT4_SCHEMES)}"
                         f"{' (fp8_rowwise is not int4)' if scheme in QAT_SCHEMES else ''}")
    if group not in ("hidden", "ch"):
        try:
            group = int(group)
        except ValueError:
            raise SystemExit(f"--variants: {spec!r}: GROUP must be an integer, 'hidden' or 'ch'") from None
        if group == PER_CHANNEL:
            group = "ch"  # the same variant as 'ch' (eval_qat.py's spelling)
    if isinstance(group, int) or group == "ch":
        try:
            QATConfig(scheme, PER_CHANNEL if group == "ch" else group)
        except ValueError as e:
            raise SystemExit(f"--variants: {spec!r}: {e}") from None
    elif QAT_SCHEMES[scheme].group_sizes is not None:
        raise SystemExit(f"--variants: {spec!r}: {scheme} takes groups of "
                         f"{', '.join(map(str, QAT_SCHEMES[scheme].group_sizes))} only (no {group!r})")
    head = len(parts) == 2
    what = {"ch": "per-channel", "hidden": "group = hidden"}.get(group, f"g{group}")
    name = f"{scheme} {what}{' + LM head' if head else ', LM head float'}"
    return {"name": name, "scheme": scheme, "group": group, "include_lm_head": head}


# ------------------------------------------------------------------------------------------------------ estimates
def model_counts(cfg: dict, vocab: int, seq: int) -> dict:
    """Parameters (all; without the two embeddings) and training FLOPs per token (6 x matmul parameters, the LM head
    included, + causal attention) of a Llama of ``cfg``'s shape (untied embeddings, as ``llama_config``)."""
    h, i, layers = cfg["hidden"], cfg["intermediate"], cfg["layers"]
    kv = h // cfg["heads"] * cfg["kv_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; MLP; two RMSNorms
    body = layers * per_layer + h
    matmul = layers * (2 * h * h + 2 * h * kv + 3 * h * i) + h * vocab
    attention = 6 * layers * seq * h  # QK^T and AV, forward + backward, causal (half the square)
    return {"params": body + 2 * h * vocab, "non_embedding_params": body, "matmul_params": matmul,
            "train_flops_per_token": 6 * matmul + attention, "eval_flops_per_token": 2 * matmul + attention // 3}


def estimate_h200_s(cfg: dict, vocab: int, seq: int, n_variants: int, eval_tokens: int) -> dict:
    """Estimated H200 seconds of one base (compile + pretraining, then 2 base evaluations and ``n_variants``
    PTQ'd ones of ``eval_tokens`` tokens each): see the constants above."""
    c = model_counts(cfg, vocab, seq)
    tokens = cfg["steps"] * cfg["batch"] * seq
    train = COMPILE_S + max(c["train_flops_per_token"] * tokens / TRAIN_FLOPS, cfg["steps"] * STEP_FLOOR_S)
    evals = (2 + n_variants) * (VARIANT_OVERHEAD_S + c["eval_flops_per_token"] * eval_tokens / EVAL_FLOPS)
    return {"train_s": train, "eval_s": evals, "total_s": train + evals}


def plan(configs: list[dict], a, n_variants: int) -> None:
    """Print each configuration's size, tokens and H200 estimate, and the total."""
    eval_tokens = (a.eval_blocks or 2244) * a.seq  # 2244 held-out blocks of 256 in the package corpus
    total = STARTUP_S
    print(f"H200 estimates: {n_variants} variants, {eval_tokens} held-out tokens per evaluation, vocab {a.vocab}, "
          f"seq {a.seq}; epochs of the package corpus's pre-training half ({PACKAGE_PRETRAIN_TOKENS} tokens)")
    for cfg in configs:
        c = model_counts(cfg, a.vocab, a.seq)
        est = estimate_h200_s(cfg, a.vocab, a.seq, n_variants, eval_tokens)
        tokens = cfg["steps"] * cfg["batch"] * a.seq
        total += est["total_s"]
        late = " (past --deadline_s: skipped unless the bases before it run faster)" if (
            a.deadline_s and total > a.deadline_s) else ""
        print(f"  {cfg['name']:20s} {c['params'] / 1e6:6.1f}M params ({c['non_embedding_params'] / 1e6:.1f}M "
              f"non-embedding), {tokens / 1e6:.2f}M tokens = {tokens / PACKAGE_PRETRAIN_TOKENS:.1f} epochs, "
              f"{tokens / c['params']:.2f} tokens/param; {c['train_flops_per_token'] * tokens:.2e} FLOPs; "
              f"~{est['train_s']:.0f} s training + ~{est['eval_s']:.0f} s evaluating = ~{est['total_s']:.0f} s, "
              f"ends at ~{total:.0f} s{late}")
    print(f"  total ~{total:.0f} s with {STARTUP_S:.0f} s of start-up (imports, corpus cache); each base charged a "
          "compile, though one of the same shape as the base before it may reuse it")


def process_start() -> float:
    """When this process started (Linux: /proc), else now: --deadline_s counts the imports too, as the device
    call's timeout does."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


# ------------------------------------------------------------------------------------------------------ the rows
def collapse(names: list[str]) -> list[str]:
    """Module names with the layer index as ``*``, each with its count: ``model.layers.*.mlp.down_proj (x12)``."""
    counts: dict[str, int] = {}
    for n in names:
        key = re.sub(r"\.\d+\.", ".*.", n)
        counts[key] = counts.get(key, 0) + 1
    return [f"{k} (x{v})" if v > 1 else k for k, v in counts.items()]


def variant_group_size(variant: dict, hidden: int) -> int:
    """The ``QATConfig.group_size`` (``eval_qat.py --group_size``) of ``variant``: per channel is
    :data:`~hf_lowbit.qat.PER_CHANNEL`, ``hidden`` the model's hidden size."""
    group = variant["group"]
    return PER_CHANNEL if group == "ch" else hidden if group == "hidden" else group


def quantize(base, variant: dict, hidden: int):
    """A PTQ'd copy of ``base`` for ``variant`` (:func:`parse_variant`) through ``eval_qat.ptq``, as ``eval_qat.py``
    with the row's flags PTQs (per channel: ``PerAxis(0)``, one scale per row of every layer)."""
    config = QATConfig(variant["scheme"], variant_group_size(variant, hidden),
                       include_lm_head=variant["include_lm_head"])
    return ptq(base, config)


def quantized_layers(model) -> dict:
    """Which linears hold a quantized weight, with their group sizes (torchao's ``block_size``) per
    ``in_features``, and which stayed in float."""
    done, left, groups = [], [], {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        block = getattr(m.weight, "block_size", None)
        if type(m.weight) in (nn.Parameter, torch.Tensor):
            left.append(name)
        else:
            done.append(name)
            groups.setdefault(str(m.in_features), set()).add(None if block is None else int(block[-1]))
    return {"quantized": len(done), "unquantized": collapse(left),
            "group_sizes": {k: sorted(v, key=lambda g: (g is None, g)) for k, v in groups.items()}}


@torch.no_grad()
def weight_stats(model) -> dict:
    """Outliers of the decoder's linear weights and the LM head's: max |w| / std and excess kurtosis per tensor
    (mean and max over the decoder's)."""
    def stats(w):
        w = w.detach().float().flatten()
        std = w.std()
        return {"absmax_over_std": (w.abs().max() / std).item(),
                "kurtosis": (((w - w.mean()) / std) ** 4).mean().item() - 3}

    lm_head = model.get_output_embeddings()
    body = [stats(m.weight) for m in model.modules() if type(m) is nn.Linear and m is not lm_head]
    out = {"lm_head": stats(lm_head.weight)}
    for key in ("absmax_over_std", "kurtosis"):
        values = [s[key] for s in body]
        out[f"linears_{key}_mean"] = sum(values) / len(values)
        out[f"linears_{key}_max"] = max(values)
    return out


def failure(e: BaseException) -> str:
    """A failed row's or base's record: the exception's type and first line (the traceback goes to stderr)."""
    traceback.print_exc()
    return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def loss_of(model, blocks, a) -> float:
    """Mean token NLL (float32) = log of ``eval_qat.perplexity``."""
    return math.log(perplexity(model, blocks, a))


def seen_blocks(n_blocks: int, cfg: dict, seed: int, n: int) -> torch.Tensor:
    """The first ``n`` distinct block indices pretraining drew (``eval_qat.batch_order``, as ``train`` draws them), in
    the order first drawn: text the base has seen (a random block of the half is one only with probability
    1 - exp(-epochs))."""
    seen = {}
    for idx in batch_order(n_blocks, cfg["steps"], cfg["batch"], seed):
        for i in idx.tolist():
            seen.setdefault(i, None)
        if len(seen) >= n:
            break
    return torch.tensor(list(seen)[:n], dtype=torch.long)


def eval_qat_flags(cfg: dict, a, variant: dict | None = None) -> str:
    """The ``eval_qat.py`` flags that pretrain this base (and PTQ it as ``variant``), or why it cannot; the corpus
    flags (--corpus_packages, --corpus_cache) are the run's."""
    flags = (f"--layers {cfg['layers']} --hidden {cfg['hidden']} --intermediate {cfg['intermediate']} "
             f"--heads {cfg['heads']} --kv_heads {cfg['kv_heads']} --vocab {a.vocab} --seq {a.seq} --seed {a.seed} "
             f"--batch {cfg['batch']} --pretrain_steps {cfg['steps']} --pretrain_lr {cfg['lr']:g}")
    if variant is None:
        return flags
    group = variant_group_size(variant, cfg["hidden"])
    return f"--scheme {variant['scheme']} --group_size {group}" + (" --include_lm_head" if variant["include_lm_head"]
                                                                   else "")


def run_base(cfg: dict, a, tok, pre_blocks, eval_blocks, variants: list[dict], estimate: dict) -> dict:
    """Pretrain one base as ``eval_qat.py`` does, evaluate it and its PTQ variants."""
    t0 = time.time()
    c = argparse.Namespace(**{**vars(a), **{k: cfg[k] for k in CONFIG_KEYS}, "pretrain_steps": cfg["steps"],
                              "pretrain_lr": cfg["lr"]})
    counts = model_counts(cfg, len(tok), a.seq)
    tokens = cfg["steps"] * cfg["batch"] * a.seq
    record = {"name": cfg["name"], "config": {k: cfg[k] for k in CONFIG_KEYS}, **counts, "vocab": len(tok),
              "tokens": tokens, "epochs": cfg["steps"] * cfg["batch"] / pre_blocks.shape[0],
              "tokens_per_param": tokens / counts["params"],
              "tokens_per_non_embedding_param": tokens / counts["non_embedding_params"],
              "estimate_h200_s": estimate, "eval_qat_flags": eval_qat_flags(cfg, a)}
    base, losses = pretrain(c, llama_config(c, len(tok)), pre_blocks, a.seed)
    tail = losses[-max(1, len(losses) // 10):]
    record["final_train_loss"] = sum(tail) / len(tail)  # bf16 autocast, the batches' mean over the last 10% of steps
    record["train_seconds"] = time.time() - t0
    log(f"{cfg['name']}: pre-trained {cfg['steps']} steps ({record['epochs']:.1f} epochs, "
        f"{record['tokens_per_param']:.2f} tokens/param), last 10% loss {record['final_train_loss']:.3f}")
    ev = argparse.Namespace(**{**vars(c), "batch": a.eval_batch})
    held_out = loss_of(base, eval_blocks, ev)
    seen = seen_blocks(pre_blocks.shape[0], cfg, a.seed, eval_blocks.shape[0])
    train = loss_of(base, pre_blocks[seen], ev)
    record.update(loss={"held_out": held_out, "train": train, "train_blocks": len(seen)}, gap=held_out - train,
                  weights=weight_stats(base))
    log(f"{cfg['name']}: held-out loss {held_out:.4f}, on {len(seen)} blocks it trained on {train:.4f} "
        f"(gap {held_out - train:+.4f})")
    record["variants"] = rows = []
    if not all(math.isfinite(x) for x in (held_out, train, record["final_train_loss"])):
        record["diverged"] = True
        log(f"{cfg['name']}: diverged (a loss is not finite): no PTQ rows")
    else:
        for v in variants:
            t1 = time.time()
            row = {**v, "group_size": "per_channel" if v["group"] == "ch" else
                   cfg["hidden"] if v["group"] == "hidden" else v["group"],
                   "eval_qat_flags": eval_qat_flags(cfg, a, v)}
            try:
                q = quantize(base, v, cfg["hidden"])
                loss = loss_of(q, eval_blocks, ev)
                layers = quantized_layers(q)
                del q
            except Exception as e:  # one variant that fails here (a kernel, a shape) must not end the sweep
                rows.append({**row, "error": failure(e), "seconds": time.time() - t1})
                log(f"{cfg['name']}: {v['name']}: {rows[-1]['error']}")
                continue
            inc = (loss - held_out) / held_out
            rows.append({**row, "loss": loss, "ptq_loss_increase": inc, "reaches_target": inc >= a.target,
                         **layers, "seconds": time.time() - t1})
            left = f"; float: {', '.join(layers['unquantized'])}" if layers["unquantized"] else ""
            log(f"{cfg['name']}: {v['name']}: loss {held_out:.4f} -> {loss:.4f} ({inc:+.2%}), "
                f"{layers['quantized']} linears quantized{left}")
    del base
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    record["seconds"] = time.time() - t0
    return record


# ------------------------------------------------------------------------------------------------------- results
def write(bases: list[dict], info: dict, a, partial: bool) -> None:
    """The JSON and markdown of the bases done so far (``partial``: more were to come)."""
    info = {**info, "seconds": time.time() - info["started"], "partial": partial}
    data = {"meta": meta(a.device, key="device", **{k: v for k, v in info.items() if k != "started"}),
            "target": a.target, "bases": bases}
    table = ["| base | held-out loss | train loss (gap) | epochs | tokens / param | lr | largest int4 PTQ increase | "
             f"variants >= {a.target:.0%} |", "|---|---|---|---|---|---|---|---|"]
    for b in bases:
        if "error" in b:
            table.append(f"| {b['name']} | {b['error']} |" + " |" * 6)
            continue
        rows = [r for r in b["variants"] if "error" not in r]
        worst = max(rows, key=lambda r: r["ptq_loss_increase"]) if rows else None
        table.append(f"| {b['name']} | {b['loss']['held_out']:.4f} | {b['loss']['train']:.4f} ({b['gap']:+.4f}) | "
                     f"{b['epochs']:.1f} | {b['tokens_per_param']:.2f} | {b['config']['lr']:g} | "
                     + (f"{worst['ptq_loss_increase']:+.2%} ({worst['name']}) | " if worst else
                        ("diverged | " if b.get("diverged") else "– | "))
                     + f"{sum(r['reaches_target'] for r in rows)} of {len(b['variants'])} |")
    for b in bases:
        if "error" in b:
            continue
        w = b["weights"]
        table += ["", f"**{b['name']}**: {b['config']['layers']} x "
                  f"{b['config']['hidden']}, MLP {b['config']['intermediate']}, batch {b['config']['batch']} x "
                  f"{a.seq}, {b['config']['steps']} steps at lr {b['config']['lr']:g}; {b['params'] / 1e6:.1f}M "
                  f"params ({b['non_embedding_params'] / 1e6:.1f}M non-embedding), {b['tokens'] / 1e6:.2f}M tokens "
                  f"({b['epochs']:.1f} epochs, {b['tokens_per_param']:.2f} tokens/param); held-out loss "
                  f"{b['loss']['held_out']:.4f}, train {b['loss']['train']:.4f}; linears' max |w|/std "
                  f"{w['linears_absmax_over_std_max']:.1f} (mean {w['linears_absmax_over_std_mean']:.1f}), kurtosis "
                  f"max {w['linears_kurtosis_max']:.1f}, LM head {w['lm_head']['absmax_over_std']:.1f} / "
                  f"{w['lm_head']['kurtosis']:.1f}; {b['seconds']:.0f} s (H200 estimate "
                  f"{b['estimate_h200_s']['total_s']:.0f} s). eval_qat.py: `{b['eval_qat_flags']}`", "",
                  "| PTQ variant | group | linears quantized | left in float | held-out loss | increase | eval_qat.py |",
                  "|---|---|---|---|---|---|---|"]
        for r in b["variants"]:
            if "error" in r:
                table.append(f"| {r['name']} | {r['group_size']} | | | | {r['error']} | {r['eval_qat_flags']} |")
                continue
            inc = f"{r['ptq_loss_increase']:+.2%}"
            left = ", ".join(n.replace("model.layers.*.", "") for n in r["unquantized"]) or "–"
            table.append(f"| {r['name']} | {r['group_size']} | {r['quantized']} | {left} | {r['loss']:.4f} | "
                         f"{'**' + inc + '**' if r['reaches_target'] else inc} | {r['eval_qat_flags']} |")
    for name, why in info.get("skipped", {}).items():
        table += ["", f"Not run: {name}: {why}"]
    header = (f"{data['meta']['device']}, torch {torch.__version__}, corpus {info['corpus'].get('documents')} "
              f"documents, {info['corpus']['eval_tokens']} held-out tokens, {info['seconds']:.0f} s"
              + (f", partial: {len(bases)} of the bases" if partial else ""))
    if partial:  # the files as they stand, the table printed once at the end
        with contextlib.redirect_stdout(io.StringIO()):
            write_results(data, table, header, a.json, a.markdown)
    else:
        write_results(data, table, header, a.json, a.markdown)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated base models, run in this order (presets: {', '.join(PRESETS)})")
    p.add_argument("--override", default="", metavar="K=V,...",
                   help=f"set these fields of every configuration ({', '.join(CONFIG_KEYS)}; e.g. tiny shapes for a "
                        "smoke run)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated SCHEME:GROUP[:nohead] (above)")
    for name, default in dict(vocab=8192, seq=256, seed=0, max_docs=0, eval_blocks=512, eval_batch=32).items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--target", type=float, default=0.02, help="the PTQ loss increase sought (a row's reaches_target)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the pretraining forward (as eval_qat.py)")
    p.add_argument("--deadline_s", type=float, default=0,
                   help="skip a base whose estimated end falls past this many seconds since start (0: none)")
    p.add_argument("--plan", action="store_true", help="print the configurations and their H200 estimates, then stop")
    add_corpus_flags(p)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args()
    override = parse_override(a.override)
    configs = [parse_config(n.strip(), override) for n in a.configs.split(",") if n.strip()]
    variants = [parse_variant(v) for v in a.variants.split(",") if v.strip()]
    if not configs or not variants:
        raise SystemExit("--configs and --variants name at least one each")
    if a.plan:
        plan(configs, a, len(variants))
        return
    started = process_start()
    skipped = {}
    for scheme in sorted({v["scheme"] for v in variants}):
        problem = cuda_capability_problem(scheme) if a.device == "cuda" else (
            "converts on a CUDA GPU only" if QAT_SCHEMES[scheme].convert_on_cuda else None)
        if problem:
            skipped[scheme] = problem
            print(f"skipping the {scheme} rows: {problem}", flush=True)
    variants = [v for v in variants if v["scheme"] not in skipped]

    tok, train_blocks, eval_blocks, corpus = load_corpus(a)
    if a.corpus_only:
        return
    if not variants:
        raise SystemExit("no variant of --variants can be converted here")
    if a.eval_blocks:
        eval_blocks = eval_blocks[: a.eval_blocks]
    pre_blocks, _ = halves(train_blocks)  # eval_qat.py pretrains on this half (and fine-tunes on the other)
    info = {"started": started, "config": {k: v for k, v in vars(a).items() if k not in ("json", "markdown")},
            "corpus": {**{k: corpus[k] for k in ("documents", "packages", "built_on", "cache") if k in corpus},
                       "pretrain_tokens": pre_blocks.numel(), "eval_tokens": eval_blocks.numel()},
            "skipped": {f"{k} rows": v for k, v in skipped.items()},
            "estimates": {"compile_s": COMPILE_S, "train_flops": TRAIN_FLOPS, "eval_flops": EVAL_FLOPS,
                          "step_floor_s": STEP_FLOOR_S, "variant_overhead_s": VARIANT_OVERHEAD_S}}
    bases, took, shape = [], {}, None  # took: the seconds the last base of each shape took
    for i, cfg in enumerate(configs):
        est = estimate_h200_s(cfg, len(tok), a.seq, len(variants), eval_blocks.numel())
        new_shape = tuple(cfg[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "batch", "steps"))
        # a shape already run: as long as it took (same steps and rows); else the H200 estimate
        expect, basis = (took[new_shape], "as long as the last base of its shape") if new_shape in took else (
            est["total_s"], "its H200 estimate")
        if a.deadline_s and time.time() - started + expect > a.deadline_s:
            why = (f"{expect:.0f} s more ({basis}) would end past --deadline_s {a.deadline_s:g} "
                   f"(at {time.time() - started:.0f} s)")
            info["skipped"][cfg["name"]] = why
            log(f"{cfg['name']}: skipped: {why}")
            continue
        if a.compile and shape is not None and new_shape[:-1] != shape[:-1]:
            torch._dynamo.reset()  # a new shape: compile it afresh (not as dynamic shapes after a recompile)
        shape = new_shape
        t0 = time.time()
        try:
            bases.append(run_base(cfg, a, tok, pre_blocks, eval_blocks, variants, est))
        except Exception as e:  # e.g. out of memory: the other bases still run
            bases.append({"name": cfg["name"], "config": {k: cfg[k] for k in CONFIG_KEYS}, "error": failure(e),
                          "estimate_h200_s": est, "seconds": time.time() - t0})
            log(f"{cfg['name']}: {bases[-1]['error']}")
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        took[new_shape] = time.time() - t0
        if i + 1 < len(configs):
            write(bases, info, a, partial=True)
    write(bases, info, a, partial=False)


if __name__ == "__main__":
    main()
