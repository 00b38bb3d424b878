#!/usr/bin/env python
"""Serving speed of QAT exports where they are served: plain ``from_pretrained`` + ``generate``, one process each.

    python benchmarks/benchmark_serve.py --modes eager --json OUT/serve_eager.json --markdown OUT/serve_eager.md
    python benchmarks/benchmark_serve.py --modes compiled --checkpoints bf16,qat_int4_tinygemm,ptq_int4_tinygemm ...
    python benchmarks/benchmark_serve.py --probe_only --json OUT/serve_probe.json   # which torchao kernels run here
    python benchmarks/benchmark_serve.py --merge OUT/serve_*.json --json docs/results/serve_h200.json \\
        --markdown docs/results/serve_h200.md --plot docs/results/serve_h200.png

One model for every checkpoint: a Llama-8B-shaped decoder (hidden 4096, MLP 14336, 32/8 heads, vocab 32000),
``--layers`` of it (8: 2.0B parameters, 4.01 GB in bf16), random init from a seeded config, saved in bf16.
Checkpoints (``--checkpoints``):

* ``bf16``: that model, the reference of every ratio (same run, same mode).
* ``<checkpoint>@<mode>+<mode>``: that checkpoint in those modes instead of ``--modes`` (bf16 always runs ``--modes``),
  e.g. ``qat_int4_tinygemm,ptq_int4_tinygemm@compiled_lean`` with ``--modes compiled_int4k_mma``: our export on our
  kernels and torchao's PTQ on torchao's path, beside bf16, in one run. A mode bf16 did not run is compared with
  bf16's ``compiled_lean`` or kernel-mode phase: the kernel modes swap nothing of a bf16 model, so those phases serve
  it the same way (the row keeps ``bf16_mode``).
* ``qat_<scheme>``: ``hf_lowbit.qat.prepare_qat`` (``--qat_steps`` AdamW steps on random tokens, to pass through
  training) then ``hf_lowbit.save_quantized``; any scheme of ``hf_lowbit.qat.QAT_SCHEMES``.
* ``ptq_<scheme>``: torchao's PTQ of the same base config: ``quantize_`` on the bf16 model (the same layers), then
  ``save_pretrained`` with a ``TorchAoConfig``, as transformers' own TorchAo PTQ saves.

``--lm_head int4|bf16``: whether the quantized checkpoints quantize the LM head too (QAT: ``include_lm_head``).

Each checkpoint is built in one process and measured in another that imports only transformers + torchao:
load time (``AutoModelForCausalLM.from_pretrained(dir, device_map=...)``), safetensors bytes, weight tensor type,
prefill of 1 x ``--prefill`` tokens (median ms of ``model(ids, logits_to_keep=1, use_cache=False)``), greedy
decode tokens/s at each of ``--batches`` (``generate`` with ``min_new_tokens = max_new_tokens``; the decode rate is
``batch x (T2 - T1) / (t(T2) - t(T1))`` for the two lengths of ``--decode_tokens``, so prefill and per-call
overhead cancel), and peak memory, in each of ``--modes``: ``eager`` (dynamic cache) and ``compiled``
(transformers' compiled path: ``cache_implementation="static"`` with ``compile_config=CompileConfig(mode=
"reduce-overhead")``, which compiles the decode step; the prefill is timed through ``torch.compile(model)``),
and ``compiled_unwrapped``: the same after ``model.requires_grad_(False)`` and
``torchao.utils.unwrap_tensor_subclass(model)``, two lines a user adds after loading, which leaves torchao's quantized weights as plain tensors under a parametrization that rebuilds
them inside the compiled graph. Why: ``--profile`` found the compiled quantized models' GPU idle for most of each
decoded token, longer than bf16's; tensor-subclass parameters cost host time on every compiled call (a
metadata guard and a flatten per weight; on the CPU 3.9x the Python calls per forward of plain weights).
Measured on the H200 (608b2b4): it did not close int4's extra idle time, and FP8 fails to compile after it (see
docs/qat.md). ``compiled_lean``: ``hf_lowbit/qat/serving.py``'s ``prepare_for_serving`` (the file alone, loaded
by path: the process still imports no hf_lowbit), the lines docs/qat.md gives a user: every torchao weight unwrapped
to its plain inner tensors and rebuilt by one in-graph call (``Float8Tensor`` too), and ``generate``'s
``CompileConfig`` with ``triton.cudagraphs`` (what ``mode="reduce-overhead"`` sets) and Dynamo's guards on the
model's modules skipped (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``); the prefill's
``torch.compile(model)`` gets the same guard filter. Why: on the H200 (c73fbe2) the quantized models' host time per
token was AOTAutograd's wrapper around the subclass weights (removed by unwrapping) and the guard check (not).
``compiled_int4k``: ``compiled_lean`` after ``hf_lowbit.qat.int4_serving.use_int4_kernels(model, stack_siblings=False)``, which swaps
every linear with an ``Int4TilePackedTo4dTensor`` weight for ``Int4ServingLinear`` (its own ``qdata`` /
``scale_and_zero``, one copy: tinygemm for decode, ``decode="tinygemm"``, our dequantize + cuBLAS for prefill; issue 26); it imports hf_lowbit (the phase says so), so run it last.
``compiled_int4k_triton``: the same with ``decode="triton"``: our tile GEMV decodes too
(the two decode kernels side by side in one run).
``compiled_fp8k``: the same with ``hf_lowbit.qat.fp8_serving.use_fp8_kernels(model, stack_siblings=False)`` (row-wise
``Float8Tensor`` linears, one each: a decode GEMV with the activation quantized inside, ``_scaled_mm`` for prefill).
``compiled_int4k_stacked`` / ``compiled_fp8k_stacked``: those two with ``stack_siblings=True`` (both calls'
default): q/k/v and gate/up each one call over their stacked weights (``hf_lowbit/qat/siblings.py``).
``compiled_int4k_factored`` / ``compiled_int4k_mma``: ``compiled_int4k_stacked`` with ``decode="triton_factored"``
(our factored GEMV at batch 1, the tile GEMV at 2-16 rows) / ``decode="triton_mma"`` (the factored sums on tensor
cores up to 16 rows, groups of 128 and more).
On a CPU the int4 modes skip int4_tinygemm checkpoints (tinygemm's layout serves on CUDA); others swap nothing and run as
``compiled_lean``. Modes run in the order given, on one loaded model; a mode after one that changes the model
(every compiled mode but ``compiled``: ``CHANGES_MODEL``) loads it again.
``--defer_stop_check``: each decode is timed a second time, interleaved with the plain one repetition by repetition,
inside ``hf_lowbit.qat.serving.deferred_stop_check()``
(transformers' ``DeferredStopCheck``, which it enables on MPS only, on CUDA too: ``generate`` no longer waits for the
GPU after every token to read its stopping flag), on the same model and graphs, and its tokens compared.
A build or measurement that fails (a kernel missing on the image, an unsupported op, a time-out) becomes an
error row with a one-line reason; the other rows are unaffected. ``--device cpu`` with tiny shapes checks the
plumbing (``--compile_backend eager``: dynamo without Inductor); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TINYGEMM_WEIGHT = "Int4TilePackedTo4dTensor"
_INT4, _FP8 = ("hf_lowbit.qat.int4_serving", "use_int4_kernels", "int4_kernels"), ("hf_lowbit.qat.fp8_serving",
                                                                                   "use_fp8_kernels", "fp8_kernels")
# compiled_lean after one of hf_lowbit's kernel swaps: mode -> (module, function, its keyword arguments, the phase's
# key for its report)
KERNEL_MODES = {mode: (module, fn, kwargs, key) for mode, (module, fn, key), kwargs in (
    ("compiled_int4k", _INT4, {"decode": "tinygemm", "stack_siblings": False}),
    ("compiled_int4k_triton", _INT4, {"decode": "triton", "stack_siblings": False}),
    ("compiled_fp8k", _FP8, {"stack_siblings": False}),
    ("compiled_int4k_stacked", _INT4, {"decode": "tinygemm", "stack_siblings": True}),
    ("compiled_fp8k_stacked", _FP8, {"stack_siblings": True}),
    ("compiled_int4k_factored", _INT4, {"decode": "triton_factored", "stack_siblings": True}),
    ("compiled_int4k_mma", _INT4, {"decode": "triton_mma", "stack_siblings": True}))}
MODES = ("eager", "compiled", "compiled_unwrapped", "compiled_lean", *KERNEL_MODES)
# a mode after one of these loads the model again
CHANGES_MODEL = ("compiled_unwrapped", "compiled_lean", *KERNEL_MODES)
LEAN_ALIKE = ("compiled_lean", *KERNEL_MODES)  # one way of serving a bf16 model (its weights are not swapped)
SERVING_HELPERS = os.path.join(ROOT, "hf_lowbit", "qat", "serving.py")
DEFAULT_CHECKPOINTS = ("bf16,qat_int4_tinygemm,ptq_int4_tinygemm,qat_fp8_rowwise,ptq_fp8_rowwise,qat_8da4w,"
                       "qat_int4_weight_only")
ERROR_CHARS = 300


def one_line(e: BaseException | str) -> str:
    """The first line of an error, with its type: what an error row shows."""
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    lines = [s.strip() for s in str(text).strip().splitlines() if s.strip()]
    return (lines[0] if lines else "unknown error")[:ERROR_CHARS]


def checkpoint_modes(spec: str, modes: list[str]) -> tuple[str, list[str]]:
    """``"name@m1+m2"`` -> (name, [m1, m2]); ``"name"`` -> (name, modes); an unknown mode -> SystemExit."""
    name, at, own = spec.partition("@")
    if not at:
        return name, modes
    own_modes = [m for m in own.split("+") if m]
    if name == "bf16" or not own_modes or any(m not in MODES for m in own_modes):
        raise SystemExit(f"--checkpoints {spec}: after '@' give modes joined by '+' from {', '.join(MODES)} (bf16, "
                         "the reference, runs --modes)")
    return name, own_modes


def parse_checkpoint(name: str, schemes) -> tuple[str, str | None]:
    """``"bf16"`` -> ("bf16", None); ``"qat_<scheme>"`` / ``"ptq_<scheme>"`` -> (kind, scheme); else SystemExit."""
    if name == "bf16":
        return "bf16", None
    kind, _, scheme = name.partition("_")
    if kind in ("qat", "ptq") and scheme in schemes:
        return kind, scheme
    raise SystemExit(f"--checkpoints: unknown checkpoint {name!r}; use bf16, qat_<scheme> or ptq_<scheme> with a scheme "
                     f"from {', '.join(schemes)}")


# ------------------------------------------------------------------------------------------------ build workers
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def build_base(a, out_dir: str) -> dict:
    """The bf16 reference model, from a seeded config, saved in bf16 (in the parent process, which then frees it)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(a.seed)
    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                         max_position_embeddings=max(a.prefill, a.prompt + max(a.decode_tokens)),
                         tie_word_embeddings=False)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    del model
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params}


