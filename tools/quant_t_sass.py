"""The column-quantization kernels (``hf_lowbit/kernels/triton_quant.py``) compiled for the H200 (sm_90) on a machine
without a GPU, with the figures their docstring quotes: ``python tools/quant_t_sass.py [--dump DIR]``.

Each kernel at today's tiles and the two-kernel sweep's best, bf16 ``x`` of 16384 x 4096 as a contiguous launch
marks it (pointers, ``M``, ``N``, ``stride_xm`` divisible by 16, ``stride_xn`` = 1 a constexpr), int8 and fp8 codes.
Per kernel: registers and spill bytes (``ptxas -v``), shared memory, the PTX global / shared memory instructions
by width, and from the SASS (``cuobjdump -sass``): the instructions of the main body (up to its last EXIT, the
IEEE division's slow path left out) and of the absmax loop, and per element of a thread (``BLOCK_M * BLOCK_N /
threads`` elements a tile or loop iteration). Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PTX_OPS = ["ld.global.v4.b32", "ld.global.b32", "st.global.v4.b32", "st.global.b32", "st.global.b8", "st.shared",
           "ld.shared", "ldmatrix", "cp.async.cg", "atom.global", "red.global", "bar.sync", "shfl.sync", "div.rn.f32",
           "div.full.f32"]
SASS_OPS = ["LDG.E.128", "LDG.E ", "LDGSTS", "STG.E.128", "STG.E ", "STG.E.U8", "STS", "LDS", "LDSM", "REDG", "BAR",
            "SHFL", "MUFU.RCP", "FCHK"]


def _configs():
    from hf_lowbit.kernels import triton_quant as Q

    x = {"x_ptr": "*bf16", "mul_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32"}
    out = []
    for bm, bn, w in (Q._AMAX_TILES, (32, 128, 4)):
        out.append((f"two_kernel amax {bm}x{bn}w{w}", Q._col_amax_kernel, {**x, "part_ptr": "*fp32"},
                    {"stride_xn": 1, "HAS_MUL": False, "CHUNK_M": 1024, "BLOCK_M": bm, "BLOCK_N": bn}, w, 3, bm * bn))
        out.append((f"atomic amax {bm}x{bn}w{w} stages {Q._AMAX_STAGES}", Q._col_amax_atomic_kernel,
                    {**x, "amax_ptr": "*i32"}, {"stride_xn": 1, "HAS_MUL": False, "CHUNK_M": 1024, "BLOCK_M": bm,
                                                "BLOCK_N": bn, "NUM_STAGES": Q._AMAX_STAGES}, w, Q._AMAX_STAGES, bm * bn))
    for bm, bn, w in (Q._QUANT_TILES, (64, 64, 4)):
        for qt in ("*i8", "*fp8e4nv"):
            q = {**x, "q_ptr": qt, "scale_ptr": "*fp32", "seed_ptr": "*fp32", "qx_ptr": qt}
            c = {"stride_xn": 1, "QMAX": 127.0 if qt == "*i8" else 448.0, "IS_INT8": qt == "*i8", "STOCHASTIC": False,
                 "HAS_MUL": False, "BOTH_LAYOUTS": False, "BLOCK_M": bm, "BLOCK_N": bn}
            out.append((f"two_kernel quant {bm}x{bn}w{w} {qt[1:]}", Q._quantize_t_kernel,
                        {**q, "part_ptr": "*fp32", "n_chunks": "i32"}, c, w, 3, bm * bn))
            for rcp in (False, True):
                out.append((f"{'atomic_rcp' if rcp else 'atomic'} quant {bm}x{bn}w{w} {qt[1:]}",
                            Q._quantize_t_amax_kernel, {**q, "amax_ptr": "*i32"}, {**c, "RCP": rcp}, w, 3, bm * bn))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET unset: this compiles for the GPU")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", help="write each kernel's .ptx and .sass here")
    a = p.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tmp = a.dump or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    for name, fn, sig, consts, warps, stages, tile in _configs():
        full = {k: sig.get(k, "constexpr") for k in fn.arg_names}
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items()
                 if t.startswith("*") or k in ("M", "N", "stride_xm", "n_chunks")}
        k = triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        base = os.path.join(tmp, re.sub(r"\W+", "_", name))
        with open(base + ".ptx", "w") as f:
            f.write(k.asm["ptx"])
        with open(base + ".cubin", "wb") as f:
            f.write(k.asm["cubin"])
        v = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", base + ".ptx", "-o",
                            os.devnull], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                              text=True, check=True).stdout
        with open(base + ".sass", "w") as f:
            f.write(sass)
        ptx = k.asm["ptx"]
        addr = lambda line: int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) // 16
        lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
        body = max(addr(ln) for ln in lines if "EXIT" in ln) + 1
        target = lambda line: int(re.search(r"BRA (0x[0-9a-f]+)", line).group(1), 16) // 16
        back = [ln for ln in lines if re.search(r"BRA 0x", ln) and target(ln) < addr(ln)]  # loops' back edges
        per = tile / (32 * warps)
        loop = ""
        if "amax" in name and back:
            ln = back[-1]
            n = addr(ln) - target(ln) + 1
            loop = f", loop {n} instr ({n / per:.1f}/element)"
        regs = re.search(r"Used (\d+) registers", v).group(1)
        spill = re.search(r"(\d+) bytes spill stores", v).group(1)
        cp = {o: len(re.findall(r"(?<![\w.])" + re.escape(o) + r"(?![\w])", ptx)) for o in PTX_OPS}
        cs = {o: sass.count(o) for o in SASS_OPS}
        print(f"{name}: {regs} regs, {spill} B spilled, smem {k.metadata.shared} B, body {body} SASS instr "
              f"({body / per:.1f}/element, {per:g} elements a thread){loop}")
        print("  PTX  " + ", ".join(f"{o} {c}" for o, c in cp.items() if c))
        print("  SASS " + ", ".join(f"{o.strip()} {c}" for o, c in cs.items() if c), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
