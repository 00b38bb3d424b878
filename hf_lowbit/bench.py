"""Helpers shared by the benchmark scripts in ``scripts/``: timing and writing results."""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import torch


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


def write_results(data: dict, table: list[str], header: str, json_path: str | None = None,
                  markdown_path: str | None = None) -> None:
    """Print the markdown ``table``; write ``data`` as JSON and ``header`` + table as markdown if asked."""
    print("\n".join(table))
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
    if markdown_path:
        os.makedirs(os.path.dirname(markdown_path) or ".", exist_ok=True)
        with open(markdown_path, "w") as f:
            f.write(header + "\n\n" + "\n".join(table) + "\n")