def _quantized_filter(a):
    """The linears every quantized checkpoint quantizes: all of them, the LM head only with ``--lm_head int4``."""
    from torch import nn

    return lambda m, fqn: isinstance(m, nn.Linear) and (a.lm_head == "int4" or fqn.split(".")[-1] != "lm_head")


def build_quantized(a, kind: str, scheme: str) -> dict:
    """``qat``: prepare_qat, a few steps, save_quantized. ``ptq``: torchao ``quantize_`` + ``TorchAoConfig``."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_lowbit.qat import QATConfig

    config = QATConfig(scheme, a.group_size)
    model = AutoModelForCausalLM.from_pretrained(a.base_dir, dtype=torch.bfloat16, device_map=a.device)
    info: dict = {}
    if kind == "qat":
        from hf_lowbit import save_quantized
        from hf_lowbit.qat import prepare_qat

        prepare_qat(model, config, include_lm_head=a.lm_head == "int4")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        gen = torch.Generator().manual_seed(a.seed)
        losses = []
        model.train()
        for _ in range(a.qat_steps):
            ids = torch.randint(0, a.vocab, (1, a.qat_seq), generator=gen).to(a.device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        del opt
        model.eval()
        info["qat_losses"] = losses
        save_quantized(model, a.out_dir, config)
    else:
        from torchao.quantization import quantize_
        from transformers import TorchAoConfig
        from transformers.quantizers.auto import AutoHfQuantizer

        keep = _quantized_filter(a)
        quantize_(model, config.base_config(), filter_fn=keep)
        kept = [re.escape(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not keep(m, n)]
        # the linears left in bf16, as save_quantized records them
        qconfig = TorchAoConfig(quant_type=config.base_config(), modules_to_not_convert=kept)
        model.config.quantization_config = qconfig
        model.hf_quantizer = AutoHfQuantizer.from_config(qconfig, pre_quantized=True)
        model.save_pretrained(a.out_dir, safe_serialization=True)
    info["weight_type"] = type(model.model.layers[0].mlp.up_proj.weight).__name__
    return info


# ------------------------------------------------------------------------------------------------ kernel probe
def _probe_configs():
    """torchao 0.18's serving configs for int4 / FP8 weights: (name, what its kernel needs, config factory)."""
    import torch
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8DynamicActivationInt4WeightConfig,
                                      Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig,
                                      PerGroup, PerRow, PerTensor)

    return [
        ("Int4WeightOnlyConfig(tile_packed_to_4d)", "tinygemm: aten._weight_int4pack_mm, core torch, sm_80",
         lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")),
        ("Int4WeightOnlyConfig(plain)", "mslk bf16i4bf16_rowwise (package mslk)",
         lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="plain")),
        ("Int4WeightOnlyConfig(preshuffled)", "mslk bf16i4bf16_shuffled (package mslk)",
         lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="preshuffled")),
        ("Int4WeightOnlyConfig(plain_int32)", "XPU / NPU int4pack",
         lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="plain_int32")),
        ("Float8DynamicActivationFloat8WeightConfig(PerRow)", "torch._scaled_mm row-wise (mslk if installed), sm_89",
         lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())),
        ("Float8DynamicActivationFloat8WeightConfig(PerTensor)", "torch._scaled_mm tensor-wise, sm_89",
         lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())),
        ("Float8DynamicActivationInt4WeightConfig(preshuffled)", "mslk f8i4bf16_shuffled (package mslk)",
         lambda: Float8DynamicActivationInt4WeightConfig()),
        ("Int8DynamicActivationIntxWeightConfig(int4, PerGroup(128))", "8da4w: unpacked int4-in-int8, dequantize + matmul",
         lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(128))),
        ("IntxWeightOnlyConfig(int4, PerGroup(128))", "unpacked int4-in-int8, dequantize + matmul",
         lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(128))),
    ]


