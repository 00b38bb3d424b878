#!/usr/bin/env python
"""Training throughput of the low-bit recipes beside bf16 and torchao, in one run.

    python benchmarks/benchmark_train.py --json docs/results/train_h200.json --markdown docs/results/train_h200.md

Default bench: a Llama-8B-shaped block (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 32000),
8 layers, random init from a config, bf16 weights, fused AdamW, batch 8 x 2048 tokens, each decoder
layer compiled. Each recipe runs in its own process: warm-up steps (compile, autotune) are timed and
reported apart, then the timed steps give tokens/s, the ratio to bf16, peak memory and the first/last
loss. The number of compiled graphs and graph breaks is recorded so a silent fall-back to eager shows.

LoRA / QLoRA (``driver.LORA_RECIPES``; adapters on every decoder linear, only they train; rows compare to the
first LoRA recipe of the run):

    python benchmarks/benchmark_train.py --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_int8_int8 --lora_r 16
    python benchmarks/benchmark_train.py --recipes lora_bf16,lora_nf4 --layers 32 --batch 1 --grad_checkpointing

`--path trainer --liger both` runs every recipe twice, without and with ``use_liger_kernel=True`` (stock
``Trainer`` and ``LowBitTrainer`` alike; rows carry ``liger``, ``vs_no_liger``), so what Liger adds to each
recipe is measured in the same run; every ratio is to the bf16 row without Liger. Each trainer-path row also
carries the MFU of its timed steps (``mfu``: hf_lowbit.integrations.throughput's formula, for every recipe) and, for
``LowBitTrainer`` rows, the mean ``train_mfu`` / ``train_tokens_per_second`` it logged (``logged_*``).

`--autocast` runs the forward under bf16 autocast, as `Trainer(bf16=True)` does (accelerate wraps the
forward). It matters for LoRA: without it PEFT computes its float32 adapters in float32, under it in bf16
(our `LoraLinear` computes the adapters in the compute dtype either way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import (FGA_VARIANTS, FULL_RECIPES, HEAD_VARIANTS,  # noqa: E402
                               LORA_RECIPES, MASK_VARIANTS, OURS, OURS_LORA, RECIPES, GpuTelemetry, add_int_flags,
                               build_model,
                               check_recipe_active, check_recipes, compile_layers, cudagraph_skips, error_cell,
                               levers, load_blocks, meta, plot_results, profile_summary, recipe_args, run_worker,
                               save_json,
                               timed_steps, torchao_version, train_step, write_results)

# the flags trainer_worker reads beyond the model's, with main()'s defaults
TRAINER_DEFAULTS = dict(lr=1e-5, liger="off", data=None, compile_mode="default", no_cuda_graphs=False, profile=False)
PROFILE_STEPS = 2  # --profile: optimizer steps profiled (after the timed ones; the layers path: after timing too)


def trainer_worker(a) -> dict:
    """The user's path: stock ``Trainer`` (bf16, peers) or ``LowBitTrainer`` (ours) with the same
    ``TrainingArguments`` (torch_compile, bf16, fused AdamW, gradient accumulation); whatever compile
    mode or caching ``LowBitTrainer`` picks by itself is what it gets."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments
    from hf_lowbit.integrations.throughput import mfu, model_flops, peak_tflops

    for name, default in TRAINER_DEFAULTS.items():  # callers other than main() (benchmark_fsdp2) set fewer flags
        if not hasattr(a, name):
            setattr(a, name, default)
    model = build_model(a, a.device)
    cuda = a.device == "cuda"
    skips = cudagraph_skips()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.config.cache_size_limit = max(64, 2 * a.layers)
    gen = torch.Generator().manual_seed(0)
    total = a.warmup + a.steps
    profiled = PROFILE_STEPS if a.profile else 0  # optimizer steps profiled after the timed window
    ids = load_blocks(a) if a.data else torch.randint(0, a.vocab, (4 * a.batch, a.seq), generator=gen)
    data = [{"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)]}
            for i in range((total + profiled) * a.batch * a.grad_accum)]
    times, graphs, losses, logged = {}, {}, [], {"train_mfu": [], "train_tokens_per_second": []}
    telemetry, gpu = GpuTelemetry(), []  # the GPU's clocks and power over the timed steps (nvidia-smi, CUDA only)
    profile = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if profiled and state.global_step == total:  # the Trainer's own steps, as the user runs them
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                sync()  # CPU ops recorded too on CUDA: the host syncs per step (profile_summary)
                profile["prof"] = torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
                profile["prof"].__enter__()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (a.warmup, total):
                sync()
                if cuda and state.global_step == a.warmup:  # started before the clock: its set-up is not timed
                    telemetry.start()
                times[state.global_step] = time.perf_counter()
                graphs[state.global_step] = counters["stats"]["unique_graphs"]
                if cuda and state.global_step == total:
                    gpu.append(telemetry.stop())
            if profiled and state.global_step == total + profiled:
                sync()
                profile["prof"].__exit__(None, None, None)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and state.global_step <= total:  # not the profiled steps
                losses.append(logs["loss"])
                for key, values in logged.items():  # LowBitTrainer's throughput logs, timed steps only
                    if key in logs and state.global_step > a.warmup:
                        values.append(logs[key])

    ours = a.recipe in (*OURS, *OURS_LORA)  # LoRA on a bf16 base and the peers: stock Trainer
    # pinned batches on CUDA, the Trainer's default (LowBitTrainingArguments then copy them non-blocking, as in a
    # user's run); nothing to pin to on the CPU
    common = dict(output_dir=tempfile.mkdtemp(), report_to="none", per_device_train_batch_size=a.batch,
                  gradient_accumulation_steps=a.grad_accum, max_steps=total + profiled, learning_rate=a.lr,
                  optim="adamw_torch_fused", bf16=True, torch_compile=not a.no_compile, logging_steps=1,
                  save_strategy="no", dataloader_pin_memory=cuda, disable_tqdm=True, seed=0,
                  lr_scheduler_type="constant", use_cpu=not cuda, use_liger_kernel=a.liger == "on",
                  gradient_checkpointing=a.grad_checkpointing,
                  gradient_checkpointing_kwargs={"use_reentrant": False} if a.grad_checkpointing else None)
    if a.compile_mode != "default":
        common["torch_compile_mode"] = a.compile_mode
    if ours:
        lora = a.recipe in OURS_LORA  # LoRA r on every decoder linear, through LowBitTrainer's peft_config
        args = LowBitTrainingArguments(**common, lowbit_min_features=a.min_features,
                                       lowbit_cuda_graphs=False if a.no_cuda_graphs else None,
                                       **recipe_args(a.recipe))
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear")
        trainer = LowBitTrainer(model, args=args, train_dataset=data, peft_config=peft_config)
        if a.recipe in HEAD_VARIANTS:  # the swap happened in the constructor: the head must be low-bit
            check_recipe_active(trainer.model, a.recipe, a.device)
        if trainer.lowbit_skip_causal_mask == (a.recipe in MASK_VARIANTS):
            raise RuntimeError(f"recipe {a.recipe!r}: LowBitTrainer's lowbit_skip_causal_mask resolved to "
                               f"{trainer.lowbit_skip_causal_mask} (the bench's Llama should qualify unless asked not to)")
        if trainer.lowbit_fused_grad_accum != (a.recipe in FGA_VARIANTS):
            raise RuntimeError(f"recipe {a.recipe!r}: LowBitTrainer's lowbit_fused_grad_accum resolved to "
                               f"{trainer.lowbit_fused_grad_accum}")
        fused_adamw, fused_swiglu = levers(a.recipe, a.device)
        if trainer.lowbit_fused_adamw != fused_adamw:
            raise RuntimeError(f"recipe {a.recipe!r}: LowBitTrainer's lowbit_fused_adamw resolved to "
                               f"{trainer.lowbit_fused_adamw}")
        fused_mlp = any(type(m).__name__ == "LowBitSwiGLUMLP" for m in trainer.model.modules())
        if fused_mlp != fused_swiglu:
            raise RuntimeError(f"recipe {a.recipe!r}: LowBitTrainer's MLPs fused: {fused_mlp}")
        chosen = {"torch_compile_mode": args.torch_compile_mode, "weight_cache": trainer.lowbit_weight_cache,
                  "fused_grad_accum": trainer.lowbit_fused_grad_accum, "fused_adamw": trainer.lowbit_fused_adamw,
                  "fused_swiglu": fused_mlp,
                  "cuda_graphs": trainer.lowbit_cuda_graphs, "non_blocking": trainer.accelerator.non_blocking,
                  "skip_causal_mask": trainer.lowbit_skip_causal_mask}
    else:
        trainer = Trainer(model, args=TrainingArguments(**common), train_dataset=data)
        chosen = {"torch_compile_mode": trainer.args.torch_compile_mode}
    trainer.add_callback(Clock())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    elapsed = times[total] - times[a.warmup]
    tokens = a.batch * a.seq * a.grad_accum * a.steps
    flops = model_flops(model)  # the swapped model (compiled copies share its modules)
    peak = peak_tflops(torch.device(a.device))
    chosen["liger"] = getattr(trainer.args, "liger_kernel_config", None) if a.liger == "on" else None
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"recipe": a.recipe, "path": "trainer", "liger": a.liger == "on", "tokens_per_s": tokens / elapsed,
            "step_ms": 1000 * elapsed / a.steps, "warmup_s": times[a.warmup] - t0,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
            "first_loss": losses[0] if losses else float("nan"), "last_loss": losses[-1] if losses else float("nan"),
            "mfu": mfu(flops, tokens, tokens * a.seq, elapsed, peak) if peak else None,  # as LowBitTrainer logs it
            "logged_mfu": mean(logged["train_mfu"]), "logged_tok_s": mean(logged["train_tokens_per_second"]),
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "chosen": chosen,
            "profile": profile_summary(profile["prof"], profiled, device="cuda" if cuda else "cpu") if profiled else None,
            "timed_recompiles": graphs[total] - graphs[a.warmup], "cudagraph_skips": skips,
            "gpu_telemetry": gpu[0] if gpu else None}


