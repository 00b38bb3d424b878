#!/usr/bin/env python
"""What the compiled ``LowBitTrainer`` computes, checked step by step inside its own loop (gradient accumulation,
weight cache, CUDA graphs, bf16 autocast: the trainer_b1_ga8 setting), one configuration per process:

    python benchmarks/trainer_grad_check.py --configs fp8:atomic_rcp,fp8:two_kernel,int8:atomic_rcp --json out.json

Every optimizer step:

* at its first micro-batch, the weight cache: every cached linear's ``_wq`` / ``_wq_scale`` / ``_wq_t`` against its
  weight quantized afresh (``quantize_weight`` through the two-kernel path on CUDA; the plain-torch reference on the
  CPU at the first and last step) and ``_wq_t`` against ``_wq`` transposed: elements that differ (a stale or mis-laid
  cache shows here);
* every micro-batch also runs through two eager references holding the step's weights, under the same autocast: the
  same recipe uncached with the two-kernel activation quantization (the trusted path) and plain bf16. The losses are
  compared at each micro-batch; every parameter's gradient after the first micro-batch (``.grad`` starts at zero, so
  it is that micro-batch's gradient alone) and after the last (the accumulated gradient the optimizer gets; the
  references accumulate theirs alike): cosines, the worst parameters named. Against the same recipe a cosine near 1
  is expected (compiled and eager codes may differ in rare elements), against bf16 the recipe's own error.

A configuration is ``fmt:variant`` (``fmt`` int8 / fp8, ``variant`` the activation quantization of
``hf_lowbit.kernels.quantize_t.ACTIVATION_VARIANT``) plus ``+``-joined switches: ``nocache``
(``lowbit_weight_cache=False``), ``nographs`` (``lowbit_cuda_graphs=False``), ``refresh2k`` / ``refreshrows`` (the
weight refresh through the two-kernel path / the row kernel, whatever ``hf_lowbit.kernels.WEIGHT_VARIANT`` picks for the
format: FP8's rows refresh gave wrong transposed codes on the H200 at 47a45b8), ``noanalysis``
(``HF_LOWBIT_TRITON_ANALYSIS_CACHE=0``); ``bf16`` is
the stock ``Trainer`` (losses only). Each row also carries the losses the Trainer logged.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import (add_int_flags, error_cell, llama_config, meta, run_worker, save_json,  # noqa: E402
                               write_results)

SWITCHES = ("nocache", "nographs", "refresh2k", "refreshrows", "noanalysis")
REFRESH = {"refresh2k": "two_kernel", "refreshrows": "rows"}  # switch: quantize_weight's variant
DEFAULT_CONFIGS = "bf16,fp8:atomic_rcp,fp8:two_kernel,fp8:atomic_rcp+nocache,int8:atomic_rcp"


def parse_config(config: str) -> tuple[str, str | None, set[str]]:
    """``fmt:variant+switch+...`` -> (fmt, variant, switches); ``bf16`` -> ("bf16", None, set())."""
    head, *switches = config.split("+")
    if head == "bf16":
        if switches:
            raise ValueError(f"{config}: bf16 takes no switches")
        return "bf16", None, set()
    fmt, _, variant = head.partition(":")
    from hf_lowbit.kernels.triton_quant import VARIANTS

    if fmt not in ("int8", "fp8") or variant not in VARIANTS or not set(switches) <= set(SWITCHES):
        raise ValueError(f"{config}: want fmt:variant[+switch...], fmt int8/fp8, variant one of {VARIANTS}, switches "
                         f"from {SWITCHES}")
    return fmt, variant, set(switches)


def _codes_differ(a, b) -> int:
    """Elements of two code tensors whose values differ (-0 and +0 equal), or of two float32 scale tensors whose bits
    differ."""
    import torch

    if a.shape != b.shape:
        return a.numel()
    return int((a.float() != b.float()).sum().item()) if a.dtype != torch.float32 else int(
        (a.view(torch.int32) != b.view(torch.int32)).sum().item())


def check_cache(layers, fmt: str, cuda: bool, cpu_ref: bool = True) -> dict:
    """Each cached layer's buffers against its weight quantized afresh (on its device; ``cpu_ref``: also by the
    plain-torch reference on the CPU); summed element counts that differ."""
    import torch

    from hf_lowbit.kernels import quantize_operand, quantize_weight

    out = {"layers": 0, "q": 0, "scale": 0, "q_t": 0, "q_t_vs_q": 0, "q_vs_cpu": 0, "scale_vs_cpu": 0}
    with torch.no_grad():
        for m in layers:
            if not m.weight_cache:
                continue
            w = m.weight.detach()
            q, s, qt = quantize_weight(fmt, w, variant="two_kernel") if cuda else quantize_weight(fmt, w)
            out["layers"] += 1
            out["q"] += _codes_differ(m._wq, q)
            out["scale"] += _codes_differ(m._wq_scale, s)
            out["q_t"] += _codes_differ(m._wq_t, qt)
            out["q_t_vs_q"] += _codes_differ(m._wq_t, m._wq.T)
            if cpu_ref:
                rq, rs = quantize_operand(fmt, w.cpu(), 1)
                out["q_vs_cpu"] += _codes_differ(m._wq.cpu(), rq)
                out["scale_vs_cpu"] += _codes_differ(m._wq_scale.cpu(), rs)
    return out


def compare_grads(model, ref) -> dict:
    """Cosine and norm ratio of each parameter's gradient in ``model`` against ``ref`` (same names): the worst five
    by cosine, the minimum over the swapped linears' weights and over the rest."""
    refs = dict(ref.named_parameters())
    rows = []
    for name, p in model.named_parameters():
        r = refs.get(name)
        if p.grad is None or r is None or r.grad is None:
            continue
        g, h = p.grad.detach().double().flatten(), r.grad.detach().double().flatten()
        ng, nh = g.norm().item(), h.norm().item()
        cos = (g @ h).item() / (ng * nh) if ng > 0 and nh > 0 else float("nan")
        rows.append((cos, name, ng / nh if nh > 0 else float("nan")))
    linear = [c for c, n, _ in rows if n.endswith("proj.weight")]
    other = [c for c, n, _ in rows if not n.endswith("proj.weight")]
    rows.sort(key=lambda t: (t[0] if t[0] == t[0] else -2.0))
    return {"min_cos_linear": min(linear) if linear else None, "min_cos_other": min(other) if other else None,
            "worst": [{"param": n, "cos": round(c, 6), "norm_ratio": round(q, 4)} for c, n, q in rows[:5]],
            "params": len(rows)}