def probe_kernels(a) -> list[dict]:
    """Which torchao serving configs quantize and run a bf16 linear (1024 -> 512, 16 tokens) on this machine: the
    tensor type, eager and compiled output SNR against the bf16 product, or the one-line reason it does not run."""
    import torch
    from torchao.quantization import quantize_

    torch.manual_seed(a.seed)
    x = torch.randn(16, 1024, device=a.device, dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device=a.device, dtype=torch.bfloat16) / 32
    ref = (x.double() @ w.double().T)
    rows = []
    for name, needs, make in _probe_configs():
        row = {"config": name, "needs": needs}
        try:
            linear = torch.nn.Linear(1024, 512, bias=False, device=a.device, dtype=torch.bfloat16)
            linear.weight.data.copy_(w)
            quantize_(linear, make())
            row["weight_type"] = type(linear.weight).__name__
            if row["weight_type"] in ("Parameter", "Tensor"):
                raise RuntimeError("quantize_ left the weight unquantized")
            for mode in ("eager", "compiled"):
                fn = linear if mode == "eager" else torch.compile(linear, backend=a.compile_backend)
                with torch.no_grad():
                    y = fn(x).double()
                row[f"snr_db_{mode}"] = (20 * torch.log10(ref.norm() / (y - ref).norm())).item()
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - the probe's point: which configs run here, and why not
            row.update(ok=False, error=one_line(e))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- measure worker
