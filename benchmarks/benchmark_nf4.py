#!/usr/bin/env python
"""NF4 quantization: time and peak memory of hf_lowbit's quantizer vs torchao ``to_nf4``, and of
quantize-on-load (a safetensors checkpoint built into an NF4 model shard by shard).

    python benchmarks/benchmark_nf4.py --json docs/results/nf4_h200.json --markdown docs/results/nf4_h200.md

Default: one 128256 x 4096 bf16 weight (a Llama-3 embedding-sized matrix) on CUDA. Each quantizer runs
in its own process; peak memory is ``torch.cuda.max_memory_allocated`` during the call, reported as a
multiple of the input's bytes, both in total (input included: torchao's "3.0x") and beyond the input.
``--device cpu`` smoke-tests the script (peak is then the process's max RSS growth). The load stage
saves a random Llama-shaped model (``--load_layers`` layers, hidden 4096, MLP 14336) as safetensors
shards, then loads it with ``hf_lowbit.load_quantized_model`` on the device and reports the peak against
the NF4 model's bytes + the largest checkpoint tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

METHODS = ("hf_lowbit", "torchao")


def _peak_tools(device: str):
    import resource

    import torch

    if device == "cuda":
        def start():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        def peak(base):
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
    else:
        def start():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def peak(base):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return start, peak


def quantize_worker(a) -> dict:
    import torch
    from torchao.quantization import to_nf4

    from hf_lowbit.kernels.nf4 import quantize_nf4

    start, peak = _peak_tools(a.device)
    w = torch.randn(a.rows, a.cols, dtype=torch.bfloat16, device=a.device)
    nbytes = w.numel() * w.element_size()
    fn = (lambda: quantize_nf4(w)) if a.method == "hf_lowbit" else (lambda: to_nf4(w))
    base = start()
    out = fn()  # first call: peak memory (and any one-time setup)
    extra = peak(base)
    del out
    times = []
    for _ in range(a.reps):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    row = {"method": a.method, "shape": [a.rows, a.cols], "seconds": sorted(times)[len(times) // 2],
           "peak_total_vs_input": (nbytes + extra) / nbytes, "peak_extra_vs_input": extra / nbytes}
    if a.method == "hf_lowbit":  # code agreement with torchao on this very tensor
        ours, ref = quantize_nf4(w), to_nf4(w)
        row["codes_equal_torchao"] = (ours.codes.view(-1) == ref.quantized_data).float().mean().item()
        row["scales_equal_torchao"] = bool(torch.equal(ours.scales.view(-1), ref.quantized_scalers))
    return row


def load_worker(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_lowbit import LinearFilter, QuantizedBaseConfig, load_quantized_model

    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.load_layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                         tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp, max_shard_size="2GB")
        from safetensors import safe_open

        largest = ckpt = 0
        for f in os.listdir(tmp):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(tmp, f), "pt") as s:
                    for k in s.keys():
                        sl = s.get_slice(k)
                        n = 2
                        for d in sl.get_shape():
                            n *= d
                        largest, ckpt = max(largest, n), ckpt + n
        start, peak = _peak_tools(a.device)
        base = start()
        t0 = time.perf_counter()
        model, report = load_quantized_model(AutoModelForCausalLM, tmp, QuantizedBaseConfig("nf4"),
                                             device=a.device, filter=LinearFilter(min_features=a.min_features))
        seconds = time.perf_counter() - t0
        extra = peak(base)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"method": "load_quantized_model", "layers": a.load_layers, "seconds": seconds,
            "checkpoint_gib": ckpt / 2 ** 30, "nf4_model_gib": model_bytes / 2 ** 30,
            "largest_tensor_gib": largest / 2 ** 30, "peak_gib": extra / 2 ** 30,
            "peak_vs_model_plus_largest": extra / (model_bytes + largest), "swapped": len(report.swapped)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("rows", 128256), ("cols", 4096), ("reps", 5), ("load_layers", 8), ("hidden", 4096),
                          ("intermediate", 14336), ("heads", 32), ("kv_heads", 8), ("vocab", 32000),
                          ("min_features", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test)")
    p.add_argument("--stages", default="quantize,load", help="comma-separated: quantize, load")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.method:
        print("RESULT " + json.dumps(load_worker(a) if a.method == "load" else quantize_worker(a)), flush=True)
        return
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_nf4.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    stages = a.stages.split(",")
    bad = [s for s in stages if s not in ("quantize", "load")]
    if bad:
        raise SystemExit(f"--stages: unknown stage(s) {bad}; choose from quantize, load")
    methods = (METHODS if "quantize" in stages else ()) + (("load",) if "load" in stages else ())
    args = [x for k, v in vars(a).items() if isinstance(v, int) and not isinstance(v, bool) for x in (f"--{k}", str(v))]
    from benchmarks.driver import error_cell, meta, run_worker, write_results

    rows = []
    for method in methods:
        cmd = [sys.executable, os.path.abspath(__file__), *args, "--device", a.device, "--method", method]
        row = run_worker(cmd, {"method": method}, a.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    table = ["| method | seconds | peak (total) / input | peak beyond input / input | notes |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['method']} | {error_cell(r['error'])} ||||")
        elif r["method"] == "load_quantized_model":
            table.append(f"| {r['method']} ({r['layers']} layers) | {r['seconds']:.1f} | | | peak {r['peak_gib']:.2f} GiB = "
                         f"{r['peak_vs_model_plus_largest']:.2f}x (NF4 model {r['nf4_model_gib']:.2f} + largest tensor "
                         f"{r['largest_tensor_gib']:.2f} GiB; checkpoint {r['checkpoint_gib']:.2f} GiB) |")
        else:
            note = (f"codes = torchao: {r['codes_equal_torchao']:.6f}, scales = torchao: {r['scales_equal_torchao']}"
                    if "codes_equal_torchao" in r else "")
            table.append(f"| {r['method']} {r['shape'][0]}x{r['shape'][1]} | {r['seconds']:.3f} | "
                         f"{r['peak_total_vs_input']:.2f}x | {r['peak_extra_vs_input']:.2f}x | {note} |")

    info = meta(a.device, key="device")
    write_results({"meta": info, "rows": rows}, table, f"{info['device']}, torch {info['torch']}", a.json, a.markdown)


if __name__ == "__main__":
    main()
