#!/usr/bin/env python
"""Host work per decoded token of transformers' compiled ``generate`` for torchao-quantized weights: Python calls.

    python benchmarks/serve_host_calls.py                      # bf16, int4 weight-only, int4 unwrapped
    python benchmarks/serve_host_calls.py --json OUT.json

Why (issue 26): on the H200 the compiled decode of our quantized exports left the GPU idle 63-70% of each token
against bf16's 39% (``docs/results/serve_profile_compiled_h200.md``), with the same CUDA-graph replay per token.
This counts, on any machine, the Python function calls one ``generate`` makes per new token (``cProfile``; the
prefill included) for a tiny Llama whose compute is negligible: bf16 weights; torchao's int4 weight-only tensor
subclass (``IntxWeightOnlyConfig``, the layout that runs on a CPU); and the same after
``torchao.utils.unwrap_tensor_subclass`` (the benchmark's ``compiled_unwrapped`` mode). Calls, not seconds: the
count does not depend on how busy the machine is. It does not include what a CUDA-graph replay adds on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

KINDS = ("bf16", "int4", "int4_unwrapped")


def model_of(kind: str, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if kind != "bf16":
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    if kind == "int4_unwrapped":
        from torchao.utils import unwrap_tensor_subclass

        m.requires_grad_(False)  # the integer inner tensors cannot be parameters that need grad
        unwrap_tensor_subclass(m)
    return m


def calls_per_token(kind: str, layers: int, tokens: int, backend: str) -> dict:
    from transformers import CompileConfig

    m = model_of(kind, layers)
    cc = CompileConfig(backend=backend)
    cc._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))

    def run():
        return m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                          cache_implementation="static", compile_config=cc)

    with torch.no_grad():
        run()  # compiles
        run()
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
    stats = pstats.Stats(prof)
    top = sorted(((v[1], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.stats.items()), reverse=True)[:8]
    return {"kind": kind, "calls_per_token": stats.total_calls / tokens, "parameters": sum(1 for _ in m.parameters()),
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
    rows = [calls_per_token(k, a.layers, a.tokens, a.backend) for k in kinds]
    for r in rows:
        print(f"{r['kind']:>15}: {r['calls_per_token']:8.0f} Python calls per new token ({r['parameters']} parameters)")
    if a.json:
        from benchmarks.driver import meta, save_json

        save_json(a.json, {"meta": meta("cpu", key="device", config=vars(a)), "rows": rows})


if __name__ == "__main__":
    main()