def _interleaved_median_ms(fns, args, device: str, reps: int) -> list[float]:
    """The median ms of each ``fn(arg)``, the calls interleaved: each repetition runs every one once, in order."""
    import torch

    times = [[] for _ in fns]
    for _ in range(reps):
        for i, (fn, arg) in enumerate(zip(fns, args)):
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(arg)
            _sync(device)
            times[i].append(1000 * (time.perf_counter() - t0))
    return [sorted(t)[len(t) // 2] for t in times]


def _median_ms(fn, device: str, reps: int) -> float:
    return _interleaved_median_ms([lambda _: fn()], [None], device, reps)[0]


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _profiled(fn, device: str, top: int = 8) -> dict:
    """One call of ``fn`` under ``torch.profiler``: its wall ms (profiler overhead included), the GPU's kernel ms,
    and how many host syncs, CUDA-graph replays and kernel launches it made; every CUDA kernel's ms and calls
    (``kernels``, name -> (ms, calls)) and the ``top`` by ms (``top_kernels``); the host side: every CPU op's self
    time and calls (``host_ops``, name -> (ms, calls)) and their sum (``host_self_ms``)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.driver import _CUDA_SYNCS  # the CUDA runtime calls in which the host waits (no hf_lowbit import)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof, torch.no_grad():
        t = time.perf_counter()
        fn()
        _sync(device)
        wall = 1000 * (time.perf_counter() - t)
    events = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)]
    kernels: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:  # names cut alike: their sum
            ms, calls = kernels.get(e.key[:120], (0.0, 0))
            kernels[e.key[:120]] = (ms + e.self_device_time_total / 1000, calls + e.count)
    count = lambda keys: sum(e.count for e in events if e.key in keys)  # noqa: E731
    host = {e.key[:120]: (e.self_cpu_time_total / 1000, e.count) for e in events
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0}
    return {"wall_ms": wall, "device_ms": sum(ms for ms, _ in kernels.values()), "syncs": count(_CUDA_SYNCS),
            "graph_replays": count(("cudaGraphLaunch",)), "kernel_launches": count(_LAUNCHES),
            "top_kernels": [{"name": n, "ms": ms, "calls": c}
                            for n, (ms, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
            "kernels": kernels, "host_self_ms": sum(ms for ms, _ in host.values()), "host_ops": host}


def per_token(long: dict, short: dict, n: int, top: int) -> list[dict]:
    """(``long`` - ``short``) / ``n`` of each name's (ms, calls) in two calls' ``{name: (ms, calls)}``, the ``top`` by
    ms: what a decoded token adds, the prompt's prefill and each call's fixed work cancelling (a name absent from a
    call counts 0 there)."""
    diff = {k: tuple((long.get(k, (0.0, 0))[i] - short.get(k, (0.0, 0))[i]) / n for i in (0, 1))
            for k in {**long, **short}}
    return [{"name": k, "ms": ms, "calls": c} for k, (ms, c) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:top]]


def decode_profile(run, t1: int, t2: int, device: str) -> dict:
    """Where a decoded token's time goes: ``run(t1)`` and ``run(t2)`` profiled, their difference per token (the
    prompt's prefill and each call's fixed work cancel, as in the timed rate). ``busy``: the GPU's share of the
    wall time; far below 1, the host (``generate``'s per-token Python, its syncs, launches) is the bound.
    ``top_kernels_per_token``: each CUDA kernel's ms and calls per token (top 24), the kernels a decoded token adds,
    to set a quantized decode beside bf16's (``top_kernels``: the long call's totals, its prefill included);
    ``top_host_ops_per_token``: the same for the CPU ops' self time (top 12)."""
    short, long = _profiled(lambda: run(t1), device), _profiled(lambda: run(t2), device)
    n = t2 - t1
    per = {f"{k}_per_token": (long[k] - short[k]) / n
           for k in ("wall_ms", "device_ms", "syncs", "graph_replays", "kernel_launches", "host_self_ms")}
    wall = per["wall_ms_per_token"]
    per["busy"] = per["device_ms_per_token"] / wall if device == "cuda" and wall > 0 else None  # CPU: no GPU timeline
    # the host's side of a token: what the quantized models' host does between CUDA-graph replays that bf16's does not
    return {**per, "top_kernels": long["top_kernels"],
            "top_kernels_per_token": per_token(long["kernels"], short["kernels"], n, 24),
            "top_host_ops_per_token": per_token(long["host_ops"], short["host_ops"], n, 12)}


def measure(a, emit) -> dict:
    """Load ``a.ckpt_dir`` with plain transformers and time it in each mode; ``emit(row)`` after every phase."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, CompileConfig

    device = a.device
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.ckpt_dir, device_map=device)
    _sync(device)
    row: dict = {"load_s": time.perf_counter() - t0}
    if "hf_lowbit" in sys.modules:  # what a user without hf_lowbit gets, or the figure means nothing
        raise RuntimeError("the measured process imported hf_lowbit")
    row["weight_type"] = type(model.model.layers[0].mlp.up_proj.weight).__name__
    row["lm_head_type"] = type(model.lm_head.weight).__name__
    if device == "cuda":
        row["weights_gib"] = torch.cuda.memory_allocated() / 2**30
        row["load_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    emit(row)
    gen = torch.Generator().manual_seed(a.seed)
    prefill_ids = torch.randint(0, a.vocab, (1, a.prefill), generator=gen).to(device)
    prompts = {b: torch.randint(0, a.vocab, (b, a.prompt), generator=gen).to(device) for b in a.batches}
    t1, t2 = a.decode_tokens
    changed = False  # by an earlier mode: unwrapped weights
    for mode in a.modes:
        phase: dict = {}
        row[mode] = phase
        try:
            if changed:
                del model
                if device == "cuda":
                    torch.cuda.empty_cache()
                model = AutoModelForCausalLM.from_pretrained(a.ckpt_dir, device_map=device)
                phase["reloaded"] = True
            changed = mode in CHANGES_MODEL
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            counters.clear()
            if mode.startswith("compiled_int4k") and row["weight_type"] == TINYGEMM_WEIGHT and device != "cuda":
                phase["skipped"] = f"{TINYGEMM_WEIGHT} on {device}: tinygemm's layout serves on CUDA"
                emit(row)
                continue
            if mode == "eager":
                forward, gen_kw = model, {"disable_compile": True}
            else:
                compile_kw = {}
                if mode == "compiled_unwrapped":
                    from torchao.utils import unwrap_tensor_subclass

                    model.requires_grad_(False)  # the int8/uint8 inner tensors cannot be parameters that need grad
                    unwrap_tensor_subclass(model)
                if mode in KERNEL_MODES:  # hf_lowbit's int4 / FP8 kernels, then what compiled_lean does
                    import importlib

                    module, fn, kw, key = KERNEL_MODES[mode]
                    phase["imports_hf_lowbit"] = True
                    if kw:
                        phase["kernel_kwargs"] = kw
                    from hf_lowbit.qat.siblings import SiblingGroup

                    report = getattr(importlib.import_module(module), fn)(model, **kw)
                    phase[key] = {
                        "swapped": len(report.swapped),  # the siblings served stacked, counted in the model itself
                        "stacked": sum(len(g.names) for g in model.modules() if isinstance(g, SiblingGroup)),
                        "not_stacked": sorted({e.reason for e in report.swapped if "not stacked" in e.reason}),
                        "skipped": dict(collections.Counter(e.reason for e in report.skipped))}
                if mode in ("compiled_lean", *KERNEL_MODES):
                    serving = _serving_helpers()
                    compile_config = serving.serving_compile_config(a.compile_backend,
                                                                    cudagraphs=a.compile_backend == "inductor")
                    compile_kw = {"options": {"guard_filter_fn": serving.guard_filter()}}
                    # the weights unwrapped, by tensor type
                    phase["unwrapped"] = dict(collections.Counter(serving.unwrap_quantized_weights(model).values()))
                else:
                    compile_config = CompileConfig(backend=a.compile_backend,
                                                   mode="reduce-overhead" if a.compile_backend == "inductor" else None)
                if mode != "compiled":
                    # what Dynamo sees as the model's inputs now (the weights read the same as before)
                    phase["parameter_types"] = sorted({type(t).__name__ for t in model.parameters()})
                # the prefill: static shape, whole model
                forward = torch.compile(model, backend=a.compile_backend, **compile_kw)
                compile_config._compile_all_devices = device != "cuda"  # CPU smoke runs only
                gen_kw = {"cache_implementation": "static", "compile_config": compile_config}
            t = time.perf_counter()
            with torch.no_grad():
                forward(prefill_ids, logits_to_keep=1, use_cache=False)  # warm-up (compiles)
            phase["prefill_warmup_s"] = time.perf_counter() - t
            phase["prefill_ms"] = _median_ms(lambda: forward(prefill_ids, logits_to_keep=1, use_cache=False),
                                             device, a.reps)
            if a.profile:
                pre = _profiled(lambda: forward(prefill_ids, logits_to_keep=1, use_cache=False), device)
                del pre["host_ops"], pre["kernels"]  # every op and kernel: the decode profile keeps the top per token
                phase["prefill_profile"] = pre
            emit(row)
            for b, ids in prompts.items():
                def run(n, ids=ids, model=model, gen_kw=gen_kw):
                    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                          **gen_kw)
                t = time.perf_counter()
                with torch.no_grad():
                    out = run(t2)  # warm-up at the longest length (a static cache keeps the largest shape)
                    run(t1)
                phase[f"decode_warmup_s_b{b}"] = time.perf_counter() - t
                if out.shape != (b, a.prompt + t2):
                    raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {(b, a.prompt + t2)}")
                # each length timed plainly and (--defer_stop_check) with generate's stop check deferred on the same
                # model, graphs and lengths, the kinds interleaved repetition by repetition
                defer = _serving_helpers().deferred_stop_check if a.defer_stop_check else None
                kinds = {"": run} | ({"_deferred": functools.partial(_deferred, run, defer)} if defer else {})
                medians = _interleaved_median_ms([fn for fn in kinds.values() for _ in (t1, t2)],
                                                 [n for _ in kinds for n in (t1, t2)], device, a.reps)
                for i, suffix in enumerate(kinds):
                    short, long = medians[2 * i], medians[2 * i + 1]
                    phase[f"decode_ms_b{b}{suffix}"] = [short, long]
                    if long > short:  # else the timing resolved nothing (only on a noisy CPU): no rate
                        phase[f"decode_tok_s_b{b}{suffix}"] = b * (t2 - t1) / (long - short) * 1000
                if a.profile:
                    phase[f"decode_profile_b{b}"] = decode_profile(run, t1, t2, device)
                if defer:
                    with torch.no_grad():
                        again = run(t2)
                        with defer():
                            deferred = run(t2)
                    # greedy decoding of a random model: near-ties can flip between runs of the same path, so the
                    # plain path is compared with its own warm-up too (new tokens: the share that agree)
                    phase[f"plain_repeat_agree_b{b}"] = (again == out)[:, a.prompt:].float().mean().item()
                    phase[f"deferred_agree_b{b}"] = (deferred == again)[:, a.prompt:].float().mean().item()
                    phase[f"deferred_same_tokens_b{b}"] = torch.equal(deferred, again)
                emit(row)
            if device == "cuda":
                phase["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            # compiled graphs Inductor could not run as CUDA graphs (reduce-overhead falls back to launching them)
            phase["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
            if mode != "eager":  # the guards Dynamo checks before a call, per compiled graph (prefill, decode b1, b8)
                from benchmarks.serve_host_calls import compiled_guards

                phase["guards"] = sorted(sum(c.values()) for c in compiled_guards())
        except Exception as e:  # noqa: BLE001 - a row records why a mode failed; the others still run
            phase["error"] = one_line(e)
        emit(row)
        torch._dynamo.reset()
    return row


def _deferred(run, defer, n: int):
    with defer():
        return run(n)


@functools.cache
def _serving_helpers():
    """``hf_lowbit/qat/serving.py`` loaded from its file (it imports only torch and transformers): the measured
    process imports no hf_lowbit, as a user serving the export with these lines copied would not."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_lowbit_serving", SERVING_HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------- the run
def _run(cmd: list[str], timeout: int) -> tuple[dict | None, str | None]:
    """A worker's last ``RESULT {json}`` line (also when it timed out or crashed after printing some), and the
    one-line reason it failed, if it did."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, err, failed = proc.stdout, proc.stderr, proc.returncode != 0
        reason = one_line(next((s for s in reversed(err.splitlines()) if s.strip()), f"exit status {proc.returncode}"))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failed, reason = True, f"timed out after {timeout} s"
    results = [s for s in out.splitlines() if s.startswith("RESULT ")]
    return (json.loads(results[-1][len("RESULT "):]) if results else None), (reason if failed else None)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))


def add_ratios(rows: list[dict], modes) -> None:
    """Each row's ratios to the bf16 row of its own run, mode by mode (speed: >1 is faster)."""
    for r in rows:
        base = next((x for x in rows if x["checkpoint"] == "bf16" and x.get("run") == r.get("run")), None)
        if base is None or "error" in r or "error" in base:
            continue
        r["size_vs_bf16"] = r["safetensors_bytes"] / base["safetensors_bytes"]
        for mode in modes:
            p, q = r.get(mode) or {}, base.get(mode) or {}
            if p and not q and mode in LEAN_ALIKE:  # bf16 swaps nothing in the kernel modes: the same serving
                alike = next((m for m in LEAN_ALIKE if "prefill_ms" in (base.get(m) or {})), None)
                if alike is not None:
                    q, p["bf16_mode"] = base[alike], alike
            if "prefill_ms" in p and "prefill_ms" in q:
                p["prefill_vs_bf16"] = q["prefill_ms"] / p["prefill_ms"]
            for k in [k for k in p if k.startswith("decode_tok_s_b")]:
                if k in q:
                    p[k.replace("decode_tok_s", "decode_vs_bf16")] = p[k] / q[k]


def table(rows: list[dict], modes, batches) -> list[str]:
    head = ["checkpoint", "weight type", "GB", "size vs bf16", "load s"]
    for mode in modes:
        head += [f"{mode} prefill ms", "vs bf16"] + [x for b in batches for x in (f"{mode} decode b{b} tok/s", "vs bf16")]
        head += [f"{mode} peak GiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['checkpoint']} | error ({r.get('stage', '?')}): {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = [r["checkpoint"], r.get("weight_type", "?"), f"{r['safetensors_bytes'] / 1e9:.2f}",
                 f"{r.get('size_vs_bf16', float('nan')):.2f}x", f"{r.get('load_s', float('nan')):.1f}"]
        for mode in modes:
            p = r.get(mode)
            if not p:
                cells += ["–"] * (3 + 2 * len(batches))
                continue
            if "error" in p and "prefill_ms" not in p:
                cells += [f"error: {p['error'][:120]}"] + [""] * (2 + 2 * len(batches))
                continue
            if "skipped" in p:
                cells += [f"skipped: {p['skipped'][:120]}"] + [""] * (2 + 2 * len(batches))
                continue
            cells += [f"{p['prefill_ms']:.1f}", f"{p.get('prefill_vs_bf16', float('nan')):.2f}x"]
            for b in batches:
                v = p.get(f"decode_tok_s_b{b}")
                cells += ([f"{v:.0f}", f"{p.get(f'decode_vs_bf16_b{b}', float('nan')):.2f}x"] if v is not None
                          else [f"error: {p.get('error', '?')[:80]}", ""])
            cells.append(f"{p['peak_gib']:.1f}" if "peak_gib" in p else "–")
        out.append("| " + " | ".join(cells) + " |")
    return out


def deferred_table(rows: list[dict], modes, batches) -> list[str]:
    """``--defer_stop_check``: each decode timed both ways, one line per checkpoint, mode and batch (none
    without it)."""
    head = ["checkpoint", "mode", "batch", "decode tok/s", "vs bf16", "stop check deferred: tok/s", "vs bf16",
            "deferred / not", "new tokens equal: deferred vs plain", "plain vs its warm-up"]
    out = []
    for r in rows:
        for mode in modes:
            p = r.get(mode) or {}
            for b in batches:
                d, n = p.get(f"decode_tok_s_b{b}_deferred"), p.get(f"decode_tok_s_b{b}")
                if d is None:
                    continue
                ratio = [f"{p[k]:.2f}x" if k in p else "–" for k in (f"decode_vs_bf16_b{b}",
                                                                     f"decode_vs_bf16_b{b}_deferred")]
                agree = [f"{p[k]:.1%}" if k in p else "–"
                         for k in (f"deferred_agree_b{b}", f"plain_repeat_agree_b{b}")]
                if f"deferred_agree_b{b}" not in p and f"deferred_same_tokens_b{b}" in p:  # records before 544c11d
                    agree[0] = "all (vs warm-up)" if p[f"deferred_same_tokens_b{b}"] else "not all (vs warm-up)"
                plain = ("–", "–") if n is None else (f"{n:.0f}", f"{d / n:.2f}x")  # no plain rate: it resolved none
                out.append(f"| {r['checkpoint']} | {mode} | {b} | {plain[0]} | {ratio[0]} | {d:.0f} | {ratio[1]} | "
                           f"{plain[1]} | {agree[0]} | {agree[1]} |")
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *out] if out else []


