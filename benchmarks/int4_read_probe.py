"""What bounds the int4 GEMVs at one row: the bandwidth a kernel that only *reads* the tile words reaches (issue 26).

    python benchmarks/int4_read_probe.py --json OUT/int4_read_probe_h200.json --markdown OUT/int4_read_probe_h200.md

Every int4 GEMV measured on the H200 at one row (tinygemm, gemlite, hf_lowbit's tile and mma kernels) plateaus at
~1.8-1.9 TB/s on the served layer shapes, whatever its tiles and split-K (``int4_mma_sweep_h200``), where cuBLAS's
bf16 GEMV reads its weight at ~4 TB/s. This probe asks whether the plateau is the *access* (tinygemm's tile
layout read as the mma kernel reads it: 512-byte runs of 8 rows a step) or the *work* done on what is read:

* ``read_ptr``: the mma kernel's loads and grid alone (the same words, offsets, masks, ``tl.range`` stages,
  split-K), the words XOR-ed into an accumulator so that nothing is dropped;
* ``read_tma``: the same tiles through a host-side ``TensorDescriptor`` (the Hopper TMA engine: one instruction a
  tile, no address arithmetic in the threads), the words seen as ``[N/8, K]`` int32;
* ``mma``: ``int4_tile_decode_triton(kernel="mma")`` (what ``decode="triton_mma"`` serves), ``tinygemm``
  (``aten._weight_int4pack_mm``) and ``bf16`` (``F.linear``) on the same shapes.

``--variants``: the one-row mma GEMV with parts taken out or changed (``_mma_variant_kernel``'s MODEs,
``_mma_window_kernel``), to time what each costs; ``int4_variants_h200`` (session 26) showed the per-step wait
for the dot's product (to scale it) costing 1.2-1.4x, and the bf16 dequantization (MODE 3) now served.

Each call reads a different copy of the weight (copies enough to exceed the 50 MB L2 several times, rotated), as a
served model reads 32 layers' distinct weights, so no figure is an L2 hit. µs: ten calls in one CUDA graph, replayed
(``benchmarks.driver.graph_ms``); GB/s: the bytes the call must read (codes; the GEMVs also their scales and zeros).
CUDA only: on a CPU it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_lowbit.kernels.triton_int4 import _pair_dequant_bf16, _split_k_steps  # noqa: E402

SHAPES = ((28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096))
# (BLOCK_N, BLOCK_K, warps, stages)
READ_TILES = ((128, 128, 4, 1), (128, 128, 4, 3), (128, 128, 4, 6), (128, 256, 4, 3), (256, 128, 8, 3),
              (64, 128, 4, 3), (64, 256, 4, 4))
SPLITS = (1, 2, 4, 8)
L2_BYTES = 50 << 20


@triton.jit
def _read_ptr_kernel(q_ptr, out_ptr, NP, KP, stride_qn, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The mma GEMV's word loads (``_int4_tile_gemv_mma_kernel``), nothing done with them but an XOR."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NP
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, KW), dtype=tl.int32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = step * BLOCK_K
        words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[None, :] + row[:, None], mask=mask_n[:, None],
                        other=0)
        acc = acc ^ words
    tl.store(out_ptr + pid_k * NP + offs_n, tl.xor_sum(acc, axis=1), mask=mask_n)


@triton.jit
def _read_tma_kernel(desc, out_ptr, NP, KP, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """The same tiles through a TMA descriptor of the words as ``[NP/8, KP]`` int32 (a step of 8 rows' 128
    columns is 128 contiguous words: a ``[BLOCK_N/8, BLOCK_K]`` box is the mma kernel's tile)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N // 8, BLOCK_K), dtype=tl.int32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        acc = acc ^ desc.load([pid_n * (BLOCK_N // 8), step * BLOCK_K])
    offs = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    tl.store(out_ptr + pid_k * NP + offs, tl.xor_sum(acc, axis=1), mask=offs < NP // 8)


@triton.jit
def _nibble_pair_bf16(words, SH: tl.constexpr, SOFT: tl.constexpr):
    """``128 + q`` of the nibble at bit ``SH`` of each word's halves as two bf16 tensors (exact): one LOP3 into bf16
    128.0's mantissa on the GPU, float32 in the interpreter. The factored mma GEMV's (served until session 26)."""
    if SH > 0:
        words = (words.to(tl.uint32, bitcast=True) >> SH).to(tl.int32, bitcast=True)
    if SOFT:
        even = ((words & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388480.0  # 2**23 - 128
        odd = (((words >> 16) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388480.0
        return even.to(tl.bfloat16), odd.to(tl.bfloat16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xea; mov.b32 {$0, $1}, t; }",
            "=h,=h,r", [words], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _mma_variant_kernel(x_ptr, q_ptr, sz_ptr, out_ptr, N, NP, KP, stride_qn, stride_sg, stride_split,
                        MODE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    """``_int4_tile_gemv_mma_kernel`` at one row with parts taken out, to time what each costs (group = BLOCK_K):
    MODE 0 as served until session 26 (``128 + q`` codes, the scale a step on the dot's result, x's sum a step for
    the zeros); 1 without x's sum (wrong: the zeros dropped); 2 the codes' dot accumulated as it is (wrong: no scale or zero,
    the dot's accumulator chained across steps, so wgmma need not be waited for each step); 3 the weight dequantized
    in bf16 first (``_pair_dequant_bf16``: tinygemm's numerics) and the dot accumulated across steps (right: what
    ``_int4_tile_gemv_mma_kernel`` does since session 26)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    mask_n = offs_n < NP
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    accz = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        k0 = step * BLOCK_K
        words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[None, :] + row[:, None], mask=mask_n[:, None],
                        other=0)
        szw = tl.load(sz_ptr + (k0 // BLOCK_K) * stride_sg + offs_n, mask=mask_n, other=0)
        if MODE == 3:
            szb = tl.broadcast_to(szw[:, None], (BLOCK_N, KW))
            e0, o0 = _pair_dequant_bf16(words, szb, 0, False)
            e1, o1 = _pair_dequant_bf16(words, szb, 4, False)
            e2, o2 = _pair_dequant_bf16(words, szb, 8, False)
            e3, o3 = _pair_dequant_bf16(words, szb, 12, False)
        else:
            e0, o0 = _nibble_pair_bf16(words, 0, False)
            e1, o1 = _nibble_pair_bf16(words, 4, False)
            e2, o2 = _nibble_pair_bf16(words, 8, False)
            e3, o3 = _nibble_pair_bf16(words, 12, False)
        w = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(o0, o2), tl.join(o1, o3)))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // 128, 4, 4, 4, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K))
        x = tl.load(x_ptr + offs_m[None, :] * KP + (k0 + tl.arange(0, BLOCK_K))[:, None], mask=offs_m[None, :] < 1,
                    other=0.0)
        if MODE >= 2:
            acc = tl.dot(w, x, acc, out_dtype=tl.float32)
        else:
            part = tl.dot(w, x, out_dtype=tl.float32)
            s = (szw << 16).to(tl.float32, bitcast=True)
            z = (szw & -65536).to(tl.float32, bitcast=True) - 136.0 * s
            if MODE == 0:
                accz += z * tl.sum(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))
            acc += part * s[:, None]
    acc += tl.where(offs_m[None, :] == 0, accz[:, None], 0.0)
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * N + offs_n[:, None]
    tl.store(out_ptrs, acc, mask=(offs_n < N)[:, None] & (offs_m[None, :] < 1))


@triton.jit
def _mma_window_kernel(x_ptr, q_ptr, sz_ptr, out_ptr, N, NP, KP, stride_qn, stride_sg, stride_split,
                       SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                       SOFT: tl.constexpr):
    """MODE 4: MODE 0's numerics (``128 + q`` exact, products exact, float32 sums, the scale and zero per group
    outside the dot) with the dot's accumulator chained, so that wgmma need not be waited for each step: the one
    row of ``x`` goes into column ``i`` of the dot's 16-column B operand at the ``i``-th step of a window of 16
    (the other columns zero), so the accumulator's column ``i`` collects step ``i``'s group alone; after the window,
    one epilogue applies the 16 groups' scales and zeros (``x``'s 16 group sums from one ``[16, BLOCK_K]`` load).
    Group = ``BLOCK_K``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = BLOCK_K // 8
    j = tl.arange(0, KW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    mask_n = offs_n < NP
    row = (offs_n // 8) * stride_qn + (offs_n % 8) * 16
    first, last = _split_k_steps(pid_k, KP // BLOCK_K, SPLIT_K)
    res = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(first, last, 16):
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        for step in tl.range(w0, tl.minimum(w0 + 16, last), num_stages=NUM_STAGES):
            k0 = step * BLOCK_K
            words = tl.load(q_ptr + (k0 + (j // 16) * 128 + (j % 16))[None, :] + row[:, None], mask=mask_n[:, None],
                            other=0)
            e0, o0 = _nibble_pair_bf16(words, 0, SOFT)
            e1, o1 = _nibble_pair_bf16(words, 4, SOFT)
            e2, o2 = _nibble_pair_bf16(words, 8, SOFT)
            e3, o3 = _nibble_pair_bf16(words, 12, SOFT)
            w = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(o0, o2), tl.join(o1, o3)))
            w = tl.reshape(w, (BLOCK_N, BLOCK_K // 128, 4, 4, 4, 2))
            w = tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K))
            x = tl.load(x_ptr + (k0 + tl.arange(0, BLOCK_K))[:, None] + offs_m[None, :] * 0,
                        mask=offs_m[None, :] == step - w0, other=0.0)
            if SOFT:
                acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc, out_dtype=tl.float32)
        g = w0 + offs_m
        ing = g < last
        szw = tl.load(sz_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=mask_n[:, None] & ing[None, :], other=0)
        s = (szw << 16).to(tl.float32, bitcast=True)
        z = (szw & -65536).to(tl.float32, bitcast=True) - 136.0 * s
        xg = tl.load(x_ptr + g[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], mask=ing[:, None], other=0.0)
        xs = tl.sum(xg.to(tl.float32), axis=1)
        res += tl.sum(acc * s + z * xs[None, :], axis=1)
    tl.store(out_ptr + pid_k * stride_split + offs_n, res, mask=offs_n < N)


def _copies(nbytes: int) -> int:
    return max(2, -(-4 * L2_BYTES // nbytes))


def _rotating(fns):
    """One callable that calls the next of ``fns`` each time (each on its own weight copy)."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def bench(shapes, tiles, splits) -> list[dict]:
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.driver import graph_ms
    from hf_lowbit.kernels.triton_int4 import MMA_TILES, _sms, decode_split_k, int4_tile_decode_triton

    rows = []
    sms = _sms(torch.device("cuda"))
    for N, K in shapes:
        code_bytes = N * K // 2
        gs = 128
        n = _copies(code_bytes)
        qs, szs = [], []
        for _ in range(n):
            q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.int32)
            qs.append(torch.ops.aten._convert_weight_to_int4pack(
                (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(), 8))
            s = (torch.rand(N, K // gs, device="cuda") * 0.01 + 1e-3).bfloat16()
            z = (torch.randn(N, K // gs, device="cuda") * 0.01).bfloat16()
            szs.append(pack_tinygemm_scales_and_zeros(s, z))
        del q
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        sz_bytes = szs[0].numel() * szs[0].element_size()
        gemv_bytes = code_bytes + sz_bytes + 2 * (K + N)

        def record(name, cfg, split, fn, nbytes):
            try:
                us = graph_ms(_rotating(fn)) * 1e3
                rows.append({"shape": f"{N}x{K}", "kernel": name, "tiles": cfg, "split_k": split, "us": us,
                             "gb_s": nbytes / us / 1e3, "copies": n})
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end of the run
                rows.append({"shape": f"{N}x{K}", "kernel": name, "tiles": cfg, "split_k": split,
                             "error": f"{type(e).__name__}: {str(e)[:160]}"})
            r = rows[-1]
            print(f"{r['shape']:>11} {name:9} {str(cfg):20} split {split}: "
                  + (f"{r['us']:7.1f} us {r['gb_s']:6.0f} GB/s" if "us" in r else r["error"]), flush=True)

        NP, KP = qs[0].shape[0] * 8, qs[0].shape[1] * 128
        for (bn, bk, warps, stages), split in itertools.product(tiles, splits):
            if (KP // bk) // split < 2:
                continue
            out = torch.empty(split, NP, dtype=torch.int32, device="cuda")
            grid = (triton.cdiv(NP, bn), split)
            ptr = [lambda w=w: _read_ptr_kernel[grid](w, out, NP, KP, w.stride(0), SPLIT_K=split, BLOCK_N=bn,
                                                      BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps,
                                                      num_stages=stages) for w in qs]
            record("read_ptr", (bn, bk, warps, stages), split, ptr, code_bytes)
            descs = [TensorDescriptor.from_tensor(w.view(NP // 8, KP), [bn // 8, bk]) for w in qs]
            tma = [lambda d=d: _read_tma_kernel[grid](d, out, NP, KP, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk,
                                                      NUM_STAGES=stages, num_warps=warps, num_stages=stages)
                   for d in descs]
            record("read_tma", (bn, bk, warps, stages), split, tma, code_bytes)
        default = decode_split_k(NP, KP, MMA_TILES[0], MMA_TILES[1], sms, 8)
        for split in sorted({default, *splits}):
            mma = [lambda w=w, sz=sz, split=split: int4_tile_decode_triton(x, w, sz, gs, N, split_k=split,
                                                                            kernel="mma")
                   for w, sz in zip(qs, szs)]
            record("mma", MMA_TILES, split, mma, gemv_bytes)
        tiny = [lambda w=w, sz=sz: torch.ops.aten._weight_int4pack_mm(x, w, gs, sz) for w, sz in zip(qs, szs)]
        record("tinygemm", None, None, tiny, gemv_bytes)
        del qs, szs
        nb = _copies(N * K * 2)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(nb)]
        record("bf16", None, None, [lambda w=w: torch.nn.functional.linear(x, w) for w in ws], N * K * 2 + 2 * (K + N))
        del ws
        torch.cuda.empty_cache()
    return rows


VARIANT_TILES = ((128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (64, 128, 4, 4))
VARIANT_SPLITS = (1, 2, 4, 8)
MODES = (0, 2, 3, 4)  # 1 (x's sum dropped) left out for device time


def variants(shapes, tiles=VARIANT_TILES, splits=VARIANT_SPLITS, modes=MODES) -> list[dict]:
    """:func:`_mma_variant_kernel`'s MODEs on each shape, tiles and split-K (group 128, one row, each call on its own
    weight copy, as :func:`bench`), beside tinygemm; the right MODEs' (summed, float32) outputs' largest difference
    from tinygemm's, over its largest |y| (session 26: 2.0e-3 to 3.0e-3, the bf16 rounding of tinygemm's output)."""
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    from benchmarks.driver import graph_ms
    rows = []
    for N, K in shapes:
        gs = 128
        n = _copies(N * K // 2)
        qs, szs = [], []
        for _ in range(n):
            q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.int32)
            qs.append(torch.ops.aten._convert_weight_to_int4pack(
                (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(), 8))
            s = (torch.rand(N, K // gs, device="cuda") * 0.01 + 1e-3).bfloat16()
            z = (torch.randn(N, K // gs, device="cuda") * 0.01).bfloat16()
            szs.append(pack_tinygemm_scales_and_zeros(s, z))  # [G, N, 2] bf16
        del q
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        NP, KP = qs[0].shape[0] * 8, qs[0].shape[1] * 128
        tiny = torch.ops.aten._weight_int4pack_mm(x, qs[0], gs, szs[0]).float()
        sz32 = [sz.view(torch.int32).squeeze(-1) for sz in szs]  # [G, N]: the scale in the low half, the zero high
        ref_scale = tiny.abs().max().item()
        for (bn, bk, warps, stages), split, mode in itertools.product(tiles, splits, modes):
            if (KP // bk) // split < 2 or bk > gs:
                continue
            out = torch.zeros(split, 1, N, dtype=torch.float32, device="cuda")
            grid = (triton.cdiv(NP, bn), split)

            def launch(w, sz, out=out, grid=grid, bn=bn, bk=bk, warps=warps, stages=stages, split=split, mode=mode):
                if mode == 4:
                    _mma_window_kernel[grid](x, w, sz, out, N, NP, KP, w.stride(0), sz.stride(0), N, SPLIT_K=split,
                                             BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, SOFT=False,
                                             num_warps=warps, num_stages=stages)
                else:
                    _mma_variant_kernel[grid](x, w, sz, out, N, NP, KP, w.stride(0), sz.stride(0), N, MODE=mode,
                                              SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
                                              num_warps=warps, num_stages=stages)
            row = {"shape": f"{N}x{K}", "kernel": f"mma_v{mode}", "tiles": (bn, bk, warps, stages), "split_k": split}
            try:
                launch(qs[0], sz32[0])
                got = out.sum(0)
                if mode in (0, 3, 4):
                    row["max_diff"] = (got - tiny).abs().max().item() / ref_scale
                us = graph_ms(_rotating([lambda w=w, sz=sz: launch(w, sz) for w, sz in zip(qs, sz32)])) * 1e3
                row.update(us=us, gb_s=(N * K // 2 + szs[0].numel() * 2) / us / 1e3, copies=n)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            print(f"{row['shape']:>11} {row['kernel']:8} {str(row['tiles']):18} split {split}: "
                  + (f"{row['us']:7.1f} us {row['gb_s']:6.0f} GB/s" if "us" in row else row["error"])
                  + (f"  max diff {row['max_diff']:.2e}" if "max_diff" in row else ""), flush=True)
        tiny_fns = [lambda w=w, sz=sz: torch.ops.aten._weight_int4pack_mm(x, w, gs, sz) for w, sz in zip(qs, szs)]
        us = graph_ms(_rotating(tiny_fns)) * 1e3
        rows.append({"shape": f"{N}x{K}", "kernel": "tinygemm", "tiles": None, "split_k": None, "us": us,
                     "gb_s": (N * K // 2 + szs[0].numel() * 2) / us / 1e3, "copies": n})
        print(f"{N}x{K} tinygemm {us:7.1f} us", flush=True)
        del qs, szs, sz32
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], meta: dict) -> list[str]:
    out = [meta["header"], "",
           "| N x K | kernel | tiles (BLOCK_N, BLOCK_K, warps, stages) | split-K | µs | GB/s |", "|---|---|---|---|---|---|"]
    best = {}
    for r in rows:
        if "us" in r:
            key = (r["shape"], r["kernel"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for r in sorted(best.values(), key=lambda r: (r["shape"], r["us"])):
        out.append(f"| {r['shape']} | {r['kernel']} (best) | {r['tiles']} | {r['split_k']} | {r['us']:.1f} | "
                   f"{r['gb_s']:.0f} |")
    out += ["", "Every configuration:", "", "| N x K | kernel | tiles | split-K | µs | GB/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['kernel']} | {r['tiles']} | {r['split_k']} | "
                   + (f"{r['us']:.1f} | {r['gb_s']:.0f} |" if "us" in r else f"{r['error'][:80]} | – |"))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="comma-separated NxK (default: the served Llama-8B layer shapes, stacked)")
    p.add_argument("--variants", action="store_true",
                   help="time _mma_variant_kernel's MODEs (what the mma GEMV's parts cost) instead of the read probe")
    p.add_argument("--modes", default=",".join(map(str, MODES)), help="--variants: the MODEs (4: the windowed kernel)")
    p.add_argument("--splits", default=",".join(map(str, VARIANT_SPLITS)), help="--variants: the split-K factors")
    p.add_argument("--tiles", default=None,
                   help="--variants: BLOCK_N/BLOCK_K/warps/stages tiles, comma-separated (default: VARIANT_TILES)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("int4_read_probe: needs a CUDA GPU; nothing measured or written")
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    tiles = (tuple(tuple(int(v) for v in t.split("/")) for t in a.tiles.split(",")) if a.tiles
             else VARIANT_TILES)
    rows = (variants(shapes, tiles, tuple(int(v) for v in a.splits.split(",")),
                     tuple(int(v) for v in a.modes.split(","))) if a.variants
            else bench(shapes, READ_TILES, SPLITS))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("HF_LOWBIT_COMMIT", "unknown")}
    meta["header"] = (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}: "
                      "one row, each call on its own weight copy (no L2 reuse)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(markdown(rows, meta)) + "\n")
    print("\n".join(markdown(rows, meta)[:40]))


if __name__ == "__main__":
    main()
