#!/usr/bin/env python
"""What a LoRA / QLoRA step holds with gradient checkpointing: saved tensors, memory after the forward, the peak and
what is live at the peak, per recipe (one process each), built as benchmark_train.py's trainer path builds it.

The question (docs/benchmarks.md, 90f002d, 8x2048, 8 layers): with gradient checkpointing LoRA on a bf16 base peaks at
11.1 GiB, our NF4 + INT8 and PEFT + bitsandbytes at 16.3 / 16.5 GiB although their weights are ~2.4 GiB smaller; on the
CPU (eager, aot_eager_decomp_partition, Inductor) the three save the same tensors. This runs what the Trainer runs
(``gradient_checkpointing_enable(use_reentrant=False)``, ``torch.compile`` of the whole model, bf16 autocast) on a GPU,
one variant a process:

    python benchmarks/gc_memory_probe.py                       # all variants below, 2 layers, 8x2048
    python benchmarks/gc_memory_probe.py --variants bf16,nf4_int8 --layers 4

variants: bf16 (PEFT LoRA on a bf16 base, Inductor default mode), nf4_int8 (ours, Inductor default mode: no CUDA
graphs), nf4_int8_cg (ours, mode="reduce-overhead": what LowBitTrainer picks), bnb (PEFT + bitsandbytes NF4),
nf4_int8_aot / bnb_aot / bf16_aot (backend aot_eager_decomp_partition: the same partition, no Inductor code). Each
row: saved-for-backward bytes (saved_tensors_hooks on the measured step), memory after the forward, the measured
step's peak and the run's peak (warm-up included, as benchmark_train.py resets before train()), all minus the memory
before the step; per layer-token where it helps. ``--snapshot`` adds, per variant, the largest allocations live at the
run's peak, grouped by allocation site (torch.cuda.memory._record_memory_history). Runs on a CPU too (smaller flags;
no peak, saved bytes only) as a smoke test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VARIANTS = {  # name -> (recipe, backend, mode)
    "bf16": ("lora_bf16", "inductor", None),
    "nf4_int8": ("lora_nf4_int8", "inductor", None),
    "nf4_int8_cg": ("lora_nf4_int8", "inductor", "reduce-overhead"),
    "bnb": ("lora_bnb_nf4", "inductor", None),
    "bf16_aot": ("lora_bf16", "aot_eager_decomp_partition", None),
    "nf4_int8_aot": ("lora_nf4_int8", "aot_eager_decomp_partition", None),
    "bnb_aot": ("lora_bnb_nf4", "aot_eager_decomp_partition", None),
}
DEFAULT = "bf16,nf4_int8,nf4_int8_cg,bnb,nf4_int8_aot"
GIB = 2 ** 30


def build(a, recipe: str):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.driver import apply_lora_recipe, llama_config

    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(llama_config(a), dtype=torch.bfloat16, attn_implementation="sdpa")
    if recipe == "lora_bf16":  # what a stock Trainer user runs: PEFT's own LoRA
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear"))
    else:  # ours: prepare_model, as LowBitTrainer applies it; bnb: BitsAndBytesConfig reload + get_peft_model
        model = apply_lora_recipe(model, recipe, a.min_features, a.lora_r)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as Trainer.train
    return model


def site(frames: list[dict]) -> str:
    """A short allocation site: the innermost frames outside torch's own dispatch/compile machinery."""
    keep = [f for f in frames if not any(s in f["filename"] for s in (
        "torch/_dynamo", "torch/_functorch", "torch/autograd", "torch/_ops.py", "torch/nn/modules/module.py",
        "torch/utils/_", "torch/_library", "torch/_higher_order_ops", "torch/_prims", "torch/_refs",
        "torch/_decomp", "contextlib", "<frozen", "torch/_tensor.py", "torch/_inductor/runtime",
        "torch/cuda/", "torch/_C"))]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in keep[:3]) or "?"


def live_at_peak(snapshot: dict) -> tuple[int, list[tuple[int, int, str]]]:
    """(peak bytes, [(bytes, count, site)]) of the allocations live when the traced allocations peaked."""
    trace = snapshot["device_traces"][0]
    cur, peak, at = 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            cur += ev["size"]
        elif ev["action"] == "free_requested":
            cur -= ev["size"]
        if cur > peak:
            peak, at = cur, i
    live = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], site(ev.get("frames", [])))
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    groups = collections.defaultdict(lambda: [0, 0])
    for size, where in live.values():
        groups[where][0] += size
        groups[where][1] += 1
    return peak, sorted(((b, n, w) for w, (b, n) in groups.items()), key=lambda r: -r[0])


