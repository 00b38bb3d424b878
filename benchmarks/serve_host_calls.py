#!/usr/bin/env python
"""Host work per decoded token of transformers' compiled ``generate`` for torchao-quantized weights: Python calls
and Dynamo guards.

    python benchmarks/serve_host_calls.py          # every kind below
    python benchmarks/serve_host_calls.py --kinds bf16,int4,int4_lean --json OUT.json

Why (issue 26): on the H200 the compiled decode of our quantized exports left the GPU idle 63-70% of each token
against bf16's 39% (``docs/results/serve_profile_compiled_h200.md``), with the same CUDA-graph replay per token;
the host's extra time was AOTAutograd's wrapper around tensor-subclass weights and Dynamo's guard check. This
measures, on any machine, for a tiny Llama whose compute is negligible, per ``generate`` call with the static
cache compiled (the prefill included in the per-token figures):

* ``calls_per_token``: Python function calls (``cProfile``), not seconds: the count does not depend on how busy
  the machine is;
* ``guards``: the guards Dynamo checks before each call of the compiled decode step (the leaf guards of its cache
  entries' guard trees, C++ and Python alike; a count, by guard type in ``guards_by_type``);
* ``cache_lookup_ms_per_token``: the profiler's ``TorchDynamo Cache Lookup`` self time per new token (the guard
  check), the least of three profiled calls; a time: it depends on the machine and its load (on a shared 2-core
  CPU one kind's figure varied up to 6x between runs), so the guard count is the figure to compare.

Kinds: ``bf16`` weights; ``int4``: torchao's int4 weight-only tensor subclass (``IntxWeightOnlyConfig``, the
layout that runs on a CPU); ``int4_unwrapped``: the same after ``torchao.utils.unwrap_tensor_subclass`` (the
benchmark's ``compiled_unwrapped`` mode); ``int4_filtered``: the subclass compiled with the nn-module guards skipped
(``hf_lowbit.qat.serving.serving_compile_config``); ``bf16_lean`` / ``int4_lean``: ``prepare_for_serving`` (our
unwrap, each weight rebuilt by one in-graph call, and the guard filter; the benchmark's ``compiled_lean`` mode).
It does not include what a CUDA-graph replay adds on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.util
import os
import pstats
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

KINDS = ("bf16", "int4", "int4_unwrapped", "int4_filtered", "bf16_lean", "int4_lean")


def serving_helpers():
    """``hf_lowbit/qat/serving.py`` loaded from its file: it imports only torch, and a serving process needs no more."""
    spec = importlib.util.spec_from_file_location("hf_lowbit_serving", os.path.join(ROOT, "hf_lowbit", "qat",
                                                                                     "serving.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_of(kind: str, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if kind.startswith("int4"):
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    if kind == "int4_unwrapped":
        from torchao.utils import unwrap_tensor_subclass

        m.requires_grad_(False)  # the integer inner tensors cannot be parameters that need grad
        unwrap_tensor_subclass(m)
    if kind.endswith("_lean"):
        serving_helpers().unwrap_quantized_weights(m)
    return m


def _leaf_guards(manager, counts: collections.Counter) -> collections.Counter:
    """Every leaf guard under one node of a Dynamo guard tree, by type (dict managers hold theirs per key / value)."""
    for guard in manager.get_leaf_guards():
        counts[type(guard).__name__] += 1
    if hasattr(manager, "get_key_value_managers"):
        for pair in manager.get_key_value_managers().values():
            for sub in pair:
                if sub is not None:
                    _leaf_guards(sub, counts)
    for child in manager.get_child_managers():
        _leaf_guards(child, counts)
    return counts


def compiled_guards() -> list[collections.Counter]:
    """The leaf guards of each cache entry Dynamo holds now (after ``torch._dynamo.reset()``: this model's), by
    type: one entry per compiled graph of a frame (the decode step at one batch size, a prefill)."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = []
    for ref in input_codes.seen:
        code = ref()
        for entry in _debug_get_cache_entry_list(code) if code is not None else ():
            counts = _leaf_guards(entry.guard_manager.root, collections.Counter())
            for guard in getattr(entry.guard_manager.root, "get_epilogue_lambda_guards", list)():
                counts[type(guard).__name__] += 1
            entries.append(counts)
    return entries


def calls_per_token(kind: str, layers: int, tokens: int, backend: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from transformers import CompileConfig

    torch._dynamo.reset()  # the guard count is of this kind's compiled code alone
    m = model_of(kind, layers)
    if kind.endswith(("_lean", "_filtered")):
        cc = serving_helpers().serving_compile_config(backend)
    else:
        cc = CompileConfig(backend=backend)
    cc._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))

    def run():
        return m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                          cache_implementation="static", compile_config=cc)

    with torch.no_grad():
        out = run()  # compiles
        run()
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        lookups = []
        for _ in range(3):  # the least of three: the other work of a shared machine only adds to it
            with profile(activities=[ProfilerActivity.CPU]) as tprof:
                run()
            lookups.append(sum(e.self_cpu_time_total for e in tprof.key_averages()
                               if e.key == "TorchDynamo Cache Lookup"))
    stats = pstats.Stats(prof)
    top = sorted(((v[1], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.stats.items()), reverse=True)[:8]
    lookup = min(lookups)
    guards = sum(compiled_guards(), collections.Counter())  # here one entry: the decode step
    return {"kind": kind, "calls_per_token": stats.total_calls / tokens, "parameters": sum(1 for _ in m.parameters()),
            "guards": sum(guards.values()), "guards_by_type": dict(guards.most_common()),
            "cache_lookup_ms_per_token": lookup / 1000 / tokens,
            "tokens": out[0, ids.shape[1]:].tolist(),
            "most_called": [{"function": name, "calls_per_token": n / tokens} for n, name in top]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated from {', '.join(KINDS)}")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="new tokens per generate call")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: quicker, same wrappers)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds {a.kinds}: choose from {', '.join(KINDS)}")
    rows = []
    for k in kinds:
        rows.append(calls_per_token(k, a.layers, a.tokens, a.backend))
        r = rows[-1]
        print(f"{r['kind']:>15}: {r['calls_per_token']:8.0f} Python calls per new token, {r['guards']:5d} guards, "
              f"cache lookup {r['cache_lookup_ms_per_token']:.3f} ms/token ({r['parameters']} parameters)", flush=True)
    if a.json:
        from benchmarks.driver import meta, save_json

        save_json(a.json, {"meta": meta("cpu", key="device", config=vars(a)), "rows": rows})


if __name__ == "__main__":
    main()
