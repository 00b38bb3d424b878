#!/usr/bin/env python
"""What a compiled decoder layer keeps for its backward, and where a training step's memory peaks, on a CPU.

Issue 25 (8x2048 tokens, 8 Llama-8B-shaped layers each compiled, 49281da): int8_xcodes / fp8_xcodes peaked at the same
byte as int8 / fp8 on the H200. Two modes answer why without a GPU:

* ``--mode partition``: one full-size decoder layer (``benchmark_train.py``'s model, one layer) compiled by Inductor;
  the joint graph's min-cut partition is read (the backward graph's inputs other than the tangents: every tensor the
  forward keeps for the backward) and the compile is stopped there, so nothing of that size is ever computed.
* ``--mode timeline``: one training step (forward, backward, fused AdamW, ``zero_grad``) of the 8-layer bench scaled
  down by ``--scale`` in every dimension (hidden, MLP, heads, vocab, tokens: every tensor, weights and activations
  alike, 1/scale^2 of its bytes) with each layer compiled, run for real; the CPU allocator's events
  (``torch.profiler(profile_memory=True)``) give the running total, the peak, the phase and op it falls in; the bytes
  are reported scaled back up (x scale^2), plus parameters and optimizer states.

``--kernels`` says what the low-bit ops look like to the partitioner, which is what decides what is saved:

* ``cuda``: the ``triton_op`` bodies CUDA runs (``quantize_t_triton``, ``int8_scaled_mm_triton``), traced to
  ``triton_kernel_wrapper_functional`` nodes as on the GPU (a stand-in Triton target lets the kernels' TTIR be
  generated for the mutation analysis; partition mode only: nothing can run);
* ``opaque``: opaque custom ops (banned from recomputation like the Triton kernels, but CSE merges two calls on
  the same input, which the Triton ones escape: their outputs come from ``aten.empty``); timeline mode runs them
  with low-transient CPU bodies;
* ``cpu``: the shipped CPU path (plain-torch quantization that Inductor may fuse and recompute).

``--functorch_config key=value,...`` sets ``torch._functorch.config`` first (e.g.
``ban_recompute_materialized_backward=False``).

    python benchmarks/activation_memory_probe.py --mode partition --kernels cuda --recipes bf16,int8,int8_xcodes
    python benchmarks/activation_memory_probe.py --mode timeline --kernels opaque --recipes bf16,int8

Each recipe runs in its own process (``--recipe`` is the worker mode). A diagnostic: no committed result.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GIB = 2 ** 30
KERNELS = ("cuda", "opaque", "cpu")


def set_functorch_config(spec: str) -> dict:
    import torch._functorch.config as fc

    out = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        if not hasattr(fc, key):
            raise SystemExit(f"--functorch_config: torch._functorch.config has no {key!r}")
        out[key] = {"True": True, "False": False}.get(value, value)
        setattr(fc, key, out[key] if isinstance(out[key], bool) else type(getattr(fc, key))(value))
    return out


def use_kernels(kind: str, share_min_rows: int) -> None:
    """Replace the low-bit ops the layers call (``kernels.quantize_t``, the formats' ``scaled_mm``) as ``kind`` says;
    for ``cuda``, siblings share X's column codes from ``share_min_rows`` rows (CUDA's rule, ``SHARE_MIN_ROWS``)."""
    from dataclasses import replace

    import torch

    import hf_lowbit.kernels as K
    from hf_lowbit.kernels import formats as F

    if kind == "cpu":
        return
    if kind == "cuda":
        import triton
        from triton.backends.compiler import GPUTarget

        from hf_lowbit.kernels.quantize_t import _activation_variant as activation_variant
        from hf_lowbit.kernels.triton_int8 import int8_scaled_mm_triton
        from hf_lowbit.kernels.triton_quant import quantize_t_triton

        class StandInDriver:  # only the target is asked for: the kernels' TTIR (mutation analysis), never a launch
            def get_current_target(self):
                return GPUTarget("cuda", 90, 32)

            def get_current_device(self):
                return 0

        triton.runtime.driver.set_active(StandInDriver())

        @torch.library.triton_op("probe::quantize_t", mutates_args=())
        def quantize_t(x: torch.Tensor, fmt: str, stochastic: bool = False,
                       row_mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            f = F.FORMATS[fmt]  # the variant hf_lowbit::quantize_t would take (its ACTIVATION_VARIANT)
            return quantize_t_triton(x, f.dtype, f.qmax, stochastic=stochastic, row_mul=row_mul,
                                     variant=activation_variant(fmt, stochastic))

        @torch.library.triton_op("probe::int8_scaled_mm", mutates_args=())
        def scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
            return int8_scaled_mm_triton(a, b, sa, sb, out_dtype)

        formats = ("int8",)  # FP8 on CUDA is aten._scaled_mm; here its CPU custom op, opaque too
        # X's column codes through hf_lowbit::quantize_t_shared from share_min_rows rows, as on CUDA
        K.shares_codes = lambda x: x.shape[0] >= share_min_rows
    else:
        rows = 256  # row chunks: no full-size float32 temporaries (the GPU kernels have none)

        @torch.library.custom_op("probe::quantize_t", mutates_args=())
        def quantize_t(x: torch.Tensor, fmt: str, stochastic: bool = False,
                       row_mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            f = F.FORMATS[fmt]
            amax = torch.zeros(x.shape[1], dtype=torch.float32)
            for i in range(0, x.shape[0], rows):
                xc = x[i:i + rows].float() * (1 if row_mul is None else row_mul[i:i + rows, None])
                amax = torch.maximum(amax, xc.abs().amax(0))
            scale = amax.clamp(min=1e-30) / f.qmax
            q = torch.empty(x.shape[1], x.shape[0], dtype=f.dtype)
            for i in range(0, x.shape[0], rows):
                xc = x[i:i + rows].float() * (1 if row_mul is None else row_mul[i:i + rows, None])
                q[:, i:i + rows] = f.encode(xc, scale.reshape(1, -1)).T
            return q, scale

        @quantize_t.register_fake
        def _(x, fmt, stochastic=False, row_mul=None):
            return (x.new_empty((x.shape[1], x.shape[0]), dtype=F.FORMATS[fmt].dtype),
                    x.new_empty((x.shape[1],), dtype=torch.float32))

        @torch.library.custom_op("probe::scaled_mm", mutates_args=())
        def scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
            out, bf = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype), b.float()
            for i in range(0, a.shape[0], rows):
                out[i:i + rows] = (a[i:i + rows].float() @ bf.T * sa.reshape(-1, 1)[i:i + rows]
                                   * sb.reshape(1, -1)).to(out_dtype)
            return out

        @scaled_mm.register_fake
        def _(a, b, sa, sb, out_dtype):
            return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

        formats = ("int8", "fp8")
    K.quantize_t = quantize_t
    for fmt in formats:
        F.FORMATS[fmt] = replace(F.FORMATS[fmt], scaled_mm=lambda a, b, sa, sb, od, *add: scaled_mm(a, b, sa, sb, od))


def build(a):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.driver import apply_process_setting, apply_recipe, compile_layers, llama_config

    apply_process_setting(a.recipe)  # *_recompute recipes
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(a), dtype=torch.bfloat16, attn_implementation="sdpa")
    apply_recipe(model, a.recipe, a.min_features)  # not check_recipe_active: a stand-in kernel may not run
    compile_layers(model, a.layers)
    return model


class _Partitioned(Exception):
    pass


QUANTIZE_PASS_KERNELS = ("_quantize_t_kernel", "_quantize_t_amax_kernel")  # quantize_t's encoding pass, per variant


def quantize_calls(graph) -> dict:
    """How many column quantizations a graph makes: opaque ``quantize_t*`` ops by name, traced Triton launches by
    kernel (the encoding pass, one per ``quantize_t`` call: ``_quantize_t_kernel`` or, for the atomic variants,
    ``_quantize_t_amax_kernel``)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    counts = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if "triton_kernel_wrapper" in name:
            kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
            if name not in QUANTIZE_PASS_KERNELS:
                continue
        elif "quantize_t" not in name:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def partition_worker(a) -> dict:
    """One layer's saved-for-backward tensors: name, shape, dtype, bytes, the forward op that makes it."""
    import torch
    import torch._inductor.compile_fx as cfx

    a.layers, a.vocab = 1, 512  # the vocabulary is outside the compiled layer
    found = {}
    real = cfx.min_cut_rematerialization_partition

    def partition(gm, joint_inputs, **kw):
        fw, bw = real(gm, joint_inputs, **kw)
        made_by = {n.name: n for n in fw.graph.nodes}
        rows = []
        for n in bw.graph.nodes:
            if n.op != "placeholder" or n.name.startswith("tangents"):
                continue
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                src = made_by.get(n.name)
                op = "input" if src is None or src.op == "placeholder" else str(src.target)
                rows.append({"name": n.name, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""),
                             "bytes": v.numel() * v.element_size(), "op": op})
        found["rows"] = rows
        found["quantize_calls"] = {"forward": quantize_calls(fw.graph), "backward": quantize_calls(bw.graph)}
        raise _Partitioned  # nothing compiled or run beyond this

    cfx.min_cut_rematerialization_partition = partition
    model = build(a)
    params = {tuple(p.shape) for p in model.model.layers[0].parameters()}
    ids = torch.zeros(a.batch, a.seq, dtype=torch.long)
    try:
        model(input_ids=ids, labels=ids)
    except Exception as e:  # Dynamo wraps it
        if "_Partitioned" not in repr(e) and not isinstance(e, _Partitioned):
            raise
    rows = found["rows"]
    for r in rows:  # a parameter is kept alive anyway: saving it costs nothing
        r["param"] = r["op"] == "input" and tuple(r["shape"]) in params
    saved = sum(r["bytes"] for r in rows if not r["param"])
    return {"recipe": a.recipe, "mode": "partition", "kernels": a.kernels, "tokens": a.batch * a.seq,
            "saved_gib": saved / GIB, "saved_bytes_per_token": saved / (a.batch * a.seq), "rows": rows,
            "quantize_calls": found["quantize_calls"]}


