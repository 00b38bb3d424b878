"""The column-quantization kernels (``hf_lowbit/kernels/triton_quant.py``) compiled for the H200 (sm_90) on a machine
without a GPU, with the figures their docstring quotes: ``python tools/quant_t_sass.py [--dump DIR]``.

Each kernel at today's tiles and the two-kernel sweep's best, bf16 ``x`` of 16384 x 4096 as a contiguous launch
marks it (pointers, ``M``, ``N``, ``stride_xm`` divisible by 16, ``stride_xn`` = 1 a constexpr), int8 and fp8 codes.
Per kernel: registers and spill bytes (``ptxas -v``), shared memory, the PTX global / shared memory instructions
by width, and from the SASS (``cuobjdump -sass``): the instructions of the main body (up to its last EXIT, the
IEEE division's slow path left out) and of the absmax loop, and per element of a thread (``BLOCK_M * BLOCK_N /
threads`` elements a tile or loop iteration). Run with ``TRITON_INTERPRET`` unset.

``--rows``: the weight refresh's ``_quantize_rows_kernel`` (``variant="rows"``, both layouts) instead, as
``quantize_t_triton(w.T, ...)`` launches it for a contiguous bf16 ``w [R, K]`` at the CUDA tiles ``_ROWS_TILES``, with
``R``, ``K``, ``stride_wr`` divisible by 16 (Llama shapes) and not (the tests' shapes), int8 and fp8 codes, and the
kernel as it was before its FP8 codes were built with integer ops (``fp8-cvt``: ``_encode``'s fp32 -> e4m3 cast; its
PTX through ptxas 12.8, Triton's, and 12.9, ``ptxas-blackwell``): the fp32 -> fp8 conversions in the TTGIR and the
PTX, the codes' layouts, and from the SASS the stores of the encode loop whose data comes from the loop's previous
iteration (a register read before this iteration writes it, not a prefetched load): ptxas's miscompile of the FP8
transposed store. Then the same check of the fused column kernel (FP8, one layout and both).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton
import triton.language as tl
from sass import compile_sm90, machine_code, registers, tool_args

from hf_lowbit.kernels import triton_quant as Q

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
                for native in (False, True) if qt == "*fp8e4nv" else (False,):  # fp8_cast "soft" / "native"
                    out.append((f"{'atomic_rcp' if rcp else 'atomic'} quant {bm}x{bn}w{w} {qt[1:]}"
                                + " native cast" * native, Q._quantize_t_amax_kernel, {**q, "amax_ptr": "*i32"},
                                {**c, "RCP": rcp, "NATIVE_FP8": native}, w, 3, bm * bn))
    return out


@triton.jit
def _rows_cvt_kernel(w_ptr, q_ptr, scale_ptr, seed_ptr, mul_ptr, qt_ptr, R, K, stride_wr, stride_wk,
                     QMAX: tl.constexpr, IS_INT8: tl.constexpr, STOCHASTIC: tl.constexpr, HAS_MUL: tl.constexpr,
                     BOTH_LAYOUTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_quantize_rows_kernel`` as it was before its FP8 codes were built with integer ops (session 14's): codes by
    ``_encode`` (FP8: the fp32 -> e4m3 cast, ``tl.float8e4nv``) stored through ``q_ptr`` / ``qt_ptr`` as they are."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = Q._load_w(w_ptr, offs_r, k0 + tl.arange(0, BLOCK_K), R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL)
        acc = Q._max_keep_nan(acc, tl.abs(w))
    scale = Q._scale_of(Q._amax_reduce(acc, 1), QMAX)
    tl.store(scale_ptr + offs_r, scale, mask=mask_r)
    n_blocks = tl.cdiv(K, BLOCK_K)
    for i in range(n_blocks):
        offs_k = (n_blocks - 1 - i) * BLOCK_K + tl.arange(0, BLOCK_K)
        w = Q._load_w(w_ptr, offs_r, offs_k, R, K, stride_wr, stride_wk, mul_ptr, HAS_MUL)
        q = Q._encode(w, scale[:, None], 0, offs_k[None, :].to(tl.int64) * R + offs_r[:, None], QMAX, IS_INT8,
                      STOCHASTIC)
        tl.store(q_ptr + offs_r[:, None] * K + offs_k[None, :], q, mask=mask_r[:, None] & (offs_k[None, :] < K))
        if BOTH_LAYOUTS:
            tl.store(qt_ptr + offs_k[:, None] * R + offs_r[None, :], tl.trans(q),
                     mask=(offs_k[:, None] < K) & mask_r[None, :])


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?P[0-6T] )?\s*([A-Z0-9_.]+)\s*(.*?)\s*;")


def _sass_ins(sass: str) -> list[tuple]:
    """``(address, guard predicate or None, opcode, operands)`` of each SASS instruction."""
    out = []
    for ln in sass.splitlines():
        m = _SASS_LINE.match(ln)
        if m:
            ops = [o.strip() for o in re.split(r",(?![^\[]*\])", m.group(4))] if m.group(4) else []
            out.append((int(m.group(1), 16), m.group(2), m.group(3), ops))
    return out


def _reg(operand: str):
    m = re.match(r"^[-|!]*R(\d+|Z)", operand)
    return None if not m or m.group(1) == "Z" else int(m.group(1))


def _target(ops) -> int:
    return int(re.search(r"0x([0-9a-f]+)", ops[-1]).group(1), 16)


def _carried_stores(sass: str) -> tuple[list[tuple], int]:
    """Per store in the loop with the most shared-memory stores (the encode loop) ``(address, opcode, its address
    operand, [register.byte, ...])``, and the loop's instruction count. The registers (and bytes) listed are those
    the stored data comes from which hold the loop's previous iteration's value at that point: read before this
    iteration writes them, the last write not a load (a load issued an iteration ahead is software pipelining). In
    Triton's PTX of these kernels only induction variables cross the back edge, so any such register is a
    miscompile. Byte-exact through PRMT, LOP3, byte shifts, bf16
    unpacking and F2FP.PACK_AB_MERGE_C (its result in the low half, C's low half above); other instructions mix all
    bytes of their sources; guard predicates ignored; the IEEE division's slow path (CALL) summarized."""
    ins = _sass_ins(sass)
    idx = {a: i for i, (a, *_) in enumerate(ins)}
    loops = [(idx[_target(ops)], i) for i, (a, _, op, ops) in enumerate(ins) if op == "BRA" and _target(ops) < a]
    lo, hi = max(loops, key=lambda lp: sum(ins[k][2].startswith("STS") for k in range(lp[0], lp[1])))
    body = ins[lo:hi + 1]
    sub_reads, sub_writes = set(), set()  # what the called slow path reads before writing, and writes
    for t in {_target(ops) for _, _, op, ops in body if op.startswith("CALL")}:
        for _, _, op, ops in ins[idx[t]:]:
            if op.startswith("RET"):
                break
            rs = [_reg(o) for o in ops]
            dst = 0 if rs and rs[0] is not None and not op.startswith(("ST", "BRA")) else None
            sub_reads |= {r for j, r in enumerate(rs) if r is not None and j != dst and r not in sub_writes}
            if dst is not None:
                sub_writes.add(rs[0])
    none = [frozenset()] * 4

    def run(last_write):
        state, last, report = {}, {}, []

        def get(r):  # not yet written this iteration: the previous iteration's value (4 bytes)
            if r is None:
                return none
            if r in state:
                return state[r]
            if last_write.get(r, "").startswith(("LDG", "LDS", "LD.")):
                return none
            return [frozenset({(r, b)}) if r in last_write else frozenset() for b in range(4)]

        def mix(rs):
            return frozenset().union(*(b for r in rs for b in get(r)))

        for a, pred, op, ops in body:
            regs = [_reg(o) for o in ops]
            if op.startswith(("STS", "STG", "ST.")):
                n = 4 if op.endswith(".128") else 2 if op.endswith(".64") else 1
                data = get(regs[1])[:1] if op.endswith(("U8", ".8")) else get(regs[1])[:2] if op.endswith(
                    ("U16", ".16")) else [b for r in range(regs[1], regs[1] + n) for b in get(r)]
                report.append((a, op, ops[0], sorted({f"R{r}.b{b}" for s in data for r, b in s})))
                continue
            if op.startswith("CALL"):
                for d in sub_writes:
                    state[d], last[d] = [mix(sub_reads)] * 4, op
                continue
            if op.startswith(("BRA", "BAR", "EXIT", "NOP", "BSSY", "BSYNC", "RET", "WARPSYNC")) or "SETP" in op:
                continue
            two = op.startswith(("SHFL", "LOP3")) and ops[0].lstrip("!").startswith("P")  # predicate, then register
            if not two and ops and ops[0].lstrip("!").startswith("P"):
                continue
            dst, srcs = (regs[1], regs[2:]) if two else (regs[0], regs[1:])
            if dst is None:
                continue
            width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op or op.startswith("CS2R")) else 1
            if op.startswith(("LDG", "LDS", "LD.", "S2R", "S2UR", "CS2R", "MOV32I", "LDC")):
                new = [none] * width
            elif op == "PRMT" and ops[2].startswith("0x"):
                ab = get(srcs[0]) + get(srcs[2])
                new = [[ab[(int(ops[2], 16) >> (4 * i)) & 7] for i in range(4)]]
            elif op.startswith("LOP3") and ops[-2] == "0xc0" and ops[2].startswith("0x"):  # AND with a mask
                new = [[b if (int(ops[2], 16) >> (8 * i)) & 0xFF else frozenset() for i, b in enumerate(get(srcs[0]))]]
            elif op.startswith("LOP3"):  # bitwise: byte i of the sources' bytes i
                new = [[frozenset().union(*(get(r)[i] for r in srcs)) for i in range(4)]]
            elif op == "SHF.R.U32.HI" and regs[1] is None and ops[2].startswith("0x") and int(ops[2], 16) % 8 == 0:
                sh, src = int(ops[2], 16) // 8, get(regs[3])
                new = [[src[i + sh] if i + sh < 4 else frozenset() for i in range(4)]]
            elif op in ("IMAD.MOV.U32", "MOV") and sum(r is not None for r in srcs) <= 1:
                new = [list(get(next((r for r in srcs if r is not None), None)))]
            elif op in ("IMAD.U32", "IMAD.SHL.U32") and ops[2] == "0x10000" and ops[3] == "RZ":  # bf16 -> fp32
                src = get(regs[1])
                new = [[frozenset(), frozenset(), src[0], src[1]]]
            elif op.startswith("F2FP") and "MERGE_C" in op:
                c = get(srcs[2])
                new = [[mix(srcs[:2])] * 2 + [c[0], c[1]]]
            else:
                new = [[mix(srcs)] * 4] * width
            for w in range(width):
                if pred:  # guarded: keeps the old value where it does not run
                    new[w] = [n | o for n, o in zip(new[w], get(dst + w))]
                state[dst + w], last[dst + w] = new[w], op
        return report, last

    _, last_write = run({})  # which registers the body writes, and its last write of each
    return run(last_write)[0], len(body)