def worker(a) -> dict:
    """The hand loop: each decoder layer compiled, fused AdamW, ``--grad_accum`` micro-batches a step."""
    import torch
    from torch._dynamo.utils import counters

    from hf_lowbit.integrations.causal_mask import plain_causal_model

    if a.path == "trainer":
        return trainer_worker(a)
    cuda = a.device == "cuda"
    skips = cudagraph_skips()
    model = build_model(a, a.device, weight_cache=a.grad_accum > 1)  # as LowBitTrainer does by default
    mode = None if a.compile_mode == "default" else a.compile_mode
    if not a.no_compile:
        compile_layers(model, a.layers, mode=mode)
    params = [p for p in model.parameters() if p.requires_grad]
    if levers(a.recipe, a.device)[0]:  # lowbit_fused_adamw's optimizer, as LowBitTrainer makes it itself
        from hf_lowbit import LowBitAdamW

        opt = LowBitAdamW(params, lr=a.lr, fused=cuda)
    else:
        opt = torch.optim.AdamW(params, lr=a.lr, fused=cuda)
    before = None
    if a.recipe in FGA_VARIANTS:  # the hand loop's part of lowbit_fused_grad_accum
        from hf_lowbit import enable_fused_grad_accumulation

        fused = enable_fused_grad_accumulation(model)
        if not fused.layers:
            raise RuntimeError(f"recipe {a.recipe!r} is not active: no linear's weight gradient is fused")
        before = fused.prepare
    gen = torch.Generator(device=a.device).manual_seed(0)
    if a.data:  # real text: consecutive batches, all of them on the device, cycled when the run outlasts them
        blocks = load_blocks(a)
        batches = list(blocks[: len(blocks) // a.batch * a.batch].to(a.device).split(a.batch))
    else:
        batches = [torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device, generator=gen) for _ in range(4)]
    # CUDA graphs + gradient accumulation: .grad must exist outside the graphs (else the next replay
    # overwrites the buffer .grad was given); zeroed in place between steps
    keep_grads = mode == "reduce-overhead" and a.grad_accum > 1
    if keep_grads:
        for p in params:
            p.grad = torch.zeros_like(p)

    # the batches are plain causal (ids only): the forward as LowBitTrainer runs it, for every recipe (bf16 too);
    # eagerly outside the compiled layers no host sync a micro-batch in transformers' packed-sequence check
    plain = plain_causal_model(model) is None and not a.mask_sync

    def step(i):  # the last micro-batch's loss
        micro = [batches[(i * a.grad_accum + j) % len(batches)] for j in range(a.grad_accum)]
        return train_step(model, micro, opt, autocast=a.autocast, set_to_none=not keep_grads,
                          before=before, plain=plain)[-1] * a.grad_accum

    graphs_warm = []
    telemetry = GpuTelemetry()  # the GPU's clocks and power over the timed steps (nvidia-smi, CUDA only)

    def before_timing():
        graphs_warm.append(counters["stats"]["unique_graphs"])
        if cuda:
            telemetry.start()

    run = timed_steps(step, a.warmup, a.steps, cuda, warm=lambda loss: loss.item(), before_timing=before_timing)
    gpu = telemetry.stop()
    losses, step_times, elapsed = run["warm"] + [t.item() for t in run["timed"]], run["step_ms"], run["elapsed"]
    profile = None
    if a.profile and cuda:
        from benchmarks.driver import kernel_profile

        profile = kernel_profile(lambda: step(0), host=a.host_profile)
    return {"recipe": a.recipe, "path": "layers", "tokens_per_s": a.batch * a.seq * a.grad_accum * a.steps / elapsed,
            "step_ms": 1000 * elapsed / a.steps, "warmup_s": run["warmup_s"],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
            "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "profile": profile,
            "timed_recompiles": counters["stats"]["unique_graphs"] - graphs_warm[0],
            "step_ms_median": step_times[len(step_times) // 2] if step_times else None,
            "step_ms_range": [step_times[0], step_times[-1]] if step_times else None,
            "step_ms_seq": run["step_ms_seq"], "gc_timed": run["gc"], "gc_ms_seq": run["gc_ms_seq"],
            "cudagraph_skips": skips, "gpu_telemetry": gpu}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated, from {FULL_RECIPES + LORA_RECIPES}")
    add_int_flags(p, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=8, batch=8, seq=2048,
                  warmup=3, steps=10, min_features=64, lora_r=16, grad_accum=1)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (constant)")
    p.add_argument("--data", default=None,
                   help="a torch.save'd int64 tensor [n, seq] of token blocks to train on (default: random ids)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--no_compile", action="store_true", help="run eagerly (smoke tests only)")
    p.add_argument("--no_cuda_graphs", action="store_true",
                   help="trainer path: LowBitTrainer(lowbit_cuda_graphs=False), to compare with its automatic choice")
    p.add_argument("--grad_checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    p.add_argument("--host_profile", action="store_true",
                   help="layers path, with --profile: record the CPU side too (host syncs, the host's top ops)")
    p.add_argument("--mask_sync", action="store_true",
                   help="layers path: forwards outside hf_lowbit's plain_causal, so transformers' packed-sequence "
                        "check reads the device each micro-batch (the hand loop before 0858dfe)")
    p.add_argument("--autocast", action="store_true",
                   help="forward under bf16 autocast, as Trainer(bf16=True) runs it (PEFT's float32 adapters compute in bf16)")
    p.add_argument("--path", choices=("layers", "trainer"), default="layers",
                   help="layers: a hand loop over the model with each decoder layer compiled; trainer: stock Trainer "
                        "(bf16, peers) vs LowBitTrainer (our recipes: int8, fp8, their variants, LoRA), same TrainingArguments, "
                        "whole-model compile")
    p.add_argument("--compile_mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                   help="torch.compile mode, for every recipe alike (trainer path: default lets LowBitTrainer choose)")
    p.add_argument("--liger", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="trainer path: use_liger_kernel=True for every recipe (on, or the bare flag), or each recipe "
                        "without and then with it (both); needs liger-kernel installed")
    p.add_argument("--json", default=None, help="write results here (rewritten after every recipe)")
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of the speed vs the reference (needs matplotlib)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile two optimizer steps: device time per kernel category and the top kernels "
                        "(the layers path: CUDA only; the Trainer path: two more Trainer steps, CPU ops on a CPU)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per recipe process")
    p.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.liger != "off" and a.path != "trainer":
        raise SystemExit("--liger: the trainer path only (--path trainer): transformers applies Liger in Trainer.train()")
    if a.recipe:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_train.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    info = meta(a.device, config={k: getattr(a, k) for k in (
        "hidden", "intermediate", "heads", "kv_heads", "vocab", "layers", "batch", "seq", "warmup", "steps", "lora_r",
        "grad_checkpointing", "autocast", "grad_accum", "path", "compile_mode", "liger", "lr", "data")},
        torchao=torchao_version())
    rows = []
    # the worker gets --device, every int flag and every switch that is on
    base_args = ["--device", a.device]
    for k, v in vars(a).items():
        if isinstance(v, bool):
            base_args += [f"--{k}"] if v else []
        elif isinstance(v, (int, float)) or (k in ("path", "compile_mode", "data") and v is not None):
            base_args += [f"--{k}", str(v)]
    recipes = a.recipes.split(",")
    check_recipes(recipes, FULL_RECIPES + LORA_RECIPES, a.path)
    ligers = {"off": ("off",), "on": ("on",), "both": ("off", "on")}[a.liger]
    for recipe, liger in [(r, lg) for r in recipes for lg in ligers]:
        cmd = [sys.executable, os.path.abspath(__file__), *base_args, "--liger", liger, "--recipe", recipe]
        row = run_worker(cmd, {"recipe": recipe, "liger": liger == "on"}, a.timeout)
        rows.append(row)
        for r in rows:  # full fine-tunes vs bf16 (without Liger where run); LoRA rows vs the first LoRA row
            ref = "bf16" if r["recipe"] in FULL_RECIPES else next((x["recipe"] for x in rows if x["recipe"] in LORA_RECIPES), None)
            refs = [x for x in rows if x["recipe"] == ref and "error" not in x]
            base = next((x for x in refs if not x.get("liger")), refs[0] if refs else None)
            if base and "error" not in r:
                r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
                r["mem_vs_bf16"] = r["peak_mem_gib"] / base["peak_mem_gib"]
                r["reference"] = ref + (" + liger" if base.get("liger") else "")
            plain = next((x for x in rows if x["recipe"] == r["recipe"] and not x.get("liger") and "error" not in x), None)
            if r.get("liger") and plain and "error" not in r:
                r["vs_no_liger"] = r["tokens_per_s"] / plain["tokens_per_s"]
        print(json.dumps(row), flush=True)
        save_json(a.json, {"meta": info, "rows": rows}, indent=2)
    table = ["| recipe | tok/s | vs ref | MFU | peak GiB | mem vs ref | warm-up s | first loss | last loss | graphs | breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["recipe"] + (" + liger" if r.get("liger") else "")
        if "error" in r:
            table.append(f"| {label} | {error_cell(r['error'])} ||||||||||")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "–"
        table.append(f"| {label} | {r['tokens_per_s']:.0f} | {r.get('vs_bf16', float('nan')):.2f}x | {mfu} | "
                     f"{r['peak_mem_gib']:.1f} | {r.get('mem_vs_bf16', float('nan')):.2f}x | {r['warmup_s']:.0f} | "
                     f"{r['first_loss']:.3f} | {r['last_loss']:.3f} | {r['compiled_graphs']} | {r['graph_breaks']} |")
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        cats = sorted({c for r in profiled for c in r["profile"]["categories_ms"]})
        table += ["", "Device ms per step by kernel category (torch.profiler, 2 steps):", "",
                  "| category | " + " | ".join(r["recipe"] for r in profiled) + " |", "|---|" + "---|" * len(profiled)]
        table += [f"| {c} | " + " | ".join(f"{r['profile']['categories_ms'].get(c, 0.0):.1f}" for r in profiled) + " |"
                  for c in cats]
        table.append("| **total** | " + " | ".join(f"{r['profile']['device_ms_per_step']:.1f}" for r in profiled) + " |")
        # the timed steps' wall time not covered by device work: the GPU waiting on the host
        table.append("| GPU idle (timed step - total) | " + " | ".join(
            f"{r['step_ms'] - r['profile']['device_ms_per_step']:.1f}" for r in profiled) + " |")
        table.append("| host syncs per step (.item(), bool(), blocking copies) | " + " | ".join(
            "-" if r["profile"].get("host_syncs_per_step") is None
            else f"{sum(r['profile']['host_syncs_per_step'].values()):.1f}" for r in profiled) + " |")

    write_results({"meta": info, "rows": rows}, table,
                  f"{info['gpu']}, torch {info['torch']}, torchao {info['torchao']}, config {info['config']}",
                  a.json, a.markdown)
    if a.plot and a.json:
        plot_results(a.json, a.plot)


if __name__ == "__main__":
    main()
