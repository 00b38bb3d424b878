"""Compile the serving kernels (the atomic column-quantization variants and the training matmuls too) for the H200 (sm_90) on a machine without a GPU: ``python tests/_triton_sm90_compile.py``.

Triton's interpreter (what the CPU tests run) is Python: it accepts what compiled Triton refuses (non-constexpr
globals in a jit function, two returns of different types around a constexpr ``if``, ``tl.dot`` shapes and
dtypes) and lowers nothing. Here the kernels go through Triton's real pipeline (``triton.compile`` for
``GPUTarget("cuda", 90, 32)``: TTIR, TTGIR, LLVM, PTX and ptxas' cubin), no device needed, with the argument types
and constexprs the launchers pass on a GPU, with and without the alignment marks a launch on aligned operands
gets (``tt.divisibility``: vectorized loads and cp.async pipelining); each config's shared memory is checked
against the H200's limit per block. Run with ``TRITON_INTERPRET`` unset (``triton.jit`` would otherwise make interpreter functions). Prints one
line a config (``ok`` / ``FAIL``) and ``compiled N of M kernel configs for sm_90``.
"""

import os
import sys

H200_SMEM = 232448  # bytes of shared memory a block may opt into on sm_90


def _configs():
    """``(name, jit function, signature {arg: type}, constexprs, num_warps, num_stages)`` of the launches on CUDA."""
    from hf_lowbit.kernels import triton_fp8_gemv as F
    from hf_lowbit.kernels import triton_int4 as I

    out = []
    # int4: the decode kernel (M = 1: sums; 2..16: tl.dot) at the H200 tiles, every group size int4_linear takes
    # (BLOCK_K is capped at the group), split K or not; the split sum; the dequantize kernel
    for m, (bn, bk, warps) in I.DECODE_TILES.items():
        for gs in (32, 64, 128, 256):
            for split in (1, 4):
                sig = dict(x_ptr="*bf16", p_ptr="*u8", s_ptr="*bf16", z_ptr="*bf16",
                           out_ptr="*bf16" if split == 1 else "*fp32", M="i32", N="i32", K="i32", stride_xm="i32",
                           stride_pn="i32", stride_sn="i32", stride_om="i32", stride_split="i32")
                consts = dict(GROUP=gs, SPLIT_K=split, USE_DOT=m > 1, DOT_IEEE=False, SOFT=False,
                              BLOCK_M=1 if m == 1 else 16, BLOCK_N=bn, BLOCK_K=min(bk, gs))
                out.append((f"int4_decode M={m} gs={gs} split={split}", I._int4_decode_kernel, sig, consts, warps, 3))
    out.append(("int4_split_sum", I._split_sum_kernel, dict(part_ptr="*fp32", out_ptr="*bf16", MN="i32"),
                dict(SPLIT_K=8, SOFT=False, BLOCK=1024), 4, 3))
    bn, bk, warps = I.DEQUANT_TILES
    for gs in (32, 128, 256):
        out.append((f"int4_dequant gs={gs}", I._int4_dequant_kernel,
                    dict(p_ptr="*u8", s_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", N="i32", K="i32", stride_pn="i32",
                         stride_sn="i32", stride_wn="i32"),
                    dict(GROUP=gs, SOFT=False, BLOCK_N=bn, BLOCK_K=min(bk, gs)), warps, 3))
    # int4 on tinygemm's tile layout: the tile GEMV (M = 1: transposed elementwise products; 2..16: tl.dot) at
    # the H200 tiles and the benchmark's sweep tiles (M = 1), every group size, split K or not; the dequantize kernel
    tile_sig = lambda split: dict(  # noqa: E731
        x_ptr="*i32", q_ptr="*i32", sz_ptr="*i32", out_ptr="*bf16" if split == 1 else "*fp32", M="i32", N="i32",
        NP="i32", KP="i32", MAGIC="i32", stride_xm="i32", stride_qn="i32", stride_sg="i32", stride_om="i32",
        stride_split="i32")
    # (the sweep's tiles at the default group only: the group size changes no tile's shape, and the suite's time)
    tile_cfgs = [(m, t, (32, 64, 128, 256)) for m, t in I.TILE_DECODE_TILES.items()]
    tile_cfgs += [(1, t, (128,)) for t in I.TILE_SWEEP_TILES if t not in I.TILE_DECODE_TILES.values()]
    for m, (bn, bk, warps, stages), groups in tile_cfgs:
        for gs in groups:
            for split in (1, 4):
                consts = dict(GROUP=gs, SPLIT_K=split, USE_DOT=m > 1, DOT_IEEE=False, SOFT=False,
                              BLOCK_M=1 if m == 1 else 16, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages)
                out.append((f"int4_tile_decode M={m} tiles={(bn, bk, warps, stages)} gs={gs} split={split}",
                            I._int4_tile_decode_kernel, tile_sig(split), consts, warps, stages))
    # the factored GEMV (M = 1) at its H200 tiles, every group size, split K or not
    fact_sig = lambda split: dict(  # noqa: E731
        xf_ptr="*fp32", xs_ptr="*fp32", q_ptr="*i32", sz_ptr="*i32", out_ptr="*bf16" if split == 1 else "*fp32",
        N="i32", NP="i32", KP="i32", MAGIC="i32", stride_qn="i32", stride_sg="i32", stride_split="i32")
    bn, bk, warps, stages = I.FACTORED_TILES
    for gs in (32, 64, 128, 256):
        for split in (1, 4):
            out.append((f"int4_tile_gemv_factored tiles={I.FACTORED_TILES} gs={gs} split={split}",
                        I._int4_tile_gemv_factored_kernel, fact_sig(split),
                        dict(GROUP=gs, SPLIT_K=split, SOFT=False, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages), warps,
                        stages))
    # the tensor-core GEMV (M <= 16, every group size) at its H200 tiles and the sweep's
    mma_sig = lambda split: dict(  # noqa: E731
        x_ptr="*bf16", q_ptr="*i32", sz_ptr="*i32", out_ptr="*fp32",
        M="i32", N="i32", NP="i32", KP="i32", stride_xm="i32", stride_qn="i32", stride_sg="i32",
        stride_om="i32", stride_split="i32")
    mma_cfgs = [(I.MMA_TILES, gs, split) for gs in (32, 64, 128, 256) for split in (1, 4)]
    mma_cfgs += [(t, 128, 1) for t in I.MMA_SWEEP_TILES if t != I.MMA_TILES]
    for (bn, bk, warps, stages), gs, split in mma_cfgs:
        out.append((f"int4_tile_gemv_mma tiles={(bn, bk, warps, stages)} gs={gs} split={split}",
                    I._int4_tile_gemv_mma_kernel, mma_sig(split),
                    dict(GROUP=gs, SPLIT_K=split, SOFT=False, DOT_IEEE=False, BLOCK_N=bn, BLOCK_K=bk,
                         NUM_STAGES=stages), warps, stages))
    bn, bk, warps = I.TILE_DEQUANT_TILES
    for gs in (32, 128, 256):
        out.append((f"int4_tile_dequant gs={gs}", I._int4_tile_dequant_kernel,
                    dict(q_ptr="*i32", sz_ptr="*i32", w_ptr="*bf16", N="i32", K="i32", stride_qn="i32",
                         stride_sg="i32", stride_wn="i32"),
                    dict(GROUP=gs, SOFT=False, BLOCK_N=bn, BLOCK_K=bk), warps, 3))
    # fp8, the "fused" design: the GEMV (x bf16 / fp16 / fp32; absmax in the GEMV or from the scale kernel; split K
    # or not; bias; the soft rounding the CUDA tests also run), the scale / codes kernel, the split-K reduction.
    # stride_xk = 1 as a constexpr: a launch on a contiguous x (Triton specializes an int argument equal to 1)
    bn, bk, warps, stages = F.H200_TILES
    for xt in ("*bf16", "*fp16", "*fp32"):
        for pre, split, bias, soft in ((False, 1, True, False), (True, 4, False, False), (False, 4, True, False),
                                       (True, 1, False, False), (False, 1, True, True), (True, 4, True, True)):
            sig = dict(x_ptr=xt, w_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                       bias_ptr=xt if bias else "*fp32", out_ptr=xt, ws_ptr="*fp32", M="i32", N="i32", K="i32",
                       K_PER_SPLIT="i32", stride_xm="i32", stride_xk="i32", stride_wn="i32", stride_om="i32",
                       stride_on="i32")
            consts = dict(PRE_SCALE=pre, HAS_BIAS=bias, SPLIT_K=split, SOFT=soft, RECIP=True, BLOCK_M=F.BLOCK_M,
                          BLOCK_N=bn, BLOCK_K=bk)
            out.append((f"fp8_gemv x={xt} pre={pre} split={split} bias={bias} soft={soft}", F._fp8_gemv_kernel,
                        sig, consts, warps, stages))
        sig = dict(sig, bias_ptr=xt)
        sig.pop("stride_xk")
        out.append((f"fp8_gemv x={xt} pre=False split=1 bias=True stride_xk=1", F._fp8_gemv_kernel, sig,
                    dict(PRE_SCALE=False, HAS_BIAS=True, SPLIT_K=1, SOFT=False, RECIP=True, BLOCK_M=F.BLOCK_M,
                         BLOCK_N=bn, BLOCK_K=bk, stride_xk=1), warps, stages))
        for codes in (True, False):
            for soft in (False, True):
                out.append((f"fp8_act_quant x={xt} codes={codes} soft={soft}", F._act_quant_kernel,
                            dict(x_ptr=xt, scale_ptr="*fp32", q_ptr="*fp8e4nv" if codes else "*fp32", M="i32",
                                 K="i32", stride_xm="i32", stride_xk="i32"),
                            dict(WRITE_CODES=codes, SOFT=soft, RECIP=True, BLOCK_M=F.BLOCK_M, BLOCK_K=bk), 4, 3))
        out.append((f"fp8_split_k_reduce x={xt}", F._split_k_reduce_kernel,
                    dict(ws_ptr="*fp32", bias_ptr=xt, out_ptr=xt, M="i32", N="i32", stride_om="i32", stride_on="i32"),
                    dict(HAS_BIAS=True, SPLIT_K=4, SOFT=False, BLOCK=1024), 4, 3))
        # the "codes" design: the row kernel (K of 4096, 14336 and the largest it takes; x contiguous or not) and
        # the GEMV at its tiles (row sums at M = 1, the dot above; split K or not; bias; soft) and every tile of
        # benchmarks/benchmark_fp8_gemv.py's sweep (bf16 only: the x dtype is not in the loop)
        for K in (4096, 16384, F.ROW_MAX_K):
            for soft in (False, True):
                for unit in (True, False):
                    sig = dict(x_ptr=xt, scale_ptr="*fp32", q_ptr="*fp8e4nv", K="i32", stride_xm="i32",
                               stride_xk="i32")
                    consts = dict(SOFT=soft, RECIP=True, BLOCK_K=K)
                    if unit:
                        sig.pop("stride_xk")
                        consts["stride_xk"] = 1
                    out.append((f"fp8_act_quant_rows x={xt} BLOCK_K={K} soft={soft} stride_xk=1:{unit}",
                                F._act_quant_rows_kernel, sig, consts, 4 if K <= 4096 else 8, 1))
        tiles = [(m, *F.H200_CODES_TILES[m]) for m in (1, 16)]
        if xt == "*bf16":
            from benchmarks.benchmark_fp8_gemv import CODES_SWEEP

            tiles += [(m, *t) for m, t in CODES_SWEEP]
        for m, bn_, bk_, warps_, stages_ in tiles:
            for split, bias, soft in ((1, True, False), (4, False, False), (1, False, True), (4, True, True)):
                if (bn_, bk_, warps_, stages_) != F.H200_CODES_TILES[m] and (split, bias, soft) != (1, True, False):
                    continue  # the sweep's tiles: one launch each
                sig = dict(q_ptr="*fp8e4nv", w_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                           bias_ptr=xt if bias else "*fp32", out_ptr=xt, ws_ptr="*fp32", M="i32", N="i32", K="i32",
                           K_PER_SPLIT="i32", stride_wn="i32", stride_om="i32", stride_on="i32")
                consts = dict(HAS_BIAS=bias, SPLIT_K=split, SOFT=soft, USE_DOT=m > 1, BLOCK_M=16 if m > 1 else 1,
                              BLOCK_N=bn_, BLOCK_K=bk_, NUM_STAGES=stages_)
                out.append((f"fp8_gemv_codes x={xt} M={m} tile={bn_}x{bk_} w{warps_} s{stages_} split={split} "
                            f"bias={bias} soft={soft}", F._fp8_gemv_codes_kernel, sig, consts, warps_, stages_))
    # column quantization (issue 25), the atomic variants: the absmax pass (bf16 x of a row-major launch: stride_xn
    # = 1 a constexpr; pipelined loop) and the quantize pass (int8 / fp8, the per-element or per-column division,
    # int8 stochastic rounding) at today's tiles and the two-kernel sweep's best; bf16 x of 16384 rows
    from hf_lowbit.kernels import triton_quant as Q

    for bm, bn, warps in (Q._AMAX_TILES, (32, 128, 4)):
        out.append((f"quant_t amax_atomic {bm}x{bn}w{warps}", Q._col_amax_atomic_kernel,
                    {"x_ptr": "*bf16", "amax_ptr": "*i32", "mul_ptr": "*fp32", "M": "i32", "N": "i32",
                     "stride_xm": "i32"},
                    {"stride_xn": 1, "HAS_MUL": False, "CHUNK_M": 1024, "BLOCK_M": bm, "BLOCK_N": bn,
                     "NUM_STAGES": Q._AMAX_STAGES},
                    warps, Q._AMAX_STAGES))
    for (bm, bn, warps), qt, rcp, sr in ((Q._QUANT_TILES, "*i8", False, False), (Q._QUANT_TILES, "*i8", True, False),
                                         (Q._QUANT_TILES, "*fp8e4nv", False, False),
                                         (Q._QUANT_TILES, "*fp8e4nv", True, False), ((64, 64, 4), "*i8", True, False),
                                         (Q._QUANT_TILES, "*i8", False, True)):
        out.append((f"quant_t quantize_amax {bm}x{bn}w{warps} q={qt} rcp={rcp} stochastic={sr}",
                    Q._quantize_t_amax_kernel,
                    {"x_ptr": "*bf16", "amax_ptr": "*i32", "q_ptr": qt, "scale_ptr": "*fp32",
                     "seed_ptr": "*i64" if sr else "*fp32", "mul_ptr": "*fp32", "qx_ptr": qt, "M": "i32", "N": "i32",
                     "stride_xm": "i32"},
                    {"stride_xn": 1, "QMAX": 127.0 if qt == "*i8" else 448.0, "IS_INT8": qt == "*i8",
                     "STOCHASTIC": sr, "HAS_MUL": False, "BOTH_LAYOUTS": False, "RCP": rcp, "BLOCK_M": bm,
                     "BLOCK_N": bn}, warps, 3))
    # the weight refresh's rows kernel (both layouts; FP8 codes from integer ops), per row and with one scale for the
    # tensor (fp8_tensorwise), and the tensor's absmax pass
    br, bk, warps = Q._ROWS_TILES
    out.append((f"quant_t tensor_amax {br}x{bk}w{warps}", Q._tensor_amax_kernel,
                {"w_ptr": "*bf16", "amax_ptr": "*i32", "R": "i32", "K": "i32", "stride_wr": "i32"},
                {"stride_wk": 1, "BLOCK_R": br, "BLOCK_K": bk}, warps, 3))
    for qt, tensorwise, row_amax in (("*i8", False, False), ("*fp8e4nv", False, False), ("*fp8e4nv", True, False),
                                     ("*i8", False, True), ("*fp8e4nv", False, True)):
        out.append((f"quant_t rows {br}x{bk}w{warps} q={qt} tensorwise={tensorwise}"
                    + (" row_amax" if row_amax else ""),
                    Q._quantize_rows_kernel,
                    {"w_ptr": "*bf16", "q_ptr": qt, "scale_ptr": "*fp32", "seed_ptr": "*fp32", "mul_ptr": "*fp32",
                     "qt_ptr": qt, "amax_ptr": "*i32", "R": "i32", "K": "i32", "stride_wr": "i32"},
                    {"stride_wk": 1, "QMAX": 127.0 if qt == "*i8" else 448.0, "IS_INT8": qt == "*i8",
                     "STOCHASTIC": False, "HAS_MUL": False, "BOTH_LAYOUTS": True, "TENSORWISE": tensorwise,
                     "ROW_AMAX": row_amax, "BLOCK_R": br, "BLOCK_K": bk}, warps, 3))
    # AdamW on a weight with each row's absmax (the weight cache's refresh from it reads the weight once)
    from hf_lowbit.kernels import adamw as AW

    br, bk, warps = AW._TILES
    for dt in ("*bf16", "*fp32"):
        for row_amax in (False, True):
            out.append((f"adamw_rows {br}x{bk}w{warps} {dt} row_amax={row_amax}", AW._adamw_rows_kernel,
                        {"p_ptr": dt, "g_ptr": dt, "m_ptr": dt, "v_ptr": dt, "amax_ptr": "*i32", "R": "i32",
                         "K": "i32", **{a: "fp32" for a in ("decay", "beta1", "one_minus_beta1", "beta2",
                                                            "one_minus_beta2", "step_size", "bc2_sqrt", "eps")}},
                        {"ROW_AMAX": row_amax, "BLOCK_R": br, "BLOCK_K": bk}, warps, 3))
    # the SwiGLU kernels with their row codes (issue 25): the defaults and benchmark_swiglu.py's sweep (a row in one
    # tile or looped over, the column absmax or not), INT8 and FP8 (the hardware cast), bf16 operands
    from benchmarks.benchmark_swiglu import COL_TILES, DEFAULT_TILES
    from hf_lowbit.kernels import triton_swiglu as SW

    sw_tiles = {SW._FWD_TILES, SW._BWD_TILES, *(tuple(int(x) for x in t.split("x")) for t in DEFAULT_TILES.split(","))}
    col_tiles = {tuple(int(x) for x in t.split("x")) for t in COL_TILES.split(",")}
    for qt in ("*i8", "*fp8e4nv"):
        for (br, bn, warps), col in [(t, False) for t in sorted(sw_tiles)] + [(t, True) for t in sorted(col_tiles)]:
            consts = {"QMAX": 127.0 if qt == "*i8" else 448.0, "IS_INT8": qt == "*i8", "NATIVE_FP8": qt != "*i8",
                      "COL_AMAX": col, "ONE_TILE": bn >= 14336, "SOFT": False, "BLOCK_R": br, "BLOCK_N": bn}
            out.append((f"swiglu_quant {br}x{bn}w{warps} q={qt} col_amax={col}", SW._swiglu_quant_kernel,
                        {"g_ptr": "*bf16", "u_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": qt, "s_ptr": "*fp32",
                         "camax_ptr": "*i32", "M": "i32", "N": "i32", "stride_gm": "i32", "stride_um": "i32",
                         "stride_hm": "i32"}, consts, warps, 1))
            out.append((f"swiglu_backward_quant {br}x{bn}w{warps} q={qt} col_amax={col}",
                        SW._swiglu_backward_quant_kernel,
                        {"dh_ptr": "*bf16", "g_ptr": "*bf16", "u_ptr": "*bf16", "mg_ptr": "*fp32", "mu_ptr": "*fp32",
                         "dg_ptr": "*bf16", "du_ptr": "*bf16", "qg_ptr": qt, "qu_ptr": qt, "sg_ptr": "*fp32",
                         "su_ptr": "*fp32", "cg_ptr": "*i32", "cu_ptr": "*i32", "M": "i32", "N": "i32",
                         "stride_dhm": "i32", "stride_gm": "i32", "stride_um": "i32", "stride_dgm": "i32",
                         "stride_dum": "i32"}, {**consts, "HAS_MUL": True}, warps, 1))
    # the training matmuls: INT8 (with the LoRA addend or not) and the accumulating kernel (INT8, FP8), at a tile of
    # their autotuning (their row offsets 64-bit since session 29; a K-strided operand's K offsets, the accumulator's
    # and output's columns too since), each also with ``a`` a transposed view (K strided)
    from hf_lowbit.kernels import triton_int8 as T8

    mm_sig = dict(a_ptr="*i8", b_ptr="*i8", a_scale_ptr="*fp32", b_scale_ptr="*fp32", out_ptr="*bf16", c_ptr="*bf16",
                  d_ptr="*bf16", M="i32", N="i32", K="i32", R="i32", stride_am="i32", stride_ak="i32", stride_bn="i32",
                  stride_bk="i32", stride_om="i32", stride_on="i32", stride_cm="i32", stride_cr="i32", stride_dn="i32",
                  stride_dr="i32")
    tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
    for add, a_k in ((False, True), (True, True), (False, False)):
        out.append((f"int8_scaled_mm 128x128x128w4 add={add}" + ("" if a_k else " a K-strided"),
                    T8._int8_scaled_mm_kernel.fn, mm_sig,
                    dict(A_K_CONTIG=a_k, B_K_CONTIG=True, HAS_ADD=add, BLOCK_R=16, ADD_IEEE=False, **tile), 4, 3))
    for codes, a_k in (("*i8", True), ("*fp8e4nv", True), ("*i8", False)):
        out.append((f"scaled_mm_accumulate 128x128x128w4 codes={codes}" + ("" if a_k else " a K-strided"),
                    T8._scaled_mm_accumulate_kernel.fn,
                    dict(a_ptr=codes, b_ptr=codes, a_scale_ptr="*fp32", b_scale_ptr="*fp32", acc_ptr="*bf16", M="i32",
                         N="i32", K="i32", stride_am="i32", stride_ak="i32", stride_bn="i32", stride_bk="i32",
                         stride_cm="i32", stride_cn="i32"),
                    dict(A_K_CONTIG=a_k, B_K_CONTIG=True, INT_CODES=codes == "*i8", **tile), 4, 3))
    return out