def profile_table(rows: list[dict], modes, batches) -> list[str]:
    """The ``--profile`` figures, one line per checkpoint, mode and decode batch (none without them)."""
    head = ["checkpoint", "mode", "prefill GPU ms (wall ms, profiled)", "batch", "decode wall ms/token (profiled)",
            "GPU ms/token", "GPU busy", "host syncs/token", "CUDA-graph replays/token", "kernel launches/token",
            "cudagraph skips", "host ops' self ms/token", "top host ops/token (self ms, calls)"]
    out = []
    for r in rows:
        for mode in modes:
            p = r.get(mode) or {}
            pre = p.get("prefill_profile")
            for b in batches:
                d = p.get(f"decode_profile_b{b}")
                if not (pre or d):
                    continue
                cells = [r["checkpoint"], mode, f"{pre['device_ms']:.1f} ({pre['wall_ms']:.1f})" if pre else "–", str(b)]
                cells += ([f"{d['wall_ms_per_token']:.2f}", f"{d['device_ms_per_token']:.2f}",
                           f"{d['busy']:.0%}" if d.get("busy") is not None else "–", f"{d['syncs_per_token']:.1f}",
                           f"{d['graph_replays_per_token']:.1f}", f"{d['kernel_launches_per_token']:.1f}"]
                          if d else ["–"] * 6)
                cells.append(str(p.get("cudagraph_skips", "–")))
                host = (d or {}).get("top_host_ops_per_token")  # absent from records written before it was
                cells += ([f"{d['host_self_ms_per_token']:.2f}", "; ".join(
                    f"{o['name'][:40]} {o['ms']:.3f} ({o['calls']:.1f})" for o in host[:3])] if host else ["–", "–"])
                out.append("| " + " | ".join(cells) + " |")
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *out] if out else []


