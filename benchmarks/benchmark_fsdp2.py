#!/usr/bin/env python
"""FSDP2 training throughput of the low-bit recipes on 1..N GPUs of one host, through accelerate.

    python benchmarks/benchmark_fsdp2.py --gpus 1,2 --json docs/results/fsdp2_h200x2.json \\
        --markdown docs/results/fsdp2_h200x2.md --plot docs/results/fsdp2_h200x2.png

Every (GPU count, recipe) is one ``accelerate launch --config_file accelerate_configs/fsdp2.yaml
--num_processes N`` of this script's worker: benchmarks/benchmark_train.py's model and recipes (default
here: the whole Llama-8B shape, 32 layers), sharded per decoder layer by accelerate's FSDP2 with the
config's bf16 mixed precision (fp32 master weights and optimizer state, bf16 compute, fp32 gradient
reduction), each layer's forward compiled (FSDP2's hooks run around the compiled graphs), fused AdamW.

The global batch is fixed (strong scaling): ``max(--gpus)`` micro-batches of ``--batch`` x ``--seq``
per optimizer step; with N GPUs each rank takes ``max/N`` of them by gradient accumulation. Rank r's
micro-batches are the same token ids in every run, so the per-step losses of a recipe must agree
across GPU counts (reported as the max difference to the 1-GPU run). Reported per run: tokens/s per
GPU, the ratio to the reference recipe at the same GPU count (bf16, or lora_bf16 for LoRA recipes),
scaling efficiency (tokens/s per GPU vs the fewest-GPU run of the recipe), peak memory per GPU (max
over ranks), warm-up time, compiled graphs and graph breaks.

``--concurrent`` runs launches that need fewer GPUs than the machine has side by side on disjoint GPUs
(e.g. two 1-GPU runs on a 2-GPU host; recorded per row). ``--device cpu`` runs the same code in gloo
CPU processes (a smoke test of the script; tiny shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import (LORA_RECIPES, RECIPES, ROOT, add_int_flags, allow_fsdp_on_cpu, bar_plot,  # noqa: E402
                               build_model, check_recipes, compile_layers, error_cell, meta, run_worker, save_json, timed_steps,
                               train_step, write_results)

DEFAULT_RECIPES = "bf16,int8,fp8,qat_8da4w,torchao_float8,lora_bf16,lora_nf4_int8"
CONFIG = os.path.join(ROOT, "accelerate_configs", "fsdp2.yaml")
# NVLink multicast stays off (the lent machines' rule; NCCL would otherwise use it when it can)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def trainer_worker_fsdp(a) -> dict | None:
    """``--path trainer``: one ``LowBitTrainer`` (stock ``Trainer`` for bf16) run inside ``accelerate launch``,
    FSDP2 from the launch config, ``--batch`` x ``--seq`` tokens per micro-batch and ``--grad_accum`` per GPU
    (weak scaling: every GPU count does the same work per GPU). Rank 0 returns the regimes record: the fields
    of docs/results/regimes_h200.json plus ``gpus``; peak memory and step time are the max over ranks."""
    import torch
    import torch.distributed as dist

    from benchmarks.benchmark_train import trainer_worker

    if a.device != "cuda":
        allow_fsdp_on_cpu()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    a.path, a.compile_mode, a.no_cuda_graphs = "trainer", "default", False
    r = trainer_worker(a)
    stats = torch.tensor([r["peak_mem_gib"] if a.device == "cuda" else 0.0, r["step_ms"]],
                         device="cuda" if a.device == "cuda" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    peak, step = stats.tolist()
    if dist.get_rank():
        return None
    tok_s = a.batch * a.seq * a.grad_accum / step * 1e3
    return {"recipe": a.recipe, "micro_batch_tokens": a.batch * a.seq, "grad_accum": a.grad_accum, "path": "trainer",
            "gpus": dist.get_world_size(), "tok_s": tok_s, "tokens_per_s_per_gpu": tok_s, "step_ms": step,
            "peak_gib": peak if a.device == "cuda" else float("nan"), "peak_mem_gib_per_gpu": peak if a.device == "cuda" else float("nan"),
            "warmup_s": r["warmup_s"], "first_loss": r["first_loss"], "last_loss": r["last_loss"],
            "losses": [r["first_loss"], r["last_loss"]], "compiled_graphs": r["compiled_graphs"],
            "graph_breaks": r["graph_breaks"], "chosen": r["chosen"]}


def worker(a) -> dict | None:
    """One run inside ``accelerate launch``; rank 0 returns the result row."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from torch._dynamo.utils import counters

    from hf_lowbit.integrations.distributed import prepare_integer_params_for_fsdp2

    cuda = a.device == "cuda"
    if not cuda:
        allow_fsdp_on_cpu()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    # the model first: the recipes build TrainingArguments, which reset accelerate's shared state
    model = build_model(a, device)
    acc = Accelerator()
    if acc.distributed_type != DistributedType.FSDP or not acc.is_fsdp2:
        raise RuntimeError(f"expected FSDP2 from {CONFIG}, accelerate gave {acc.distributed_type}")
    # as LowBitTrainer does: quantized bases in a float carrier where this torch cannot shard integer tensors
    carried, unsharded = prepare_integer_params_for_fsdp2(acc.state.fsdp_plugin, model, acc.device)
    n, rank = acc.num_processes, acc.process_index
    if a.global_micro % n:
        raise SystemExit(f"--global_micro {a.global_micro} is not divisible by {n} processes")
    accum = a.global_micro // n
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=cuda)
    model, opt = acc.prepare(model, opt)
    if not a.no_compile:
        compile_layers(model, a.layers, forward_only=True)
    # micro-batch j of step s: the same ids whatever the GPU count (4 distinct steps, cycled)
    gen = torch.Generator(device="cpu")
    mine = range(rank * accum, (rank + 1) * accum)
    batches = []
    for s in range(4):
        row = []
        for j in range(a.global_micro):
            ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen.manual_seed(1000 * s + j))
            if j in mine:
                row.append(ids.to(acc.device))
        batches.append(row)

    def step(s):  # this rank's micro-batches: their mean loss
        return sum(train_step(model, batches[s % len(batches)], opt))

    def mean_over_ranks(t):
        t = t.clone()
        dist.all_reduce(t)
        return (t / n).item()

    run = timed_steps(step, a.warmup, a.steps, cuda, warm=mean_over_ranks, before_timing=dist.barrier)
    losses, warmup_s, elapsed = run["warm"] + [mean_over_ranks(t) for t in run["timed"]], run["warmup_s"], run["elapsed"]
    stats = torch.tensor([torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0, elapsed], device=acc.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    peak, elapsed = stats.tolist()
    if rank:
        return None
    tokens_per_gpu = accum * a.batch * a.seq * a.steps / elapsed
    return {"recipe": a.recipe, "gpus": n, "grad_accum": accum, "tokens_per_s_per_gpu": tokens_per_gpu,
            "tokens_per_s": n * tokens_per_gpu, "unsharded_modules": len(unsharded), "carrier_modules": len(carried), "step_ms": 1000 * elapsed / a.steps, "warmup_s": warmup_s,
            "peak_mem_gib_per_gpu": peak if cuda else float("nan"), "losses": losses,
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_ratios(rows: list[dict]) -> None:
    """vs the reference recipe at the same GPU count (and micro-batch, accumulation); scaling and loss
    agreement vs the fewest GPUs. Trainer-path rows also get the regimes file's name ``vs_bf16``."""
    ok = [r for r in rows if "error" not in r]

    def same_regime(x, r):
        return all(x.get(k) == r.get(k) for k in ("micro_batch_tokens", "path")) and (
            r.get("path") != "trainer" or x["grad_accum"] == r["grad_accum"])

    for r in ok:
        ref_name = "bf16" if r["recipe"] in RECIPES else "lora_bf16"
        ref = next((x for x in ok if x["recipe"] == ref_name and x["gpus"] == r["gpus"] and same_regime(x, r)), None)
        if ref:
            r["reference"] = ref_name
            r["vs_ref"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
            r["mem_vs_ref"] = r["peak_mem_gib_per_gpu"] / ref["peak_mem_gib_per_gpu"]
            if r.get("path") == "trainer":
                r["vs_bf16"] = r["vs_ref"]
        base = min((x for x in ok if x["recipe"] == r["recipe"] and same_regime(x, r)), key=lambda x: x["gpus"])
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        r["max_loss_diff_vs_fewest_gpus"] = (None if base is r else  # a run with one GPU count: nothing to compare
                                             max(abs(x - y) for x, y in zip(r["losses"], base["losses"])))


def table(rows: list[dict]) -> list[str]:
    out = ["| recipe | GPUs | tok/s per GPU | vs ref | scaling eff. | peak GiB per GPU | mem vs ref | "
           "max loss diff vs fewest GPUs | first / last loss | warm-up s | graphs | breaks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["gpus"], 0)):
        if "error" in r:
            out.append(f"| {r['recipe']} | {r['gpus']} | {error_cell(r['error'])} ||||||||||")
            continue
        diff = r["max_loss_diff_vs_fewest_gpus"]
        out.append(f"| {r['recipe']} | {r['gpus']} | {r['tokens_per_s_per_gpu']:.0f} | {r.get('vs_ref', float('nan')):.2f}x"
                   f" | {r['scaling_efficiency']:.2f} | {r['peak_mem_gib_per_gpu']:.1f} | {r.get('mem_vs_ref', float('nan')):.2f}x"
                   f" | {'–' if diff is None else f'{diff:.1e}'} | {r['losses'][0]:.3f} / {r['losses'][-1]:.3f}"
                   f" | {r['warmup_s']:.0f} | {r['compiled_graphs']} | {r['graph_breaks']} |")
    return out


def plot(data: dict, path: str) -> None:
    rows = [r for r in data["rows"] if "error" not in r and "vs_ref" in r]
    c = data["meta"]["config"]
    bar_plot(path, list(dict.fromkeys(r["recipe"] for r in rows)), sorted({r["gpus"] for r in rows}),
             lambda rec, g: next((r["vs_ref"] for r in rows if r["recipe"] == rec and r["gpus"] == g), 0),
             "tok/s per GPU vs bf16\n(LoRA: vs lora_bf16)", f"{data['meta']['gpu']}: FSDP2, {c['layers']} layers "
             f"h{c['hidden']}, global batch {c['global_micro']}x{c['batch']}x{c['seq']}", width=8,
             label=lambda g: f"{g} GPU{'s' * (g > 1)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated, from {RECIPES + LORA_RECIPES}")
    p.add_argument("--gpus", default="1,2", help="comma-separated process counts (one GPU each)")
    add_int_flags(p, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=32, batch=1, seq=2048,
                  warmup=3, steps=8, min_features=64, lora_r=16, global_micro=0)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (gloo smoke test of the script)")
    p.add_argument("--no_compile", action="store_true", help="run eagerly (smoke tests only)")
    p.add_argument("--json", default=None, help="write results here (rewritten after every run)")
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of tok/s per GPU vs the reference (needs matplotlib)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--concurrent", action="store_true",
                   help="run the launches that need fewer GPUs than the machine has side by side, each on its own "
                        "GPUs (saves wall time; the host's CPUs are shared)")
    p.add_argument("--path", choices=("loop", "trainer"), default="loop",
                   help="loop: a hand loop, fixed global batch (strong scaling); trainer: LowBitTrainer (stock Trainer "
                        "for bf16) with --grad_accum micro-batches per GPU (weak scaling), records as in the "
                        "single-GPU regimes file (docs/results/regimes_h200.json) plus gpus")
    p.add_argument("--grad_accum", type=int, default=1, help="trainer path: gradient accumulation steps per GPU")
    p.add_argument("--append", action="store_true", help="keep the rows already in --json (another regime's)")
    p.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    a.grad_checkpointing = False  # build_model's flag; not part of this bench
    if a.recipe:
        row = trainer_worker_fsdp(a) if a.path == "trainer" else worker(a)
        if row is not None:
            print("RESULT " + json.dumps(row), flush=True)
        return
    import torch

    counts = sorted({int(g) for g in a.gpus.split(",")})
    if a.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < counts[-1]):
        raise SystemExit(f"--gpus {a.gpus}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    check_recipes(a.recipes.split(","), RECIPES + LORA_RECIPES, a.path)
    a.global_micro = a.global_micro or counts[-1]
    if any(a.global_micro % c for c in counts):
        raise SystemExit(f"--global_micro {a.global_micro} must be divisible by every --gpus count {counts}")
    env = {**NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    if a.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    os.environ.update(env)
    info = meta(a.device, gpu_count=torch.cuda.device_count() if a.device == "cuda" else 0,
                accelerate_config="accelerate_configs/fsdp2.yaml", env=env, concurrent=a.concurrent,
                config={k: getattr(a, k) for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "layers",
                                                   "batch", "seq", "global_micro", "warmup", "steps", "lora_r")})
    for mod in ("accelerate", "transformers", "torchao"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None

    flags = [x for k, v in vars(a).items() if isinstance(v, int) and not isinstance(v, bool) for x in (f"--{k}", str(v))]
    flags += ["--device", a.device, "--path", a.path] + (["--no_compile"] if a.no_compile else [])
    cpu_launch = ["--mixed_precision", "no"] if a.device == "cpu" else []  # gloo smoke test: fp32 reductions
    recipes = a.recipes.split(",")
    rows = []
    if a.append and a.json and os.path.exists(a.json):
        with open(a.json) as f:
            rows = json.load(f)["rows"]
    for n in counts:
        # --concurrent: launches of n GPUs side by side on disjoint GPUs (each sees its own CUDA_VISIBLE_DEVICES)
        slots = max(1, info["gpu_count"] // n) if a.concurrent and a.device == "cuda" else 1
        for i in range(0, len(recipes), slots):
            group = recipes[i:i + slots]
            launches = []
            for k, recipe in enumerate(group):
                cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--num_processes",
                       str(n), "--main_process_port", str(_free_port()), *cpu_launch, os.path.abspath(__file__),
                       *flags, "--recipe", recipe]
                gpus = {"CUDA_VISIBLE_DEVICES": ",".join(str(k * n + d) for d in range(n))} if slots > 1 else None
                launches.append((cmd, {"recipe": recipe, "gpus": n}, a.timeout, gpus))
            with ThreadPoolExecutor(len(launches)) as pool:
                done = list(pool.map(lambda job: run_worker(*job), launches))
            for row in done:
                row["concurrent_launches"] = len(launches)
                rows.append(row)
                add_ratios(rows)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
            save_json(a.json, {"meta": info, "rows": rows})
    data = {"meta": info, "rows": rows}
    write_results(data, table(rows), f"{info['gpu']} x{info['gpu_count']}, torch {info['torch']}, accelerate "
                  f"{info['accelerate']}, torchao {info['torchao']}, FSDP2 (accelerate_configs/fsdp2.yaml), config "
                  f"{info['config']}\n\nCommand: `{info['command']}`", a.json, a.markdown)
    if a.plot:
        plot(data, a.plot)


if __name__ == "__main__":
    main()