# the int arguments a launch on Llama shapes passes as multiples of 16 (Triton then marks them, as it marks 16-byte
# aligned pointers, ``tt.divisibility = 16``: vectorized loads and cp.async pipelining, other code than without)
_ALIGNED_INTS = {"N", "K", "R", "stride_am", "stride_bn", "stride_cm", "stride_wr", "K_PER_SPLIT", "MN", "stride_xm", "stride_pn", "stride_wn", "stride_om",
                 "stride_split", "NP", "KP", "stride_qn", "stride_sg", "stride_xsm"}


# compile options a kernel is launched with beyond warps and stages (by the config name's start)
_LAUNCH_OPTIONS = {"adamw_rows": {"enable_fp_fusion": False}}  # hf_lowbit.kernels.adamw: no fma contraction


def _with_hints(configs):
    """Each config twice: as a launch on aligned operands (pointers and the ``_ALIGNED_INTS`` marked divisible by
    16) and without those marks (unaligned strides, e.g. rows of a wider tensor)."""
    out = []
    for name, fn, sig, consts, warps, stages in configs:
        hints = [a for a, t in sig.items() if t.startswith("*") or a in _ALIGNED_INTS]
        out.append((name + " aligned", fn, sig, consts, warps, stages, hints))
        out.append((name, fn, sig, consts, warps, stages, []))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET unset: this compiles for the GPU")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    configs = _with_hints(_configs())
    ok = 0
    for name, fn, sig, consts, warps, stages, hints in configs:
        full = {a: sig.get(a, "constexpr") for a in fn.arg_names}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
        try:
            extra = next((o for prefix, o in _LAUNCH_OPTIONS.items() if name.startswith(prefix)), {})
            k = triton.compile(ASTSource(fn, full, consts, attrs), target=target,
                               options=dict(num_warps=warps, num_stages=stages, **extra))
            if k.metadata.shared > H200_SMEM:
                raise RuntimeError(f"{k.metadata.shared} bytes of shared memory, over the H200's {H200_SMEM}")
            print(f"ok   {name} (shared {k.metadata.shared} B)", flush=True)
            ok += 1
        except Exception as e:  # noqa: BLE001 - every config is tried; each failure printed with its cause
            causes, c = [], e
            while c is not None and len(causes) < 4:
                causes.append(f"{type(c).__name__}: {str(c)[-600:]}")
                c = c.__cause__ or c.__context__
            print(f"FAIL {name}\n  " + "\n  ".join(causes[::-1][:2]), flush=True)
    print(f"compiled {ok} of {len(configs)} kernel configs for sm_90")
    return 0 if ok == len(configs) else 1


if __name__ == "__main__":
    sys.exit(main())
