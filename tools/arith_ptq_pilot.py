#!/usr/bin/env python
"""Pilot for eval_qat.py --task arithmetic: pretrain one base exactly as eval_qat.py does (its flags), then the
held-out answer loss and exact-match accuracy of int4 PTQ variants of it (no fine-tuning, no QAT).

    python tools/arith_ptq_pilot.py --digits 3 --layers 2 --hidden 128 ... --variants int4_weight_only:32:head,8da4w:-1:head

Each variant is SCHEME:GROUP[:head] (GROUP -1: per channel; head: the LM head quantized too). Prints one table row per
variant: base loss / accuracy, PTQ loss / accuracy, the relative and absolute loss increase. Every other flag is
eval_qat.py's (parsed by its parser); --json writes the rows.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import eval_qat  # noqa: E402
from benchmarks.driver import meta  # noqa: E402
from hf_lowbit.qat import QATConfig  # noqa: E402


def main():
    command = " ".join(sys.argv)
    p = eval_qat.build_parser()
    p.add_argument("--variants", default="int4_weight_only:32:head",
                   help="comma-separated SCHEME:GROUP[:head] (GROUP -1: per channel; head: the LM head too)")
    a = p.parse_args(["--task", "arithmetic", *sys.argv[1:]])
    _, model_config, pre, _, ev, _ = eval_qat.setup(a)
    out, variants = a.json, a.variants
    t = time.time()
    base, losses = eval_qat.pretrain(a, model_config, pre, a.seed + a.repeat_from)  # run_once's first seed
    nll, acc = eval_qat.answer_eval(base, ev, a)
    print(f"base: {time.time() - t:.0f} s, last train loss {losses[-1]:.4f}, held-out answer NLL {nll:.5f}, "
          f"exact match {acc:.2%}", flush=True)
    rows = []
    print("| variant | base NLL | base acc | PTQ NLL | PTQ acc | increase (rel) | increase (abs) |")
    for v in variants.split(","):
        scheme, group, *head = v.split(":")
        config = QATConfig(scheme, int(group), include_lm_head=bool(head))
        q_nll, q_acc = eval_qat.answer_eval(eval_qat.ptq(base, config), ev, a)
        rows.append({"variant": v, "base_nll": nll, "base_acc": acc, "ptq_nll": q_nll, "ptq_acc": q_acc,
                     "increase_rel": (q_nll - nll) / nll, "increase_abs": q_nll - nll})
        print(f"| {v} | {nll:.5f} | {acc:.2%} | {q_nll:.5f} | {q_acc:.2%} | {(q_nll - nll) / nll:+.1%} | "
              f"{q_nll - nll:+.5f} |", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"meta": meta(a.device, key="device", command=command, config=vars(a), train_losses_tail=losses[-10:]),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
