#!/usr/bin/env python
"""Count the values where ``torch.compile`` (Inductor) of each fake quant differs from eager, bit for bit (issue 26).

    python tools/fake_quant_compile_check.py                 # on the GPU when there is one, else the CPU
    python tools/fake_quant_compile_check.py --emulate       # with inductor's emulate_precision_casts on
    python tools/fake_quant_compile_check.py --dtypes bfloat16 --shapes 512x1024

Every function in ``hf_lowbit.kernels.fake_quant`` on random rows of various scales and offsets, for each dtype and
group size (32..256), two seeds per shape. Prints one line per case and exits 1 if any value differs.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_lowbit.kernels import fake_quant as fq  # noqa: E402


def cases(dtypes, groups):
    for dtype in dtypes:
        yield "per_token_asym", dtype, None, fq.fake_quant_per_token_asym
        yield "fp8_rowwise", dtype, None, fq.fake_quant_fp8_rowwise
        for g in groups:
            yield f"per_group_sym g{g}", dtype, g, lambda w, g=g: fq.fake_quant_per_group_sym(w, g)
            yield f"int4_tinygemm g{g}", dtype, g, lambda w, g=g: fq.fake_quant_int4_tinygemm(w, g)


def operand(shape, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    n = shape[0]
    x = torch.randn(*shape, generator=gen) * torch.rand(n, 1, generator=gen) * 3 + torch.randn(n, 1, generator=gen)
    return x.to(device=device, dtype=dtype)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="bfloat16,float32,float16")
    p.add_argument("--groups", default="32,64,128,256")
    p.add_argument("--shapes", default="512x1024,64x256,7x384")
    p.add_argument("--emulate", action="store_true", help="torch._inductor.config.emulate_precision_casts = True")
    a = p.parse_args()
    if a.emulate:
        torch._inductor.config.emulate_precision_casts = True
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    print(f"torch {torch.__version__}, {a.device}, emulate_precision_casts={a.emulate}", flush=True)
    failed = False
    for name, dtype, g, fn in cases(dtypes, [int(g) for g in a.groups.split(",")]):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)
        differ = total = 0
        for shape in shapes:
            if g and shape[-1] % g:
                continue
            for seed in range(2):
                x = operand(shape, dtype, seed, a.device)
                want, got = fn(x), compiled(x)
                differ += (bits(want) != bits(got)).sum().item()
                total += want.numel()
        failed |= differ > 0
        print(f"{name:20s} {str(dtype):15s} {differ:8d} of {total} differ ({100 * differ / max(total, 1):.2f}%)",
              flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
