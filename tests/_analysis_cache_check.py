"""Trace the CUDA graph of a tiny compiled Llama (INT8 recipe, every layer inlined, as the Trainer compiles it) on a
machine without a GPU and print what AOTAutograd made of it: ``python tests/_analysis_cache_check.py LAYERS``.

Triton is pointed at a stand-in sm_90 target (only the target is asked for: the kernels' TTIR, never a launch), the
joint graph is partitioned and the run stops there. Prints one JSON line: the forward and backward graphs' code,
how many times torch generated a kernel's TTIR, and hf_lowbit's analysis cache's counts. Run it with
``HF_LOWBIT_TRITON_ANALYSIS_CACHE=0`` and without: the graphs must be the same (tests/test_analysis_cache.py).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(layers: int) -> None:
    import argparse

    import torch
    import torch._higher_order_ops.triton_kernel_wrap as tkw
    import torch._inductor.compile_fx as cfx
    from transformers import AutoModelForCausalLM

    from benchmarks.activation_memory_probe import use_kernels
    from benchmarks.driver import apply_recipe, llama_config
    from hf_lowbit.kernels import analysis_cache

    ttir = {"calls": 0}
    generate = tkw.generate_ttir

    def counted(*args, **kwargs):
        ttir["calls"] += 1
        return generate(*args, **kwargs)

    tkw.generate_ttir = counted
    use_kernels("cuda", share_min_rows=0)
    graphs = {}
    partition = cfx.min_cut_rematerialization_partition

    class Partitioned(Exception):
        pass

    def stop(gm, joint_inputs, **kw):
        fw, bw = partition(gm, joint_inputs, **kw)
        graphs["forward"], graphs["backward"] = fw.code, bw.code
        raise Partitioned

    cfx.min_cut_rematerialization_partition = stop
    cfg = argparse.Namespace(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, layers=layers, seq=32,
                             batch=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(cfg), dtype=torch.bfloat16, attn_implementation="sdpa")
    apply_recipe(model, "int8", 16)
    ids = torch.zeros(1, 32, dtype=torch.long)
    try:
        torch.compile(model)(input_ids=ids, labels=ids)
    except Exception as e:  # Dynamo wraps it
        if "Partitioned" not in repr(e):
            raise
    print("RESULT " + json.dumps({**graphs, "generate_ttir": ttir["calls"], "cache": analysis_cache.stats()}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
