#!/usr/bin/env python
"""SDPA forward + backward on one H200 with the causal mask materialized (what a whole-model-compiled transformers
model passes) against ``is_causal=True`` (what it passes eagerly, and under ``lowbit_skip_causal_mask``): the kernel
time of each and their largest output difference, at a Llama-8B layer's attention shape (32 heads of 128, 2048
tokens), batch 1 and 8. The kernel-level check of docs/design.md's "The causal mask under torch.compile".

    python benchmarks/sdpa_mask_probe.py --json OUT/sdpa_mask_probe.json     # ~30 s on a GPU
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sdpa_mask_probe: needs a CUDA GPU")
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for b in (1, 8):
        q, k, v = (torch.randn(b, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        mask = torch.ones(2048, 2048, dtype=torch.bool, device="cuda").tril()[None, None].expand(b, 1, 2048, 2048)
        g = torch.randn(b, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
        outs = {}
        for name, kw in (("mask", dict(attn_mask=mask)), ("is_causal", dict(is_causal=True))):
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v, **kw).backward(g)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                F.scaled_dot_product_attention(q, k, v, **kw).backward(g)
            end.record()
            torch.cuda.synchronize()
            res[f"b{b}_{name}_fwd_bwd_ms"] = start.elapsed_time(end) / a.iters
            with torch.no_grad():
                outs[name] = F.scaled_dot_product_attention(q, k, v, **kw).float()
        res[f"b{b}_mask_over_is_causal"] = res[f"b{b}_mask_fwd_bwd_ms"] / res[f"b{b}_is_causal_fwd_bwd_ms"]
        res[f"b{b}_max_abs_diff"] = (outs["mask"] - outs["is_causal"]).abs().max().item()
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