def _rows_main(tmp: str, bindir: str) -> int:
    br, bk, warps = Q._ROWS_TILES
    print(f"_quantize_rows_kernel at {br}x{bk}, {warps} warps, bf16 w, both layouts (Triton {triton.__version__})")
    for name, fn, qt, tensorwise, row_amax in (("int8", Q._quantize_rows_kernel, "*i8", False, False),
                                               ("fp8", Q._quantize_rows_kernel, "*fp8e4nv", False, False),
                                               ("fp8-tensorwise", Q._quantize_rows_kernel, "*fp8e4nv", True, False),
                                               ("fp8-row_amax", Q._quantize_rows_kernel, "*fp8e4nv", False, True),
                                               ("fp8-cvt", _rows_cvt_kernel, "*fp8e4nv", False, False)):
        for div in (True, False):
            sig = {"w_ptr": "*bf16", "q_ptr": qt, "scale_ptr": "*fp32", "seed_ptr": "*fp32", "mul_ptr": "*fp32",
                   "qt_ptr": qt, "amax_ptr": "*i32", "R": "i32", "K": "i32", "stride_wr": "i32"}
            consts = {"stride_wk": 1, "QMAX": 127.0 if qt == "*i8" else 448.0, "IS_INT8": qt == "*i8",
                      "STOCHASTIC": False, "HAS_MUL": False, "BOTH_LAYOUTS": True, "TENSORWISE": tensorwise,
                      "ROW_AMAX": row_amax, "BLOCK_R": br, "BLOCK_K": bk}
            sig = {k: v for k, v in sig.items() if k in fn.arg_names}  # the old kernel has no tensorwise arguments
            consts = {k: v for k, v in consts.items() if k in fn.arg_names}
            hints = [k for k, t in sig.items() if t.startswith("*") or (div and k in ("R", "K", "stride_wr"))]
            k = compile_sm90(fn, sig, consts, hints, warps, 3)
            label = f"{name} {'R, K % 16 == 0' if div else 'R, K odd'}"
            base = os.path.join(tmp, "rows_" + re.sub(r"\W+", "_", label))
            ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
            for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
                with open(f"{base}.{ext}", "w") as f:
                    f.write(text)
            layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = (\[[\d, ]+\])", ttgir,
                                      re.MULTILINE))
            enc = []
            for line in ttgir.splitlines():
                m = re.search(r"(tt\.fp_to_fp|arith\.fptosi|arith\.trunci) .*(?:->|to) tensor<(\w+)x(f8E4M3FN|i8), "
                              r"(#blocked\d*)>", line)
                if m:
                    enc.append(f"{m.group(1)} -> {m.group(2)}x{m.group(3)} {m.group(4)} (sizePerThread "
                               f"{layouts[m.group(4)]})")
            trans = re.findall(r"tt\.trans %\S+ .*-> tensor<(\w+)x(f8E4M3FN|i8), (#blocked\d*)>", ttgir)
            conv = re.findall(r"ttg\.convert_layout %\S+ : tensor<\w+x(?:f8E4M3FN|i8), (#blocked\d*)> -> "
                              r"tensor<\w+x(?:f8E4M3FN|i8), (#blocked\d*)>", ttgir)
            print(f"{label}:")
            print(f"  TTGIR encode: {'; '.join(enc)}; tt.trans {len(trans)} -> "
                  + ", ".join(f"{t[2]} {layouts[t[2]]}" for t in trans)
                  + "; codes' convert_layout " + ", ".join(f"{a} -> {b} {layouts[b]}" for a, b in conv))
            ops = ["cvt.rn.satfinite.e4m3x2.f32", "cvt.rzi.s16.f32", "shr.u16", "prmt.b32", "st.shared.b8",
                   "ld.shared.b32", "st.global.v4.b32", "st.global.b8"]
            print("  PTX  " + ", ".join(f"{o} {ptx.count(o)}" for o in ops if ptx.count(o)))
            for ptxas in (["ptxas", "ptxas-blackwell"] if name == "fp8-cvt" and div else ["ptxas"]):
                ver = subprocess.run([os.path.join(bindir, ptxas), "--version"], capture_output=True, text=True,
                                     check=True).stdout
                ver = re.search(r"release ([\d.]+)", ver).group(1)
                v = subprocess.run([os.path.join(bindir, ptxas), "-v", "--gpu-name", "sm_90a", base + ".ptx", "-o",
                                    base + ".cubin"], capture_output=True, text=True, check=True).stderr
                sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"],
                                      capture_output=True, text=True, check=True).stdout
                with open(f"{base}_{ptxas}.sass", "w") as f:
                    f.write(sass)
                stores, loop = _carried_stores(sass)
                bad = [s for s in stores if s[3]]
                sts = [s for s in stores if s[1].startswith("STS")]
                regs, spill = registers(v)
                print(f"  SASS (ptxas {ver}): {regs} regs, {spill} B spilled, F2FP {sass.count('F2FP')}, "
                      f"encode loop {loop} instr ({loop * warps * 32 / (br * bk):.1f}/element), its stores "
                      f"{len(stores)} ({len(sts)} STS.U8 of the transpose): {len(bad)} store the previous "
                      "iteration's data")
                for a, op, addr, regs in bad:
                    print(f"    {a:#06x} {op} {addr} <- {' '.join(regs)}")
    # the other kernel that stores both layouts from one encode in a loop: the fused column kernel (FP8 codes by
    # the e4m3 cast, in _store_col_tile), M, N divisible by 16 (not in the tests)
    bm, bn, warps = Q._FUSED_TILES
    fn = Q._quantize_t_fused_kernel
    for both in (False, True):
        sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "seed_ptr": "*fp32", "mul_ptr": "*fp32",
               "qx_ptr": "*fp8e4nv", "M": "i32", "N": "i32", "stride_xm": "i32"}
        consts = {"stride_xn": 1, "QMAX": 448.0, "IS_INT8": False, "STOCHASTIC": False, "HAS_MUL": False,
                  "BOTH_LAYOUTS": both, "BLOCK_M": bm, "BLOCK_N": bn}
        k = compile_sm90(fn, sig, consts, [k for k, t in sig.items() if t.startswith("*") or k in ("M", "N", "stride_xm")],
                         warps, 3)
        base = os.path.join(tmp, f"fused_fp8_both{int(both)}")
        with open(base + ".cubin", "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", base + ".cubin"], capture_output=True,
                              text=True, check=True).stdout
        stores, loop = _carried_stores(sass)
        bad = [s for s in stores if s[3]]
        print(f"fused fp8 {bm}x{bn}w{warps}, M, N % 16 == 0, both layouts {both}: F2FP {sass.count('F2FP')}, encode "
              f"loop stores {len(stores)} ({sum(s[1].startswith('STS') for s in stores)} STS of the transpose): "
              f"{len(bad)} store the previous iteration's data" + "".join(
                  f"\n    {a:#06x} {op} {addr} <- {' '.join(regs)}" for a, op, addr, regs in bad))
    return 0


def main() -> int:
    a, tmp = tool_args(__doc__, {"--rows": "the weight refresh's rows kernel: FP8 transposed store"})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if a.rows:
        return _rows_main(tmp, bindir)
    for name, fn, sig, consts, warps, stages, tile in _configs():
        hints = [k for k, t in sig.items() if t.startswith("*") or k in ("M", "N", "stride_xm", "n_chunks")]
        k = compile_sm90(fn, sig, consts, hints, warps, stages)
        v, sass = machine_code(k, os.path.join(tmp, re.sub(r"\W+", "_", name)))
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
        regs, spill = registers(v)
        cp = {o: len(re.findall(r"(?<![\w.])" + re.escape(o) + r"(?![\w])", ptx)) for o in PTX_OPS}
        cs = {o: sass.count(o) for o in SASS_OPS}
        print(f"{name}: {regs} regs, {spill} B spilled, smem {k.metadata.shared} B, body {body} SASS instr "
              f"({body / per:.1f}/element, {per:g} elements a thread){loop}")
        print("  PTX  " + ", ".join(f"{o} {c}" for o, c in cp.items() if c))
        print("  SASS " + ", ".join(f"{o.strip()} {c}" for o, c in cs.items() if c), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
