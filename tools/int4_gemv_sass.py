"""The int4 decode GEMVs on tinygemm's tile layout (``hf_lowbit/kernels/triton_int4.py``) compiled for the H200
(sm_90) on a machine without a GPU, with the figures their docstrings quote: ``python tools/int4_gemv_sass.py
[--dump DIR] [--sweep]``.

Per kernel at one row of ``x`` (the tile GEMV's M = 1 branch, ``TILE_DECODE_TILES[1]``, and the factored GEMV,
``FACTORED_TILES``; the tensor-core GEMV, ``MMA_TILES``, for up to 16 rows, with how many wgmma groups the wait in
its loop leaves in flight: 0 when ptxas serializes them), group 128 and 32, split K 1 and 4, as a launch on Llama
shapes marks it (16-byte aligned
pointers, ``N``, ``NP``, ``KP`` and the strides multiples of 16): registers and spills (``ptxas -v``), shared memory,
and the main loop's SASS instructions (the longest loop), per code a thread handles a step (``BLOCK_N · BLOCK_K /
threads``), with the loop's opcodes. ``--sweep``: also the benchmark's sweep tiles (``TILE_SWEEP_TILES``), group 128,
no split. Instruction counts bound a GEMV that streams int4 codes: at 4 bits a code, the H200's ~4.8 TB/s is
~9.6e12 codes a second, and its 132 SMs issue ~33e12 thread-instructions a second (4 warp-instructions a cycle an
SM at ~1.98 GHz): above ~3.5 instructions a code the loop cannot keep up with the memory. Each line ends with that
bound (the loop's instructions alone, every cycle issuing: an upper bound, not a prediction).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sass import back_edges, compile_sm90, machine_code, opcode_counts, registers, sass_lines, tool_args  # noqa: E402

# thread-instructions the H200 issues a second: 132 SMs x 4 schedulers x 32 lanes x ~1.98 GHz (one warp-instruction
# a scheduler a cycle: a bound, reached by no real loop); at 2 codes a byte, codes/s / 2 = bytes/s
H200_ISSUE = 132 * 4 * 32 * 1.98e9
_ALIGNED = ("N", "NP", "KP", "stride_xm", "stride_xsm", "stride_qn", "stride_sg", "stride_om", "stride_split")


def _configs(sweep: bool):
    from hf_lowbit.kernels import triton_int4 as I

    tile_sig = dict(x_ptr="*i32", q_ptr="*i32", sz_ptr="*i32", M="i32", N="i32", NP="i32", KP="i32", MAGIC="i32",
                    stride_xm="i32", stride_qn="i32", stride_sg="i32", stride_om="i32", stride_split="i32")
    fact_sig = dict(xf_ptr="*fp32", xs_ptr="*fp32", q_ptr="*i32", sz_ptr="*i32", N="i32", NP="i32", KP="i32",
                    MAGIC="i32", stride_qn="i32", stride_sg="i32", stride_split="i32")
    mma_sig = dict(x_ptr="*bf16", q_ptr="*i32", sz_ptr="*i32", M="i32", N="i32", NP="i32", KP="i32",
                   stride_xm="i32", stride_qn="i32", stride_sg="i32", stride_om="i32", stride_split="i32")
    cases = [(I.TILE_DECODE_TILES[1], I.FACTORED_TILES, I.MMA_TILES, gs, split) for gs in (128, 32)
             for split in (1, 4)]
    if sweep:
        cases += [(t, t, t, 128, 1) for t in I.TILE_SWEEP_TILES]
    out = []
    for tile_tiles, fact_tiles, mma_tiles, gs, split in cases:
        out_t = "*bf16" if split == 1 else "*fp32"
        bn, bk, warps, stages = tile_tiles
        out.append((f"tile GEMV {tile_tiles} group {gs} split {split}", I._int4_tile_decode_kernel,
                    {**tile_sig, "out_ptr": out_t},
                    dict(GROUP=gs, SPLIT_K=split, USE_DOT=False, DOT_IEEE=False, SOFT=False, BLOCK_M=1, BLOCK_N=bn,
                         BLOCK_K=bk, NUM_STAGES=stages), warps, stages, bn * bk / (32 * warps)))
        bn, bk, warps, stages = fact_tiles
        out.append((f"factored GEMV {fact_tiles} group {gs} split {split}", I._int4_tile_gemv_factored_kernel,
                    {**fact_sig, "out_ptr": out_t},
                    dict(GROUP=gs, SPLIT_K=split, SOFT=False, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages), warps,
                    stages, bn * bk / (32 * warps)))
        bn, bk, warps, stages = mma_tiles
        if bn >= 64:  # wgmma's rows
            out.append((f"mma GEMV {mma_tiles} group {gs} split {split}", I._int4_tile_gemv_mma_kernel,
                        {**mma_sig, "out_ptr": "*fp32"},  # float32 slices, split or not
                        dict(GROUP=gs, SPLIT_K=split, SOFT=False, DOT_IEEE=False, BLOCK_N=bn, BLOCK_K=bk,
                             NUM_STAGES=stages), warps, stages, bn * bk / (32 * warps)))
    return out


def main() -> int:
    a, tmp = tool_args(__doc__, {"--sweep": "also the benchmark's sweep tiles"})
    import triton

    print(f"Triton {triton.__version__}, sm_90")
    for name, fn, sig, consts, warps, stages, codes in _configs(a.sweep):
        hints = [k for k, t in sig.items() if t.startswith("*") or k in _ALIGNED]
        k = compile_sm90(fn, sig, consts, hints, warps, stages)
        v, sass = machine_code(k, os.path.join(tmp, re.sub(r"\W+", "_", name)))
        regs, spill = registers(v)
        first, last = max(back_edges(sass), key=lambda e: e[1] - e[0])
        n = last - first + 1
        ops = opcode_counts(sass, first, last)
        # the tensor-core loops: how many wgmma groups a wait in the loop leaves in flight (0: each step waits for
        # its product)
        waits = [int(m.group(1), 16) for i, ln in sass_lines(sass) if first <= i <= last
                 for m in [re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", ln)] if m]
        print(f"{name}: {regs} regs, {spill} B spilled, smem {k.metadata.shared} B, loop {n} SASS instr, "
              f"{n / codes:.2f} a code ({codes:g} codes a thread a step); issue bound "
              f"{H200_ISSUE / (n / codes) / 2 / 1e12:.1f} TB/s of int4 codes"
              + (f"; wgmma waits in the loop leave {min(waits)} in flight" if waits else ""))
        print("  " + ", ".join(f"{o} {c}" for o, c in list(ops.items())[:12]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