def _variant_setting(current: dict, fmt: str, variant: str) -> dict:
    """``ACTIVATION_VARIANT`` (``{fmt: variant}``) with ``fmt``'s activations quantized by ``variant`` (a copy; the
    module's own is left as it was)."""
    return {**current, fmt: variant}


def worker(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    fmt, variant, switches = parse_config(a.config)
    cuda = a.device == "cuda"
    Q = importlib.import_module("hf_lowbit.kernels.quantize_t")  # the package's attribute quantize_t is the op
    if variant is not None:
        Q.ACTIVATION_VARIANT = _variant_setting(Q.ACTIVATION_VARIANT, fmt, variant)
    refresh = [REFRESH[k] for k in switches if k in REFRESH]
    if len(refresh) > 1:
        raise SystemExit(f"--config {a.config}: refresh2k and refreshrows exclude each other")
    if refresh and cuda:  # the weight refresh through one kernel path (off CUDA the refresh is plain torch)
        from functools import partial

        import hf_lowbit.mixed_precision.linear as L

        L.quantize_weight = partial(L.quantize_weight, variant=refresh[0])
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(llama_config(a), dtype=torch.bfloat16, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (4 * a.batch, a.seq), generator=gen)
    data = [{"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)]} for i in range(a.steps * a.batch * a.grad_accum)]
    common = dict(output_dir=tempfile.mkdtemp(), report_to="none", per_device_train_batch_size=a.batch,
                  gradient_accumulation_steps=a.grad_accum, max_steps=a.steps, learning_rate=a.lr,
                  optim="adamw_torch_fused", bf16=True, torch_compile=not a.no_compile, logging_steps=1,
                  save_strategy="no", dataloader_pin_memory=cuda, disable_tqdm=True, seed=0,
                  lr_scheduler_type="constant", use_cpu=not cuda)
    if fmt == "bf16":
        trainer = Trainer(model, args=TrainingArguments(**common), train_dataset=data)
        trainer.train()
        return {"config": a.config, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}

    from benchmarks.driver import apply_recipe
    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments

    ref_same, ref_bf16 = copy.deepcopy(model), copy.deepcopy(model)
    apply_recipe(ref_same, fmt, a.min_features)  # the same recipe, eager, no weight cache
    for ref in (ref_same, ref_bf16):
        ref.train()
    steps = []

    class Checked(LowBitTrainer):
        micro = 0
        record: dict = {}

        def training_step(self, model, inputs, *args, **kwargs):
            k = self.micro % a.grad_accum  # this micro-batch's place in the optimizer step
            self.micro += 1
            loss = super().training_step(model, inputs, *args, **kwargs)
            self._check(k, inputs, loss, kwargs.get("num_items_in_batch", args[0] if args else None))
            return loss

        def _check(self, k: int, inputs, loss, num_items) -> None:
            """Every micro-batch through both references too (their gradients accumulate over the step as the
            Trainer's do); compared after the first (``.grad`` is that micro-batch's gradient alone) and after the
            last (the step's accumulated gradient, which the optimizer gets)."""
            if k == 0:
                self.record = record = {"step": self.state.global_step, "loss": loss.item()}
                if self._lowbit_cached_layers:  # the CPU reference (a copy of every weight): first and last step
                    cpu_ref = record["step"] in (0, self.state.max_steps - 1)
                    record["cache"] = check_cache(self._lowbit_cached_layers, fmt, cuda, cpu_ref)
            record = self.record
            inputs = self._prepare_inputs(inputs)
            params = dict(self.model.named_parameters())
            scale_by_ga = (not self.model_accepts_loss_kwargs or num_items is None) and self.compute_loss_func is None
            saved = Q.ACTIVATION_VARIANT
            # the reference's own activation quantization (eager: read per call)
            Q.ACTIVATION_VARIANT = _variant_setting(saved, fmt, "two_kernel")
            try:
                for key, ref in (("same", ref_same), ("bf16", ref_bf16)):
                    if k == 0:  # the step's weights; no gradient yet
                        ref.zero_grad(set_to_none=True)
                        with torch.no_grad():
                            for name, p in ref.named_parameters():
                                p.copy_(params[name])
                    with torch.autocast(a.device, dtype=torch.bfloat16):
                        ref_loss = self.compute_loss(ref, inputs, num_items_in_batch=num_items)
                    if scale_by_ga:
                        ref_loss = ref_loss / a.grad_accum
                    ref_loss.backward()
                    diff = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
                    record[f"max_loss_rel_diff_{key}"] = max(diff, record.get(f"max_loss_rel_diff_{key}", 0.0))
                    if k == 0:
                        record[f"loss_{key}"] = ref_loss.item()
                        record[f"grads_vs_{key}"] = compare_grads(self.model, ref)
                    if k == a.grad_accum - 1:
                        record[f"accumulated_grads_vs_{key}"] = compare_grads(self.model, ref)
            finally:
                Q.ACTIVATION_VARIANT = saved
            if k == a.grad_accum - 1:
                steps.append(record)
                print("STEP " + json.dumps(record), flush=True)

    args = LowBitTrainingArguments(**common, lowbit_min_features=a.min_features,
                                   lowbit_weight_cache=False if "nocache" in switches else None,
                                   lowbit_cuda_graphs=False if "nographs" in switches else None,
                                   **{f"{fmt}_mixed_precision": True})
    trainer = Checked(model, args=args, train_dataset=data)
    trainer.train()
    caches = [s["cache"] for s in steps if "cache" in s]
    return {"config": a.config, "chosen": {"weight_cache": trainer.lowbit_weight_cache,
                                           "cuda_graphs": trainer.lowbit_cuda_graphs,
                                           "torch_compile_mode": args.torch_compile_mode,
                                           "activation_variant": variant},
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "steps": steps,
            "cache_differ": max((sum(v for k, v in c.items() if k != "layers") for c in caches), default=None),
            "max_loss_rel_diff": max(s["max_loss_rel_diff_same"] for s in steps),
            "min_cos_same": _min_cos(steps, "grads_vs_same"), "min_cos_bf16": _min_cos(steps, "grads_vs_bf16"),
            "min_cos_acc_same": _min_cos(steps, "accumulated_grads_vs_same"),
            "min_cos_acc_bf16": _min_cos(steps, "accumulated_grads_vs_bf16")}


def _min_cos(steps: list[dict], key: str) -> float:
    """The least gradient cosine of ``key``'s comparisons over the steps (linears and the rest)."""
    return min(x for s in steps for x in (s[key]["min_cos_linear"], s[key]["min_cos_other"]) if x is not None)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default {DEFAULT_CONFIGS})")
    add_int_flags(p, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=2, batch=1, seq=2048,
                  grad_accum=8, steps=4, min_features=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no_compile", action="store_true", help="eager (a CPU smoke test of the script)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per configuration's process")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.config:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    configs = a.configs.split(",")
    for c in configs:
        parse_config(c)
    base = ["--device", a.device] + (["--no_compile"] if a.no_compile else [])
    for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "layers", "batch", "seq", "grad_accum", "steps",
              "min_features", "lr"):
        base += [f"--{k}", str(getattr(a, k))]
    info = meta(a.device, config={k: getattr(a, k) for k in ("hidden", "intermediate", "layers", "batch", "seq",
                                                             "grad_accum", "steps", "lr", "no_compile")})
    rows = []
    for c in configs:
        env = {"HF_LOWBIT_TRITON_ANALYSIS_CACHE": "0"} if "noanalysis" in parse_config(c)[2] else None
        rows.append(run_worker([sys.executable, os.path.abspath(__file__), *base, "--config", c], {"config": c},
                               a.timeout, env=env))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "steps"}), flush=True)
        save_json(a.json, {"meta": info, "rows": rows}, indent=1)

    def num(v, f):
        return "-" if v is None else format(v, f)

    table = ["| config | cache elements differing (max over steps) | loss vs same recipe eager (max rel) | "
             "min grad cos vs same recipe: 1st micro-batch / step's sum | vs bf16: 1st / sum | last logged loss |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['config']} | {error_cell(r['error'])} |||||")
            continue
        last = r["losses"][-1] if r.get("losses") else None
        table.append(f"| {r['config']} | {num(r.get('cache_differ'), 'd')} | {num(r.get('max_loss_rel_diff'), '.2e')} | "
                     f"{num(r.get('min_cos_same'), '.5f')} / {num(r.get('min_cos_acc_same'), '.5f')} | "
                     f"{num(r.get('min_cos_bf16'), '.5f')} / {num(r.get('min_cos_acc_bf16'), '.5f')} | {num(last, '.4f')} |")
    write_results({"meta": info, "rows": rows}, table, f"{info['gpu']}, torch {info['torch']}, config {info['config']}",
                  a.json, a.markdown)


if __name__ == "__main__":
    main()