def worker(a) -> dict:
    import torch
    from torch._dynamo.utils import counters

    recipe, backend, mode = VARIANTS[a.variant]
    cuda = a.device == "cuda"
    torch._dynamo.config.cache_size_limit = max(64, 2 * a.layers)
    model = build(a, recipe)
    fwd = torch.compile(model, backend=backend, mode=mode)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
             {b.untyped_storage().data_ptr() for b in model.buffers()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(a.device)
    lora = [p for p in model.parameters() if p.requires_grad]
    if mode == "reduce-overhead":  # LowBitTrainer with CUDA graphs: .grad allocated outside the graphs
        for p in lora:
            p.grad = torch.zeros_like(p)

    recording: dict = {"into": None}

    def pack(t):  # one pair of hook objects for every step: Dynamo guards on the hooks' ids (new ones recompile)
        st = t.untyped_storage()
        if recording["into"] is not None and st.data_ptr() not in params:
            recording["into"].setdefault(st.data_ptr(), (st.nbytes(), tuple(t.shape), str(t.dtype)))
        return t

    def unpack(t):
        return t

    def step(record: dict | None = None):
        recording["into"] = record
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = fwd(input_ids=ids, labels=ids).loss
        after_fwd = torch.cuda.memory_allocated() if cuda else 0
        peak_fwd = torch.cuda.max_memory_allocated() if cuda else 0
        loss.backward()
        for p in lora:  # as an optimizer step with zero_grad(set_to_none=False) would leave them
            p.grad.zero_() if mode == "reduce-overhead" else setattr(p, "grad", None)
        return after_fwd, peak_fwd

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if a.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=500_000)
    base = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(a.warmup):
        step()
    run_peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    saved: dict = {}
    after_fwd, peak_fwd = step(saved)
    step_peak = torch.cuda.max_memory_allocated() - before if cuda else float("nan")
    run_peak = max(run_peak, torch.cuda.max_memory_allocated() - base) if cuda else float("nan")
    tokens, layers = a.batch * a.seq, a.layers
    groups = collections.defaultdict(lambda: [0, 0])
    for nbytes, shape, dtype in saved.values():
        groups[f"{shape} {dtype}"][0] += nbytes
        groups[f"{shape} {dtype}"][1] += 1
    saved_bytes = sum(v[0] for v in saved.values())
    res = {"variant": a.variant, "recipe": recipe, "backend": backend, "mode": mode, "layers": layers,
           "tokens": tokens, "weights_gib": base / GIB,
           "saved_gib": saved_bytes / GIB, "saved_per_layer_token": saved_bytes / tokens / layers,
           "after_fwd_gib": (after_fwd - before) / GIB, "peak_fwd_gib": (peak_fwd - before) / GIB,
           "step_peak_gib": step_peak / GIB, "run_peak_gib": run_peak / GIB,
           "total_peak_gib": (base + run_peak) / GIB,
           "compiled_graphs": counters["stats"]["unique_graphs"],  # the same for warm-up and measured steps
           "graph_breaks": sum(counters["graph_break"].values()),
           "saved_top": sorted(([b, n, k] for k, (b, n) in groups.items()), key=lambda r: -r[0])[:12]}
    if cuda and a.snapshot:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, live = live_at_peak(snap)
        res["traced_peak_gib"] = peak / GIB
        res["live_at_peak"] = [[b / GIB, n, w] for b, n, w in live[:15]]
    return res


def main():
    from benchmarks.driver import add_int_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_flags(p, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=2, batch=8,
                  seq=2048, warmup=2, min_features=64, lora_r=16)
    p.add_argument("--variants", default=DEFAULT, help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--snapshot", action="store_true", help="record allocations: what is live at the peak, by site")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    rows = []
    for v in a.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--device", a.device] + \
            [f"--{k}={getattr(a, k)}" for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "layers",
                                                 "batch", "seq", "warmup", "min_features", "lora_r")] + \
            (["--snapshot"] if a.snapshot else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            out = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            row = json.loads(out[-1][7:]) if out else {"variant": v, "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"variant": v, "error": f"timed out after {a.timeout} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| variant | weights GiB | saved GiB | saved B/layer-token | after fwd GiB | step peak GiB | run peak GiB |"
          " total peak GiB | graphs / breaks |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} ||||||||")
            continue
        print(f"| {r['variant']} | {r['weights_gib']:.2f} | {r['saved_gib']:.3f} | {r['saved_per_layer_token']:.0f} | "
              f"{r['after_fwd_gib']:.2f} | {r['step_peak_gib']:.2f} | {r['run_peak_gib']:.2f} | "
              f"{r['total_peak_gib']:.2f} | {r['compiled_graphs']} / {r['graph_breaks']} |")
    for r in rows:
        if "error" in r:
            continue
        print(f"\n{r['variant']}: saved for backward (bytes, count, shape dtype): {r['saved_top']}")
        for b, n, w in r.get("live_at_peak", []):
            print(f"  live at peak {b:7.3f} GiB x{n:<4} {w}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
