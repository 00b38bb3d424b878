#!/usr/bin/env python
"""A model (not a measurement) of FSDP2 per-GPU throughput at 8, 64 and 512 H200s, per recipe, for the
Llama-8B and Llama-70B shapes, from the measured per-GPU compute of docs/results/fsdp2_h200x2.json,
fsdp2_b4_h200x2.json and fsdp2_lora_h200x2.json and the bytes each recipe puts on the wire.

    python benchmarks/fsdp2_scaling_model.py --json docs/results/fsdp2_scaling_model.json \\
        --markdown docs/results/fsdp2_scaling_model.md --plot docs/results/fsdp2_scaling_model.png

Per optimizer step on each GPU, with ``g`` micro-batches of ``m`` tokens (gradient accumulation):

    step = g * (max(compute, comm) + comm / layers) + optimizer / N

* compute: measured per micro-batch (below); the 70B shape scales it by the linear-layer parameter ratio
  (matmul FLOPs; attention at 2048 tokens is a few %), keeping each recipe's measured ratio to bf16.
* comm per micro-batch, ring collectives, each GPU moving (N-1)/N of the full tensor: FSDP2 with
  ``reshard_after_forward`` all-gathers every parameter twice (forward, backward) and reduce-scatters the
  trainable gradients once (fp32, the config's ``reduce_dtype``; the bench's hand loop syncs every
  micro-batch). Gathered bytes per linear parameter: bf16 2; low-bit all-gather 1 + 4/K (int8/fp8 codes
  + an fp32 scale per row of K); NF4 base in its carrier 0.5 + 1/64 (NF4 block scales); embeddings, norms
  and LM head always 2 (bf16).
* overlap: communication hides behind compute up to the compute time (FSDP2 prefetches the next layer's
  all-gather); one layer's worth (comm / layers) is always exposed (the first gather, the last reduce).
* optimizer: fused AdamW over the local shard, fp32 param/grad/m/v: 28 bytes read+written per parameter
  at 3.8 TB/s (80% of the H200's 4.8 TB/s); 7.2B parameters -> 53 ms on one GPU.
* links, per GPU, one direction, effective (80% of peak): up to 8 GPUs NVLink 4 (H200: 450 GB/s per
  direction, 900 GB/s bidirectional) -> 360 GB/s; beyond one node, rings cross InfiniBand at 400 Gb/s per
  GPU (one NIC per GPU) -> 40 GB/s, the bottleneck for the whole ring.
* memory: fp32 master weights + AdamW state + fp32 gradients, 16 B per trainable parameter, sharded;
  a configuration needing more than 100 GiB per GPU of it (activations and gathered layers need the
  rest of the 141 GB) is marked as not fitting.

Checked against the 2-GPU measurements: the modelled 2-GPU step at 1x2048 (compute from the 1-GPU runs)
beside the measured one (``check_2gpu`` in the JSON). The 4x2048 compute is derived from 2-GPU runs,
which therefore cannot check it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "docs", "results")

NVLINK_GBS, IB_GBS, EFFICIENCY, GPUS_PER_NODE = 450.0, 50.0, 0.8, 8
HBM_TBS = 4.8
OPT_BYTES_PER_PARAM = 28
FIT_GIB = 100.0


def shape_params(hidden, intermediate, layers, kv_dim, vocab):
    """(linear parameters, other parameters, layers)."""
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * intermediate
    return per_layer * layers, 2 * vocab * hidden + (2 * layers + 1) * hidden, layers


SHAPES = {  # the bench's Llama-8B shape (vocab 32000, what was measured) and Llama-3-70B
    "llama8b": dict(hidden=4096, intermediate=14336, layers=32, kv_dim=1024, vocab=32000),
    "llama70b": dict(hidden=8192, intermediate=28672, layers=80, kv_dim=1024, vocab=128256),
}

# recipe -> (measured compute source recipe, gathered bytes per linear parameter (K: row length), trainable)
RECIPES = {
    "bf16": ("bf16", lambda k: 2.0, "all"),
    "int8": ("int8", lambda k: 2.0, "all"),
    "fp8": ("fp8", lambda k: 2.0, "all"),
    "int8 + low-bit all-gather": ("int8", lambda k: 1.0 + 4.0 / k, "all"),
    "fp8 + low-bit all-gather": ("fp8", lambda k: 1.0 + 4.0 / k, "all"),
    "lora_bf16": ("lora_bf16", lambda k: 2.0, "adapters"),
    "lora_nf4_int8 (sharded base)": ("lora_nf4_int8", lambda k: 0.5 + 1.0 / 64, "adapters"),
}
REFERENCE = {"lora_nf4_int8 (sharded base)": "lora_bf16", "lora_bf16": "lora_bf16"}


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)["rows"]


def measured_compute_ms(p_linear_other: float) -> dict:
    """Per-micro-batch compute (ms) per recipe at 1x2048 and 4x2048 tokens, from the 32-layer FSDP2 runs:
    1 GPU (1x2048: no collectives, 2 micro-batches + a full optimizer step), 2 GPUs (4x2048: 1 micro-batch
    + half an optimizer step + the exposed layer of comm, subtracted as the model has it)."""
    opt_1gpu = optimizer_ms(p_linear_other)
    out = {"1x2048": {}, "4x2048": {}}
    for row in load("fsdp2_h200x2.json") + load("fsdp2_lora_h200x2.json"):
        if row["gpus"] == 1 and "error" not in row:
            opt = opt_1gpu if not row["recipe"].startswith("lora") else 0.0  # adapters' AdamW: negligible
            out["1x2048"][row["recipe"]] = (row["step_ms"] - opt) / row["grad_accum"]
    for row in load("fsdp2_b4_h200x2.json"):
        exposed = comm_ms(2, "bf16", "llama8b") / 32  # one layer's comm, as in step_ms
        out["4x2048"][row["recipe"]] = row["step_ms"] - opt_1gpu / 2 - exposed
    return out


def optimizer_ms(params: float) -> float:
    return params * OPT_BYTES_PER_PARAM / (HBM_TBS * 1e12 * EFFICIENCY) * 1e3


def link_gbs(n: int) -> float:
    return (NVLINK_GBS if n <= GPUS_PER_NODE else IB_GBS) * EFFICIENCY


def comm_ms(n: int, recipe: str, shape: str) -> float:
    """All-gathers (x2) and reduce-scatter of one micro-batch, per GPU, ms (independent of tokens)."""
    if n == 1:
        return 0.0
    p_lin, p_other, _ = shape_params(**SHAPES[shape])
    _, gather_bytes, trainable = RECIPES[recipe]
    k = SHAPES[shape]["hidden"]
    gathered = p_lin * gather_bytes(k) + p_other * 2.0
    reduced = 4.0 * (p_lin + p_other) if trainable == "all" else 0.0
    return (2 * gathered + reduced) * (n - 1) / n / (link_gbs(n) * 1e9) * 1e3


def step_ms(n, micro_tokens, grad_accum, recipe, shape, compute):
    p_lin, p_other, layers = shape_params(**SHAPES[shape])
    regime = "1x2048" if micro_tokens == 2048 else "4x2048"
    source = RECIPES[recipe][0]
    c = compute[regime].get(source)
    if c is None:
        return None
    p8_lin, _, _ = shape_params(**SHAPES["llama8b"])
    c *= p_lin / p8_lin
    comm = comm_ms(n, recipe, shape)
    trainable = p_lin + p_other if RECIPES[recipe][2] == "all" else 0.0
    return grad_accum * (max(c, comm) + comm / layers) + optimizer_ms(trainable) / n, c, comm


def fits(n, recipe, shape) -> bool:
    p_lin, p_other, _ = shape_params(**SHAPES[shape])
    state = 16.0 * (p_lin + p_other) if RECIPES[recipe][2] == "all" else 0.0
    frozen = (p_lin * RECIPES[recipe][1](SHAPES[shape]["hidden"]) + 2 * p_other) if RECIPES[recipe][2] != "all" else 0
    return (state + frozen) / n / 2 ** 30 <= FIT_GIB


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="8,64,512")
    p.add_argument("--json"), p.add_argument("--markdown"), p.add_argument("--plot")
    a = p.parse_args()
    p8_lin, p8_other, _ = shape_params(**SHAPES["llama8b"])
    compute = measured_compute_ms(p8_lin + p8_other)
    rows = []
    regimes = (("1x2048, GA 8", 2048, 8), ("4x2048, GA 2", 8192, 2))
    for shape in SHAPES:
        for label, tokens, ga in regimes:
            for n in [int(g) for g in a.gpus.split(",")]:
                for recipe in RECIPES:
                    r = step_ms(n, tokens, ga, recipe, shape, compute)
                    if r is None:
                        continue
                    ms, c, comm = r
                    rows.append({"shape": shape, "regime": label, "micro_batch_tokens": tokens, "grad_accum": ga,
                                 "gpus": n, "recipe": recipe, "step_ms": ms, "compute_ms_per_micro": c,
                                 "comm_ms_per_micro": comm, "comm_bound": comm > c,
                                 "tok_s_per_gpu": tokens * ga / ms * 1e3, "fits": fits(n, recipe, shape)})
    for r in rows:
        ref_name = REFERENCE.get(r["recipe"], "bf16")
        ref = next(x for x in rows if x["recipe"] == ref_name and all(x[k] == r[k] for k in ("shape", "regime", "gpus")))
        r["vs_ref"], r["reference"] = r["tok_s_per_gpu"] / ref["tok_s_per_gpu"], ref_name
    # the check: the 2-GPU 1x2048 runs, predicted from the 1-GPU runs' compute (the 4x2048 compute comes from
    # the 2-GPU runs themselves, so those agree by construction and are no check)
    check = []
    for name, tokens in (("fsdp2_h200x2.json", 2048), ("fsdp2_lora_h200x2.json", 2048)):
        for row in load(name):
            recipe = row["recipe"] if row["recipe"] != "lora_nf4_int8" else None  # its bases were not sharded then
            if row["gpus"] != 2 or recipe not in RECIPES:
                continue
            ms = step_ms(2, tokens, 1, recipe, "llama8b", compute)[0]
            check.append({"file": name, "recipe": recipe, "measured_step_ms": row["step_ms"], "modelled_step_ms": ms,
                          "modelled_over_measured": ms / row["step_ms"]})
    data = {"kind": "model, not a measurement", "assumptions": {
        "nvlink_GBps_per_direction": NVLINK_GBS, "ib_GBps_per_gpu": IB_GBS, "link_efficiency": EFFICIENCY,
        "gpus_per_node": GPUS_PER_NODE, "hbm_TBps": HBM_TBS, "optimizer_bytes_per_param": OPT_BYTES_PER_PARAM,
        "fit_GiB_of_sharded_state": FIT_GIB, "compute_ms_per_micro_batch_8b": compute,
        "reduce_scatter": "fp32, every micro-batch", "all_gathers_per_micro_batch": 2},
        "doc": __doc__.split("\n\n", 2)[2], "check_2gpu": check, "rows": rows}
    table = ["| shape | regime | GPUs | recipe | tok/s per GPU | vs ref | comm / compute per micro-batch (ms) | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['shape']} | {r['regime']} | {r['gpus']} | {r['recipe']} | {r['tok_s_per_gpu']:,.0f} | "
                     f"{r['vs_ref']:.2f}x{'' if r['reference'] == 'bf16' else ' (vs ' + r['reference'] + ')'} | "
                     f"{r['comm_ms_per_micro']:.0f} / {r['compute_ms_per_micro']:.0f}{' (comm-bound)' if r['comm_bound'] else ''}"
                     f" | {'yes' if r['fits'] else 'no'} |")
    check_table = ["| file | recipe | measured 2-GPU step ms | modelled | modelled / measured |", "|---|---|---|---|---|"]
    for c in check:
        check_table.append(f"| {c['file']} | {c['recipe']} | {c['measured_step_ms']:.0f} | {c['modelled_step_ms']:.0f} | "
                           f"{c['modelled_over_measured']:.2f} |")
    print("\n".join(check_table + [""] + table))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("FSDP2 scaling **model** (not a measurement): `benchmarks/fsdp2_scaling_model.py`; assumptions "
                    "in its docstring and the JSON.\n\nCheck against the 2-GPU measurements:\n\n"
                    + "\n".join(check_table) + "\n\n" + "\n".join(table) + "\n")
    if a.plot:
        plot(rows, a.plot)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8), sharey=True)
    panels = [(s, reg) for s in SHAPES for reg in ("1x2048, GA 8", "4x2048, GA 2")]
    for ax, (shape, regime) in zip(axes, panels):
        sel = [r for r in rows if r["shape"] == shape and r["regime"] == regime]
        for recipe in RECIPES:
            pts = [(r["gpus"], r["vs_ref"]) for r in sel if r["recipe"] == recipe]
            if pts and recipe not in ("bf16", "lora_bf16"):
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=recipe)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([8, 64, 512], ["8", "64", "512"])
        ax.set_title(f"{shape}, {regime}", fontsize=9)
        ax.set_xlabel("GPUs (>8: InfiniBand)")
    axes[0].set_ylabel("tok/s per GPU vs bf16\n(QLoRA: vs LoRA bf16)")
    axes[0].legend(fontsize=7)
    fig.suptitle("FSDP2 scaling MODEL (not measured): measured 1-2 GPU compute + modelled collectives", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
