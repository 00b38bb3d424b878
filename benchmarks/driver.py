"""Helpers shared by the benchmark scripts in ``benchmarks/``: timing, worker processes, writing results,
kernel profiles, and FSDP2 in CPU processes for the CPU checks."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Callable

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The commit the measured code is at: ``HF_LOWBIT_COMMIT`` if set (a copy without ``.git``, e.g. on a lent
    GPU machine: export it before the run), else ``git rev-parse --short HEAD`` plus ``+dirty`` when tracked
    files differ from it, else ``"unknown"``."""
    if os.environ.get("HF_LOWBIT_COMMIT"):
        return os.environ["HF_LOWBIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def median_ms(fn: Callable[[], object], device: str = "cuda", reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def graph_ms(fn: Callable[[], object], reps: int = 10, inner: int = 10) -> float:
    """Median milliseconds of one ``fn()`` on the GPU alone: ``inner`` calls captured in one CUDA graph (after a
    warm-up call, which autotunes), replayed ``reps`` times. Kernels of ~0.1 ms are shorter than a Python launch,
    so timing calls with events around them (:func:`median_ms`) measured the host as much as the kernel."""
    side = torch.cuda.Stream()  # warm up (autotune, compile) on a side stream, as CUDA-graph capture recommends
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]


def run_worker(cmd: list[str], label: dict, timeout: int, env: dict | None = None) -> dict:
    """Run one benchmark worker process (``env``: extra environment variables); its last
    ``RESULT {json}`` line, or ``label`` + an ``error``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {**label, "error": f"timed out after {timeout} s"}
    out = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if out:
        return json.loads(out[-1][len("RESULT "):])
    # under torchrun the ranks' own tracebacks are the "[rankN]:" lines, before the launcher's
    ranks = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    return {**label, "error": ("\n".join(ranks) if ranks else proc.stderr)[-1500:]}


def allow_fsdp_on_cpu() -> None:
    """Let accelerate run FSDP in CPU processes (gloo), for CPU tests of the distributed code paths.

    accelerate 1.15 turns FSDP on only for accelerator devices: in CPU processes (``ACCELERATE_USE_CPU``)
    ``AcceleratorState`` keeps ``MULTI_CPU`` and the model would silently get DDP. torch's ``fully_shard``
    works on a CPU device mesh, so this makes the state take the FSDP plugin the launcher configured,
    as it does on GPUs. Call it before creating the ``Accelerator`` / ``Trainer``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_hf_lowbit_cpu_fsdp", False):
        return

    def init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self.mixed_precision)
            # what AcceleratorState does for GPU processes (it keeps PartialState in step the same way)
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    init_with_cpu_fsdp._hf_lowbit_cpu_fsdp = True
    AcceleratorState.__init__ = init_with_cpu_fsdp


def write_results(data: dict, table: list[str], header: str, json_path: str | None = None,
                  markdown_path: str | None = None) -> None:
    """Print the markdown ``table``; write ``data`` as JSON and ``header`` + table as markdown if asked.

    ``data["meta"]["commit"]`` records the commit measured (:func:`git_commit`, unless the script set it); the
    markdown header names it too."""
    meta = data.setdefault("meta", {})
    meta.setdefault("commit", git_commit())
    header = f"{header}, commit {meta['commit']}"
    print("\n".join(table))
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
    if markdown_path:
        os.makedirs(os.path.dirname(markdown_path) or ".", exist_ok=True)
        with open(markdown_path, "w") as f:
            f.write(header + "\n\n" + "\n".join(table) + "\n")


# Kernel-name patterns -> category, first match wins (CUDA kernel names as the profiler records them;
# Inductor's generated kernels all start with "triton_", cuBLAS FP8 GEMMs carry "qq" in nvjet names).
_CATEGORIES = (
    ("int8 matmul (ours, Triton)", ("_int8_scaled_mm_kernel",)),
    ("quantize_t (ours, Triton)", ("_col_amax_kernel", "_quantize_t_kernel")),
    ("nf4 -> int8 (ours, Triton)", ("_nf4_to_int8_kernel",)),
    ("nf4 dequantize (bitsandbytes)", ("kdequantize",)),
    ("Inductor fused: norms, activations, quantize", ("triton_",)),
    ("attention (flash / cuDNN SDPA)", ("flash", "fmha", "sdpa", "attention")),
    ("fp8 matmul (cuBLAS)", ("_qqtst_", "qqtst", "f8f8", "e4m3", "fp8")),
    ("bf16 matmul (cuBLAS)", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("cross entropy / softmax", ("softmax", "nll", "cross_entropy")),
)


def kernel_profile(fn: Callable[[], object], steps: int = 2, top: int = 25) -> dict:
    """Profile ``steps`` calls of ``fn`` on CUDA: device ms per step by category and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1000 / steps, e.count // steps)
               for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    categories: dict[str, float] = {}
    for name, ms, _ in kernels:
        low = name.lower()
        cat = next((c for c, pats in _CATEGORIES if any(p in low for p in pats)), "other")
        categories[cat] = categories.get(cat, 0.0) + ms
    kernels.sort(key=lambda k: -k[1])
    return {"device_ms_per_step": sum(categories.values()),
            "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "ms": ms, "calls": c} for n, ms, c in kernels[:top]]}
