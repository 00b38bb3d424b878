#!/usr/bin/env python
"""Compile one mixed-precision linear forward + backward per format and cache setting; print every graph break.

    python tools/graph_breaks.py            # on the GPU: the path training takes there

A graph break here means part of the layer runs eagerly in training (each break's reason is printed, with
the user frame), which the benchmarks only show as a count.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_lowbit import MixedPrecisionConfig  # noqa: E402
from hf_lowbit.mixed_precision import MixedPrecisionLinear  # noqa: E402


def main():
    from torch._dynamo.utils import counters

    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failed = False
    for fmt in ("int8", "fp8"):
        for cache in (False, True):
            torch._dynamo.reset()
            counters.clear()
            lin = MixedPrecisionLinear(256, 512, device=device, dtype=torch.bfloat16, config=MixedPrecisionConfig(fmt))
            lin.set_weight_cache(cache)
            f = torch.compile(lin)
            for _ in range(2):
                x = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
                f(x).float().square().mean().backward()
            breaks = dict(counters["graph_break"])
            failed |= bool(breaks)
            print(f"{fmt} cache={cache}: {sum(breaks.values())} graph breaks, "
                  f"{counters['stats']['unique_graphs']} graphs", flush=True)
            for reason, n in breaks.items():
                print(f"  {n} x {reason}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