def kernel_table(rows: list[dict], modes, batches, top: int = 12) -> list[str]:
    """The ``top`` kernels of each profiled decode per token (``top_kernels_per_token``; none in records written
    before it was, nor on a CPU), one line each."""
    out = []
    for r in rows:
        for mode in modes:
            for b in batches:
                d = (r.get(mode) or {}).get(f"decode_profile_b{b}") or {}
                out += [f"| {r['checkpoint']} | {mode} | {b} | {k['ms']:.4f} | {k['calls']:.2f} | "
                        f"{k['name'][:80].replace('|', '/')} |" for k in d.get("top_kernels_per_token", [])[:top]]
    head = ["checkpoint", "mode", "batch", "GPU ms/token", "calls/token", "kernel"]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *out] if out else []


def plot(rows: list[dict], modes, batches, path: str, title: str) -> None:
    """Bars: prefill and decode speed vs bf16 per checkpoint, one panel per mode, and size vs bf16."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r and r["checkpoint"] != "bf16"]
    names = list(dict.fromkeys(r["checkpoint"] for r in good))
    metrics = [("prefill_vs_bf16", "prefill")] + [(f"decode_vs_bf16_b{b}", f"decode b{b}") for b in batches]
    metrics += [(f"decode_vs_bf16_b{b}_deferred", f"decode b{b}, stop check deferred") for b in batches
                if any(f"decode_vs_bf16_b{b}_deferred" in (r.get(m) or {}) for r in good for m in modes)]
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5 * (len(modes) + 1), 4), squeeze=False)
    width = 0.8 / len(metrics)
    for ax, mode in zip(axes[0], modes):
        for j, (key, label) in enumerate(metrics):
            vals = [next((r[mode].get(key, 0) for r in good if r["checkpoint"] == n and r.get(mode)), 0) for n in names]
            bars = ax.bar([i + j * width for i in range(len(names))], vals, width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(metrics) - 1) / 2 for i in range(len(names))], names, rotation=30, fontsize=7,
                      ha="right")
        ax.set_title(f"{mode}: speed vs bf16", fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    sizes = [next(r.get("size_vs_bf16", 0) for r in good if r["checkpoint"] == n) for n in names]
    bars = ax.bar(range(len(names)), sizes)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7, ha="right")
    ax.set_title("safetensors size vs bf16", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(data: dict, a) -> None:
    from benchmarks.driver import write_results

    rows, meta = data["rows"], data["meta"]
    modes = list(dict.fromkeys(m for r in rows for m in MODES if r.get(m)))
    add_ratios(rows, modes)
    c = meta["config"]
    header = (f"{meta.get('gpu')}, torch {meta.get('torch')}, transformers {meta.get('transformers')}, torchao "
              f"{meta.get('torchao')}: {c['layers']} Llama-8B-shaped layers (h{c['hidden']}), prefill 1x{c['prefill']}, "
              f"decode {c['decode_tokens']} new tokens after a {c['prompt']}-token prompt, LM head {c['lm_head']}")
    lines = table(rows, modes, c["batches"]) if rows else []
    alike = sorted({f"{r['checkpoint']} in {m} (bf16's {r[m]['bf16_mode']})" for r in rows for m in modes
                    if isinstance(r.get(m), dict) and "bf16_mode" in r[m]})
    if alike:
        lines += ["", "Ratios against bf16 in another mode of the same serving (the kernel modes swap nothing of a "
                  "bf16 model; `--checkpoints NAME@MODE`): " + "; ".join(alike) + "."]
    deferred = deferred_table(rows, modes, c["batches"])
    if deferred:
        lines += ["", "Decode with generate's stop check deferred (`--defer_stop_check`: transformers' "
                  "DeferredStopCheck on CUDA, hf_lowbit.qat.serving.deferred_stop_check; the same model, compiled "
                  "graphs and lengths as the column before; the share of new tokens equal between a deferred and a "
                  "plain run, and between two plain runs (greedy decoding of a random model: near-ties can flip)):",
                  "", *deferred]
    profiled = profile_table(rows, modes, c["batches"])
    if profiled:
        lines += ["", "Profiled (`--profile`, one call each under `torch.profiler`; per decoded token: the difference "
                  "of the two generate lengths; GPU busy = GPU ms / wall ms; cudagraph skips: compiled graphs that "
                  "ran without CUDA graphs):", "", *profiled]
    kernels = kernel_table(rows, modes, c["batches"])
    if kernels:
        lines += ["", "Kernels per decoded token (`--profile`: each kernel's GPU ms and calls in the long generate "
                  "call less the short one's, per token; the top 12):", "", *kernels]
    if data.get("probe"):
        lines += ["", "torchao serving configs on this machine (one bf16 linear 1024 -> 512, 16 tokens; SNR vs the exact "
                  "product):", "", "| config | its kernel | runs | weight type | SNR dB eager | SNR dB compiled |",
                  "|---|---|---|---|---|---|"]
        for r in data["probe"]:
            ran = "yes" if r.get("ok") else f"no: {r.get('error', '?')}"
            snr = [f"{r[k]:.1f}" if k in r else "–" for k in ("snr_db_eager", "snr_db_compiled")]
            lines.append(f"| {r['config']} | {r.get('needs', '')} | {ran} | {r.get('weight_type', '–')} | "
                         + " | ".join(snr) + " |")
    write_results(data, lines, header, a.json, a.markdown)
    if a.plot:
        plot(rows, modes, c["batches"], a.plot, header[:160])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 4096), ("intermediate", 14336), ("heads", 32), ("kv_heads", 8), ("vocab", 32000),
                          ("layers", 8), ("prefill", 2048), ("prompt", 128), ("group_size", 128), ("qat_steps", 2),
                          ("qat_seq", 256), ("reps", 3), ("seed", 0), ("timeout", 300)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--decode_tokens", default="16,80", help="T1,T2: new tokens of the two timed generate lengths")
    p.add_argument("--batches", default="1,8", help="decode batch sizes")
    p.add_argument("--checkpoints", default=DEFAULT_CHECKPOINTS,
                   help="comma-separated qat_<scheme> and ptq_<scheme>; bf16 (the reference) is always measured first")
    p.add_argument("--modes", default="eager,compiled", help=f"any of {', '.join(MODES)}, in the order given")
    p.add_argument("--lm_head", choices=("int4", "bf16"), default="int4",
                   help="quantized checkpoints also quantize the LM head (int4: in the scheme's format) or keep it bf16")
    p.add_argument("--compile_backend", default="inductor", help="torch.compile backend (eager: CPU smoke runs)")
    p.add_argument("--defer_stop_check", action="store_true",
                   help="also time each decode with generate's stop check deferred (transformers' DeferredStopCheck, "
                        "on for CUDA by hf_lowbit.qat.serving.deferred_stop_check): the host prepares the next token "
                        "while the GPU computes this one; same model, graphs and lengths; the tokens compared")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill and the decode (two generate lengths) in each mode: GPU ms, host "
                        "syncs, CUDA-graph replays and kernel launches per decoded token, the top kernels (and "
                        "per decoded token)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: each is deleted once measured)")
    p.add_argument("--merge", nargs="+", default=None, help="join the JSON of several runs (ratios stay per run)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG (needs matplotlib)")
    p.add_argument("--probe", action="store_true",
                   help="first, which of torchao's int4/FP8 serving configs run on this machine (one small linear each)")
    p.add_argument("--probe_only", action="store_true", help="the probe alone (no model, no checkpoints)")
    p.add_argument("--worker", choices=("build", "measure", "probe"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    p.add_argument("--scheme", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt_dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        a.decode_tokens = [int(x) for x in a.decode_tokens.split(",")]
        a.batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        raise SystemExit("--decode_tokens and --batches take comma-separated integers, e.g. 16,80 and 1,8") from None
    if len(a.decode_tokens) != 2 or not 0 < a.decode_tokens[0] < a.decode_tokens[1]:
        raise SystemExit(f"--decode_tokens {a.decode_tokens}: give two lengths T1 < T2 (the rate is their difference "
                         "over the time difference)")
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or any(m not in MODES for m in a.modes):
        raise SystemExit(f"--modes {','.join(a.modes)}: choose from {', '.join(MODES)}")
    sys.path.insert(0, ROOT)
    if a.worker:  # one build or measurement, in its own process
        def emit(row):
            print("RESULT " + json.dumps(row), flush=True)

        if a.worker == "measure":
            measure(a, emit)
        elif a.worker == "probe":
            emit({"probe": probe_kernels(a)})
        else:
            try:
                emit(build_quantized(a, a.kind, a.scheme))
            except Exception as e:  # noqa: BLE001 - one line for the error row (a missing kernel, no GPU, ...)
                emit({"error": one_line(e)})
        return
    if a.merge:
        data = {"meta": None, "rows": [], "probe": None}
        for i, path in enumerate(a.merge):
            if not os.path.exists(path):  # a call that did not run (or ran out of time before writing)
                print(f"--merge: {path} does not exist; merging the others", flush=True)
                continue
            with open(path) as f:
                part = json.load(f)
            data["meta"] = data["meta"] or {**part["meta"], "merged": []}
            data["meta"]["merged"].append({"file": os.path.basename(path), "command": part["meta"].get("command")})
            data["rows"] += [{**r, "run": f"{i}:{r.get('run', 0)}"} for r in part["rows"]]
            data["probe"] = data["probe"] or part.get("probe")
        if data["meta"] is None:
            raise SystemExit(f"--merge: none of {' '.join(a.merge)} exists")
        write(data, a)
        return
    run(a)


def run(a) -> None:
    import torch
    import transformers

    from benchmarks.driver import meta as run_meta
    from benchmarks.driver import torchao_version
    from hf_lowbit.qat import QAT_SCHEMES

    named = [checkpoint_modes(c, a.modes) for c in a.checkpoints.split(",") if c and c != "bf16"]
    named.insert(0, ("bf16", a.modes))  # the reference of every ratio: always measured, first
    specs = [(n, *parse_checkpoint(n, QAT_SCHEMES), modes) for n, modes in named]
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_serve.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    meta = run_meta(a.device if a.device == "cuda" else (platform.processor() or "cpu"),
                    transformers=transformers.__version__, torchao=torchao_version(),
                    config={k: getattr(a, k) for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "layers",
                                                       "prefill", "prompt", "decode_tokens", "batches", "group_size",
                                                       "qat_steps", "qat_seq", "reps", "lm_head", "compile_backend",
                                                       "modes", "profile", "defer_stop_check")},
                    checkpoint_modes={n: modes for n, modes in named if modes != a.modes})
    common = [sys.executable, os.path.abspath(__file__), "--device", a.device, "--seed", str(a.seed)]
    for k in ("hidden", "intermediate", "heads", "kv_heads", "vocab", "layers", "prefill", "prompt", "group_size",
              "qat_steps", "qat_seq", "reps"):
        common += [f"--{k}", str(getattr(a, k))]
    common += ["--decode_tokens", ",".join(map(str, a.decode_tokens)), "--batches", ",".join(map(str, a.batches)),
               "--lm_head", a.lm_head, "--compile_backend", a.compile_backend]
    common += ["--profile"] if a.profile else []
    common += ["--defer_stop_check"] if a.defer_stop_check else []
    data = {"meta": meta, "rows": []}
    if a.probe or a.probe_only:
        got, err = _run(common + ["--modes", ",".join(a.modes), "--worker", "probe"], a.timeout)
        data["probe"] = (got or {}).get("probe") or [{"config": "all", "ok": False, "error": err}]
        print(json.dumps(data["probe"]), flush=True)
        if a.probe_only:
            write(data, a)
            return
    # a device call's `timeout` sends SIGTERM: exit through the finally below (the running worker is killed by
    # subprocess.run, the checkpoints removed); the JSON already holds every finished row
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workdir = a.workdir or tempfile.mkdtemp(prefix="serve-")
    os.makedirs(workdir, exist_ok=True)
    base_dir = os.path.join(workdir, "bf16")
    try:
        t = time.perf_counter()
        meta["params"] = build_base(a, base_dir)["params"]
        print(f"bf16 model built in {time.perf_counter() - t:.0f} s ({meta['params'] / 1e9:.2f}B parameters)", flush=True)
        for name, kind, scheme, modes in specs:
            row: dict = {"checkpoint": name, "kind": kind, "scheme": scheme, "run": 0}
            data["rows"].append(row)
            path = base_dir if kind == "bf16" else os.path.join(workdir, name)
            if kind != "bf16":
                t = time.perf_counter()
                built, err = _run(common + ["--worker", "build", "--kind", kind, "--scheme", scheme, "--base_dir",
                                            base_dir, "--out_dir", path], a.timeout)
                row["build_s"] = time.perf_counter() - t
                if built and "error" not in built:
                    row["build"] = built
                else:
                    row.update(stage="build", error=(built or {}).get("error") or err)
            if "error" not in row:
                row["safetensors_bytes"] = _bytes(path)
                got, err = _run(common + ["--modes", ",".join(modes), "--worker", "measure", "--ckpt_dir", path],
                                a.timeout)
                row.update(got or {})
                if err:
                    # a crash or time-out: what it measured before stays; the mode it was in says why it stopped
                    mode = next((m for m in reversed(modes) if isinstance(row.get(m), dict)), None)
                    if mode is None:
                        row.update(stage="measure", error=err)
                    else:
                        row[mode].setdefault("error", err)
            if kind != "bf16" and not a.keep:
                shutil.rmtree(path, ignore_errors=True)
            print(json.dumps(row), flush=True)
            write(data, a)
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
