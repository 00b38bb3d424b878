"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU, and read its machine code: the helpers
``tools/quant_t_sass.py`` and ``tools/int4_gemv_sass.py`` share. Run with ``TRITON_INTERPRET`` unset (``triton.jit``
would otherwise make interpreter functions)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def tool_args(doc: str, flags: dict[str, str]) -> tuple[argparse.Namespace, str]:
    """A SASS tool's command line: ``--dump DIR`` and ``flags`` (store-true, name -> help); refuses to run under
    ``TRITON_INTERPRET=1``. Returns the arguments and the directory the machine code goes to."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET unset: this compiles for the GPU")
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--dump", help="write each kernel's .ptx, .cubin and .sass here")
    for flag, text in flags.items():
        p.add_argument(flag, action="store_true", help=text)
    a = p.parse_args()
    tmp = a.dump or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    return a, tmp


def compile_sm90(fn, sig: dict, consts: dict, hints, warps: int, stages: int):
    """``triton.compile`` of ``fn`` for ``GPUTarget("cuda", 90, 32)``: ``sig`` the non-constexpr arguments' types,
    ``consts`` the constexprs, ``hints`` the arguments a launch marks ``tt.divisibility = 16`` (16-byte aligned
    pointers, ints that are multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    full = {a: sig.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    return triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def machine_code(kernel, base: str) -> tuple[str, str]:
    """Writes ``base``.ptx / .cubin / .sass; returns ``(ptxas -v's report, the SASS)`` (Triton's own ptxas and
    cuobjdump)."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with open(base + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    with open(base + ".cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    v = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", base + ".ptx", "-o",
                        os.devnull], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                          text=True, check=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    return v, sass


def registers(ptxas_v: str) -> tuple[int, int]:
    """``(registers, spill-store bytes)`` from ``ptxas -v``."""
    return (int(re.search(r"Used (\d+) registers", ptxas_v).group(1)),
            int(re.search(r"(\d+) bytes spill stores", ptxas_v).group(1)))


def sass_lines(sass: str) -> list[tuple[int, str]]:
    """``(instruction index, line)`` of each SASS instruction (16 bytes each on sm_90)."""
    return [(int(m.group(1), 16) // 16, ln) for ln in sass.splitlines() if (m := _LINE.match(ln))]


def back_edges(sass: str) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of each loop: a branch to an earlier instruction."""
    out = []
    for i, ln in sass_lines(sass):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) // 16 < i:
            out.append((int(m.group(1), 16) // 16, i))
    return out


def opcode_counts(sass: str, first: int, last: int) -> dict[str, int]:
    """Instructions ``first..last`` by opcode (modifiers kept for loads, stores, conversions and MMAs; the rest by
    their base name), most frequent first."""
    keep = ("LDG", "LDS", "STS", "STG", "LDGSTS", "HMMA", "F2FP", "LOP3")
    counts: dict[str, int] = {}
    for i, ln in sass_lines(sass):
        if first <= i <= last:
            m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)", ln)
            op = m.group(1) + (m.group(2) if m.group(1).startswith(keep) else "")
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda t: -t[1]))