def timeline_worker(a) -> dict:
    """One real step of the scaled bench, the CPU allocator's running total around it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    s = a.scale
    a.hidden, a.intermediate, a.vocab = a.hidden // s, a.intermediate // s, a.vocab // s
    a.heads, a.kv_heads = max(1, a.heads // s), max(1, a.kv_heads // s)
    tokens = a.batch * a.seq // s
    a.batch = max(1, a.batch // s)
    a.seq = tokens // a.batch
    model = build(a)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen) for _ in range(2)]

    def step(ids):  # benchmark_train's hand loop (driver.train_step), its phases marked
        with record_function("phase:forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
        with record_function("phase:zero_grad"):
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.time()
    warm = [float(step(batches[i % 2])) for i in range(a.warmup)]  # compile, and the optimizer's states
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    static = nbytes(params) + nbytes([v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = float(step(batches[a.warmup % 2]))
    events = list(prof.profiler.kineto_results.events())
    cur, peak, at, after_forward = 0, 0, None, None
    phases = [(e.name().split(":")[1], e.start_ns(), e.end_ns()) for e in events if e.name().startswith("phase:")]
    fwd_end = next(end for name, _, end in phases if name == "forward")
    phase_peak = {}

    def phase_of(t):
        return next((name for name, start, end in phases if start <= t <= end), "between")

    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        cur += n
        if t <= fwd_end:
            after_forward = cur
        ph = phase_of(t)
        phase_peak[ph] = max(phase_peak.get(ph, 0), cur)
        if cur > peak:
            peak, at = cur, t
    ops = sorted((e.end_ns() - e.start_ns(), e.name()) for e in events
                 if e.name() != "[memory]" and not e.name().startswith("phase:") and e.start_ns() <= at <= e.end_ns())
    up = s * s / GIB
    return {"recipe": a.recipe, "mode": "timeline", "kernels": a.kernels, "scale": s, "tokens_run": tokens,
            "static_gib": static * up, "peak_gib": (static + peak) * up, "peak_phase": phase_of(at),
            "peak_ops": [name for _, name in ops[:3]], "after_forward_gib": (static + after_forward) * up,
            "phase_peak_gib": {k: (static + v) * up for k, v in phase_peak.items()},
            "losses": warm + [loss], "seconds": time.time() - t0}


def main():
    from benchmarks.driver import FULL_RECIPES, add_int_flags
    from hf_lowbit.kernels.quantize_t import SHARE_MIN_ROWS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("partition", "timeline"), default="partition")
    p.add_argument("--kernels", choices=KERNELS, default="cuda")
    p.add_argument("--recipes", default="bf16,int8,int8_xcodes")
    p.add_argument("--functorch_config", default="", help="key=value,... set on torch._functorch.config first")
    p.add_argument("--share_min_rows", type=int, default=SHARE_MIN_ROWS,
                   help="--kernels cuda: rows from which siblings share X's column codes (CUDA's default: %(default)s)")
    add_int_flags(p, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=8, batch=8, seq=2048,
                  scale=8, warmup=2, min_features=64)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per recipe process")
    p.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.recipe:
        config = set_functorch_config(a.functorch_config)
        use_kernels(a.kernels, a.share_min_rows)
        row = (partition_worker if a.mode == "partition" else timeline_worker)(a)
        print("RESULT " + json.dumps({**row, "functorch_config": config}), flush=True)
        return
    if a.mode == "timeline" and a.kernels == "cuda":
        raise SystemExit("--mode timeline runs the step: --kernels opaque (the GPU's partition, CSE aside) or cpu")
    rows = []
    for recipe in a.recipes.split(","):
        if recipe not in FULL_RECIPES:
            raise SystemExit(f"--recipes: {recipe!r} is not one of {', '.join(FULL_RECIPES)}")
        cmd = [sys.executable, os.path.abspath(__file__), "--recipe", recipe] + [
            x for k, v in vars(a).items() if k not in ("recipe", "recipes", "json") and v is not None
            for x in (f"--{k}", str(v))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        row = json.loads(line[7:]) if line else {"recipe": recipe, "error": proc.stderr[-800:]}
        rows.append(row)
        if "error" in row:
            print(f"{recipe}: failed\n{row['error']}", flush=True)
        elif a.mode == "partition":
            print(f"{recipe}: {row['saved_gib']:.3f} GiB kept for the backward per layer "
                  f"({row['saved_bytes_per_token']:.0f} bytes a token)", flush=True)
            for r in row["rows"]:
                if not r["param"]:
                    print(f"    {r['name']:16s} {str(tuple(r['shape'])):22s} {r['dtype']:9s} "
                          f"{r['bytes'] / 2 ** 20:8.1f} MiB  {r['op']}")
            print(f"    column quantizations: {row['quantize_calls']}")
        else:
            print(f"{recipe}: peak {row['peak_gib']:.3f} GiB ({row['peak_phase']}, {row['peak_ops'][:1]}), after the "
                  f"forward {row['after_forward_gib']:.3f}, parameters + optimizer states {row['static_gib']:.3f}",
                  flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items() if k != "recipe"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
