#!/usr/bin/env python
"""Throughput in the regimes users train in: one record per (recipe, micro-batch, accumulation, path).

    python benchmarks/benchmark_regimes.py --blocks all --json docs/results/regimes_h200.json \
        --markdown docs/results/regimes_h200.md --plot docs/results/regimes_h200.png

Each block is one ``benchmarks/benchmark_train.py`` run (every recipe in its own process, bf16 first, so
every ratio is to the bf16 record of the same micro-batch, accumulation, path and compile mode, in the
same run). Blocks (``--blocks`` takes a comma-separated subset, or ``all``):

* ``layers_b1``, ``layers_b1_ga8``, ``layers_b8``: the hand loop, each decoder layer compiled with
  torch.compile's default mode (``layers_b1`` also runs ``int8_cache`` / ``fp8_cache``: the weight cache on
  without accumulation, which ``LowBitTrainer`` does not do); ``*_ro``: the same with ``mode="reduce-overhead"`` (CUDA graphs) for
  every recipe alike;
* ``trainer_b1_ga8``, ``trainer_b8``: stock ``Trainer`` (bf16, torchao float8) vs ``LowBitTrainer``
  (int8, fp8), the same ``TrainingArguments`` (``torch_compile=True, bf16=True``, fused AdamW);
  LowBitTrainer chooses its compile mode and weight cache itself; ``trainer_b1_ga8_profile`` (and
  ``qlora_trainer_b1_ga8_profile``): the same plus a kernel profile of two more Trainer steps after the timed ones
  (device ms by kernel category, host syncs per step); ``trainer_b1_ga8_loop`` (and ``qlora_trainer_b1_ga8_loop``):
  profiled, + bf16 (LoRA on a bf16 base) through ``LowBitTrainer`` with no low-bit recipe (``bf16_lbt``,
  ``lora_bf16_lbt``): what its training loop gives (no host sync per micro-batch) apart from the low-bit compute;
  ``trainer_b8_profile``, ``layers_b8_profile``: 8x2048 with the kernel profile (the Trainer one with ``bf16_lbt``):
  what bounds the large micro-batch rows;
* ``layers_b1_dual``, ``layers_b8_dual``, ``trainer_b1_ga8_dual`` (issue 25): int8 and fp8 beside ``int8_dual`` /
  ``fp8_dual`` (``lowbit_dual_grad_quant``: dY quantized for both gradient matmuls by one op,
  ``hf_lowbit::quantize_dual``, the same bits), so the two backward paths are measured in the same run;
* ``layers_b8_xcodes``, ``trainer_b8_xcodes`` (issue 25's memory target): int8 and fp8 beside ``int8_xcodes`` /
  ``fp8_xcodes`` (``lowbit_save_x_codes``: each linear keeps X's weight-gradient codes, made in the forward, instead
  of X), peak memory and speed at 8x2048 in the same run;
* ``layers_b8_shared``, ``trainer_b8_shared`` (issue 25): int8 and fp8 (X's column codes made once per sibling
  group, ``hf_lowbit::quantize_t_shared``, the default on CUDA from ``SHARE_MIN_ROWS`` = 8192 rows) beside
  ``int8_unshared`` / ``fp8_unshared`` (each linear quantizing X itself): peak memory and speed;
  ``layers_b1_shared``, ``trainer_b1_ga8_shared``: at 1x2048 (where the default does not share) int8 and fp8 beside
  ``int8_shared`` / ``fp8_shared`` (sharing forced): the host cost of the shared op's calls, without and with the
  Trainer's CUDA graphs.
* ``layers_b8_atomic``, ``layers_b1_atomic``, ``trainer_b1_ga8_atomic`` (issue 25): int8 and fp8 (their default
  ``quantize_t`` variant for activations and output gradients, ``hf_lowbit.kernels.quantize_t.ACTIVATION_VARIANT``:
  ``atomic_rcp`` for both since session 17) beside ``int8_two_kernel`` and ``fp8_two_kernel`` (the same bits): speed
  over whole steps and, through the Trainer, the losses. Recorded at 5600f0c the layers blocks had ``int8``,
  ``int8_atomic_rcp``, ``fp8``, ``fp8_atomic_rcp`` (both defaults then ``two_kernel``); at 47a45b8 the Trainer block
  had ``fp8`` on ``two_kernel`` beside ``fp8_atomic_rcp``.
* ``layers_b8_cast``, ``layers_b1_cast`` (profiled), ``trainer_b1_ga8_cast`` (issue 25): bf16, int8, fp8 (its
  activation codes by the hardware cast, the default on CUDA since 2026-12-03) and ``fp8_softcast`` (rounded in
  float32 first, as before; the same bits): what the cast saves in whole steps.
* ``layers_b8_tensorwise``, ``layers_b1_tensorwise``, ``trainer_b1_ga8_tensorwise``, ``trainer_b8_tensorwise``
  (issue 25's directions; the last with int8 too, the Trainer's 8x2048 row): fp8
  (row-wise scales) beside ``fp8_tensorwise`` (one scale per tensor, ``fp8_tensorwise_mixed_precision``: no per-column
  quantization kernels, cuBLAS's tensorwise FP8 GEMM) and, in the layers blocks, torchao's float8 ``rowwise``
  (``torchao_float8``) and ``tensorwise`` (``torchao_float8_tensorwise``) recipes: speed and, through the Trainer, loss.
* ``layers_b8_recompute``, ``trainer_b8_recompute`` (issue 25's memory target): bf16, int8, fp8 beside ``bf16_recompute``,
  ``int8_recompute``, ``fp8_recompute`` (Inductor's partitioner free to recompute activations the backward materializes:
  ``torch._functorch.config.ban_recompute_materialized_backward = False``; bf16 with it too, so what it gives apart from
  the low-bit compute shows), peak memory and speed at 8x2048 in the same run;
* ``trainer_b8_head``, ``trainer_b1_ga8_head`` (issue 25's directions): int8 and fp8 (the LM head in bf16) beside
  ``int8_head`` / ``fp8_head`` (``lowbit_include_lm_head``: the head's three matmuls in the format too), speed and
  loss; the Trainer path only (the layers path keeps the head bf16 and refuses them);
* ``trainer_b1_ga8_mask``, ``trainer_b8_mask``: ``LowBitTrainer``'s ``lowbit_skip_causal_mask`` (on by default: a plain
  causal batch reaches SDPA with ``is_causal=True`` under the whole-model compile, as eagerly) against ``*_mask``
  (``lowbit_skip_causal_mask=False``: the mask transformers materializes when compiled, every block computed), bf16
  through ``LowBitTrainer`` (``bf16_lbt``, ``bf16_lbt_mask``) beside the stock ``Trainer``: how much of a Trainer row is
  the attention's and how much the low-bit compute's;
* ``layers_b1_adamw`` (profiled), ``layers_b1_ga8_adamw``, ``layers_b8_adamw``, ``trainer_b1_ga8_adamw``,
  ``trainer_b8_adamw`` (issue 25): torch's fused AdamW against ``LowBitAdamW`` (``lowbit_fused_adamw``: one Triton
  pass a large parameter, which also refreshes a cached weight's codes from its row absmax): ``bf16_adamw`` (the
  layers blocks), ``int8_adamw``, ``fp8_adamw`` (this lever alone) against ``<fmt>_plain`` (both levers off, the
  default before session 34) and at 1x2048 the weight cache forced on with either optimizer (``<fmt>_cache_plain``,
  ``<fmt>_cache_adamw``);
* ``layers_b8_multikernel``, ``layers_b1_multikernel`` (profiled; issue 25): bf16, int8, fp8 beside
  ``*_multikernel`` (Inductor's ``config.triton.multi_kernel = 1``: reductions up to 16x wider than usual also get a
  persistent variant, picked by timing; the quantizing SwiGLU kernels reduce over 14,336-wide rows);
* ``layers_b8_swiglu``, ``layers_b1_swiglu`` (profiled), ``layers_b1_ga8_swiglu``, ``trainer_b1_ga8_swiglu``,
  ``trainer_b8_swiglu`` (issue 25): ``<fmt>_plain`` beside ``int8_swiglu`` / ``fp8_swiglu`` (``lowbit_fused_swiglu``
  alone: each Llama MLP one autograd function whose SwiGLU and its row codes are one Triton kernel each way,
  ``LowBitSwiGLUMLP``); ``layers_b1_levers``, ``layers_b8_levers``, ``layers_b1_ga8_levers``: both levers together
  (``int8`` / ``fp8``, the default since session 34; before it ``<fmt>_swiglu_adamw``) beside each alone and neither
  (``<fmt>_plain``), bf16 with ``LowBitAdamW`` too;
* ``layers_b1_ga8_fga`` (profiled), ``trainer_b1_ga8_fga``: int8 and fp8 beside ``int8_fga`` / ``fp8_fga``
  (``lowbit_fused_grad_accum``: the weight gradient added into ``.grad`` in its matmul's epilogue);
  ``layers_b1_ga8_sync``: the layers path at accumulation 8 with ``--mask_sync`` (transformers' packed-sequence check
  reading the device each micro-batch, as the hand loop did before 0858dfe), to set beside the blocks after it;
* ``trainer_b1_ga8_liger``, ``trainer_b1_ga8_liger_fp8``, ``trainer_b8_liger``: the Trainer path with each
  recipe run without and then with ``use_liger_kernel=True`` (``liger`` in the records; ``vs_bf16`` is to bf16
  without Liger, ``vs_no_liger`` to the same recipe without it): what Liger's kernels (norms, SwiGLU, RoPE,
  fused LM head + loss) add to each recipe, measured in the same run;
* ``qlora_b8``, ``qlora_b1`` (+ a kernel profile), ``qlora_b1_ro`` (CUDA graphs): LoRA r16 on every decoder
  linear under bf16 autocast, over a bf16 base, our NF4 + INT8 and INT8 + INT8 bases, and PEFT + bitsandbytes NF4
  (double quant, bf16 compute);
* ``qlora_trainer_b1_ga8``, ``qlora_trainer_b8`` (``_gc``: gradient checkpointing on): the same recipes through
  the Trainer: stock ``Trainer`` + PEFT LoRA over a bf16 base or bitsandbytes, ``LowBitTrainer(peft_config=...)``
  for ours, the same ``TrainingArguments``; ``qlora_trainer_b1_ga8_fusion``: + the INT8 base with the LoRA branch
  beside its matmul (``lora_int8_int8_unfused``), in the same run.

Records: ``recipe, micro_batch_tokens, grad_accum, path, compile_mode, tok_s, vs_bf16, peak_gib,
mem_vs_bf16, first_loss, last_loss, graphs, graph_breaks, timed_recompiles, gradient_checkpointing`` (+ for the trainer path: what LowBitTrainer chose,
``liger``, ``vs_no_liger``, ``mfu`` over the timed steps for every recipe, and LowBitTrainer's own logged
``train_mfu`` / ``train_tokens_per_second`` as ``logged_mfu`` / ``logged_tok_s``). ``vs_bf16`` of LoRA rows is to LoRA over a bf16 base (also as ``vs_lora_bf16``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.driver import bar_plot, error_cell, save_json  # noqa: E402

FULL = "bf16,int8,fp8,torchao_float8"
QLORA = "lora_bf16,lora_nf4_int8,lora_int8_int8,lora_bnb_nf4"  # LoRA r16 on every decoder linear
DUAL = "bf16,int8,int8_dual,fp8,fp8_dual"  # each format's backward with dY quantized apart (today) and by one op
XCODES = "bf16,int8,int8_xcodes,fp8,fp8_xcodes"  # each format keeping X (today) and X's weight-gradient codes
RECOMPUTE = "bf16,bf16_recompute,int8,int8_recompute,fp8_recompute"  # the partitioner's bans as they are, and relaxed
SHARED = "bf16,int8,int8_unshared,fp8,fp8_unshared"  # X's column codes shared by siblings (the default at 8x2048) and not
SHARED_B1 = "bf16,int8,int8_shared,fp8,fp8_shared"  # at 1x2048 the default does not share: forced on beside it
# each format's default quantize_t variant for activations (atomic_rcp for both since session 17) beside the two kernels
ATOMIC = "bf16,int8,int8_two_kernel,fp8,fp8_two_kernel"
# FP8's activation codes by the hardware cast (the default on CUDA) and rounded in float32 first (fp8_softcast)
CAST = "bf16,int8,fp8,fp8_softcast"
# FP8 with row-wise scales and with one scale per tensor, ours and torchao's
TENSORWISE = "bf16,fp8,fp8_tensorwise,torchao_float8,torchao_float8_tensorwise"
# each format with the LM head in bf16 (the default) and in the format (lowbit_include_lm_head): the Trainer path only
HEAD = "bf16,int8,int8_head,fp8,fp8_head"
# each format's weight gradient accumulated by autograd's add (the default) and by its matmul (lowbit_fused_grad_accum)
FGA = "bf16,int8,int8_fga,fp8,fp8_fga"
# torch's fused AdamW (the default) against LowBitAdamW (lowbit_fused_adamw: one Triton pass a large parameter, which
# also refreshes a cached weight's codes from its row absmax), bf16 with it too (its share apart from the low-bit
# compute's); at GA 1 also with the weight cache forced on, after torch's AdamW (<fmt>_cache: the rows refresh) and
# LowBitAdamW's (<fmt>_cache_adamw: the refresh from its absmax)
ADAMW = "bf16,bf16_adamw,int8_plain,int8_adamw,fp8_plain,fp8_adamw"
ADAMW_B1 = ("bf16,bf16_adamw,int8_plain,int8_cache_plain,int8_adamw,int8_cache_adamw,fp8_plain,fp8_cache_plain,"
            "fp8_adamw,fp8_cache_adamw")
ADAMW_TRAINER = "bf16,int8_plain,int8_adamw,fp8_plain,fp8_adamw"  # (a Trainer block of 6 recipes may outrun a 10-minute call)
# each recipe with Inductor's multi-kernel (persistent variants of wide reductions, picked by timing) and without
MULTIKERNEL = "bf16,bf16_multikernel,int8,int8_multikernel,fp8,fp8_multikernel"
# each format with the MLP per linear (Inductor's SwiGLU fusion) and as one function around hf_lowbit's SwiGLU kernels
SWIGLU = "bf16,int8_plain,int8_swiglu,fp8_plain,fp8_swiglu"
# issue 25's two levers together (int8 / fp8: the default since session 34) against each alone and neither
# (<fmt>_plain): LowBitAdamW and the fused MLP (bf16 with LowBitAdamW)
LEVERS = "bf16,bf16_adamw,int8_plain,int8_adamw,int8_swiglu,int8,fp8_plain,fp8"
# name -> (path, batch, grad_accum, compile mode, recipes, extra flags)
BLOCKS = {
    # + the weight cache forced on without accumulation (LowBitTrainer's default turns it on only with it)
    "layers_b1": ("layers", 1, 1, "default", FULL + ",int8_cache,fp8_cache", []),
    "layers_b1_ro": ("layers", 1, 1, "reduce-overhead", "bf16,int8,fp8", []),
    "layers_b1_quick": ("layers", 1, 1, "default", "bf16,int8,fp8", []),  # layers_b1 without the peer and the
    # *_cache recipes: ~2 min
    "layers_b1_ga8": ("layers", 1, 8, "default", "bf16,int8,fp8", []),
    "layers_b1_ga8_ro": ("layers", 1, 8, "reduce-overhead", "bf16,int8,fp8", []),
    "layers_b8": ("layers", 8, 1, "default", FULL, []),
    "layers_b8_ro": ("layers", 8, 1, "reduce-overhead", "bf16,int8,fp8", []),
    "trainer_b1_ga8": ("trainer", 1, 8, "default", "bf16,int8,fp8", []),
    # issue 25: lowbit_fused_adamw (LowBitAdamW) against torch's AdamW (+ the rows refresh where the cache is on), in
    # the same run
    "layers_b1_adamw": ("layers", 1, 1, "default", ADAMW_B1, ["--profile"]),
    "layers_b1_ga8_adamw": ("layers", 1, 8, "default", ADAMW, []),
    "trainer_b1_ga8_adamw": ("trainer", 1, 8, "default", ADAMW_TRAINER, []),
    "layers_b8_adamw": ("layers", 8, 1, "default", ADAMW, []),
    "trainer_b8_adamw": ("trainer", 8, 1, "default", ADAMW_TRAINER, []),
    # issue 25: Inductor's multi-kernel for the quantizing reductions (SwiGLU's 14,336-wide rows), profiled
    "layers_b8_multikernel": ("layers", 8, 1, "default", MULTIKERNEL, ["--profile"]),
    "layers_b1_multikernel": ("layers", 1, 1, "default", MULTIKERNEL, ["--profile"]),
    # issue 25: the MLP as one function with hf_lowbit's SwiGLU kernels (lowbit_fused_swiglu) against per linear
    "layers_b8_swiglu": ("layers", 8, 1, "default", SWIGLU, ["--profile"]),
    "layers_b1_swiglu": ("layers", 1, 1, "default", SWIGLU, ["--profile"]),
    "layers_b1_ga8_swiglu": ("layers", 1, 8, "default", SWIGLU, []),
    "trainer_b1_ga8_swiglu": ("trainer", 1, 8, "default", SWIGLU, []),
    "trainer_b8_swiglu": ("trainer", 8, 1, "default", SWIGLU, []),
    "layers_b1_levers": ("layers", 1, 1, "default", LEVERS, []),
    "layers_b8_levers": ("layers", 8, 1, "default", LEVERS, []),
    "layers_b1_ga8_levers": ("layers", 1, 8, "default", LEVERS, []),
    "trainer_b1": ("trainer", 1, 1, "default", "bf16,int8,fp8", []),
    "trainer_b8": ("trainer", 8, 1, "default", "bf16,int8,fp8", []),
    # + a kernel profile, and bf16 through LowBitTrainer (bf16_lbt): what bounds the 8x2048 rows (issue 25)
    "trainer_b8_profile": ("trainer", 8, 1, "default", "bf16,bf16_lbt,int8,fp8", ["--profile"]),
    "layers_b8_profile": ("layers", 8, 1, "default", "bf16,int8,fp8", ["--profile"]),
    # issue 25: lowbit_dual_grad_quant (int8_dual, fp8_dual) against the split path, in the same run
    "layers_b1_dual": ("layers", 1, 1, "default", DUAL, []),
    "layers_b8_dual": ("layers", 8, 1, "default", DUAL, []),
    "trainer_b1_ga8_dual": ("trainer", 1, 8, "default", DUAL, []),
    # issue 25: lowbit_save_x_codes (int8_xcodes, fp8_xcodes) against keeping X: peak memory at 8x2048
    "layers_b8_xcodes": ("layers", 8, 1, "default", XCODES, []),
    "trainer_b8_xcodes": ("trainer", 8, 1, "default", XCODES, []),
    # issue 25: the partitioner free to recompute what the backward materializes (the linears' normed and SwiGLU
    # inputs): peak memory and speed at 8x2048 against the default partition, bf16 with the same setting beside
    "layers_b8_recompute": ("layers", 8, 1, "default", RECOMPUTE, []),
    "trainer_b8_recompute": ("trainer", 8, 1, "default", RECOMPUTE, []),
    # issue 25: hf_lowbit::quantize_t_shared (q/k/v's and gate/up's X quantized once) against each linear quantizing
    # X itself: memory and speed at 8x2048, and the host cost of its opaque calls at 1x2048 (no CUDA graphs)
    "layers_b8_shared": ("layers", 8, 1, "default", SHARED, []),
    "layers_b1_shared": ("layers", 1, 1, "default", SHARED_B1, []),
    "trainer_b8_shared": ("trainer", 8, 1, "default", SHARED, []),
    # with CUDA graphs (LowBitTrainer's choice) the host cost of the shared op's calls may vanish at 1x2048 too
    "trainer_b1_ga8_shared": ("trainer", 1, 8, "default", SHARED_B1, []),
    # issue 25: activations and output gradients quantized by quantize_t_triton's atomic / atomic_rcp variants
    # (fewer instructions an element, the same bits) against the two-kernel default, whole steps
    "layers_b8_atomic": ("layers", 8, 1, "default", ATOMIC, []),
    "layers_b1_atomic": ("layers", 1, 1, "default", ATOMIC, []),
    "trainer_b1_ga8_atomic": ("trainer", 1, 8, "default", ATOMIC, []),  # FP8's loss beside its default's
    # issue 25: FP8's activation codes by the hardware cast against the float32 rounding (the same bits), whole steps
    "layers_b8_cast": ("layers", 8, 1, "default", CAST, ["--profile"]),
    "layers_b1_cast": ("layers", 1, 1, "default", CAST, ["--profile"]),
    "trainer_b1_ga8_cast": ("trainer", 1, 8, "default", CAST, []),
    # issue 25's directions: FP8 with one scale per tensor against row-wise, ours and torchao's; the Trainer block
    # for its loss beside fp8's (LowBitTrainer's recipes only)
    "layers_b8_tensorwise": ("layers", 8, 1, "default", TENSORWISE, []),
    "layers_b1_tensorwise": ("layers", 1, 1, "default", TENSORWISE, []),
    "trainer_b1_ga8_tensorwise": ("trainer", 1, 8, "default", "bf16,fp8,fp8_tensorwise", []),
    "trainer_b8_tensorwise": ("trainer", 8, 1, "default", "bf16,int8,fp8,fp8_tensorwise", []),
    # issue 25's directions: the LM head (32000 x 4096 here) in INT8 / FP8 beside it in bf16, speed and loss; the Trainer
    # path only (the layers path keeps the head bf16, outside its compiled layers)
    "trainer_b8_head": ("trainer", 8, 1, "default", HEAD, []),
    "trainer_b1_ga8_head": ("trainer", 1, 8, "default", HEAD, []),
    # issue 25: the weight gradient accumulated in its matmul's epilogue against autograd's add (accumulation 8)
    "layers_b1_ga8_fga": ("layers", 1, 8, "default", FGA, ["--profile"]),
    "trainer_b1_ga8_fga": ("trainer", 1, 8, "default", FGA, []),
    # the hand loop with transformers' packed-sequence check reading the device each micro-batch (before 0858dfe)
    "layers_b1_ga8_sync": ("layers", 1, 8, "default", "bf16,int8,fp8", ["--mask_sync"]),
    # lowbit_skip_causal_mask (the default since session 17) against the mask transformers materializes under
    # torch.compile (*_mask), bf16 through LowBitTrainer beside: the attention's share apart from the low-bit compute's
    "trainer_b1_ga8_mask": ("trainer", 1, 8, "default", "bf16,bf16_lbt,bf16_lbt_mask,int8,int8_mask", []),
    "trainer_b8_mask": ("trainer", 8, 1, "default", "bf16,bf16_lbt,int8,int8_mask,fp8_tensorwise", []),
    # + a kernel profile of two more Trainer steps (where the Trainer path trails the layers path)
    "trainer_b1_ga8_profile": ("trainer", 1, 8, "default", "bf16,int8,fp8", ["--profile"]),
    # + bf16 through LowBitTrainer without a low-bit recipe (bf16_lbt): its loop's gain apart from the low-bit one
    "trainer_b1_ga8_loop": ("trainer", 1, 8, "default", "bf16,bf16_lbt,int8,fp8", ["--profile"]),
    # each recipe without, then with use_liger_kernel=True (one run; ~5 min on the H200 for two recipes)
    "trainer_b1_ga8_liger": ("trainer", 1, 8, "default", "bf16,int8", ["--liger", "both"]),
    "trainer_b1_ga8_liger_fp8": ("trainer", 1, 8, "default", "bf16,fp8", ["--liger", "both"]),
    "trainer_b8_liger": ("trainer", 8, 1, "default", "bf16,int8", ["--liger", "both"]),
    "qlora_b8": ("layers", 8, 1, "default", QLORA, ["--autocast"]),
    # 30 timed steps (~1 s; 10 steps of ~35 ms were too few to tell two runs apart) and a kernel profile
    "qlora_b1": ("layers", 1, 1, "default", QLORA, ["--autocast", "--steps", "30", "--profile"]),
    "qlora_b1_ro": ("layers", 1, 1, "reduce-overhead", "lora_bf16,lora_nf4_int8,lora_int8_int8",
                    ["--autocast", "--steps", "30"]),
    # the user's path: stock Trainer + PEFT LoRA (bf16 base, bitsandbytes) vs LowBitTrainer (ours), same arguments
    "qlora_trainer_b1_ga8": ("trainer", 1, 8, "default", QLORA, []),
    # + the INT8 base with the LoRA branch beside its matmul (before the epilogue fusion), in the same run
    "qlora_trainer_b1_ga8_fusion": ("trainer", 1, 8, "default", "lora_bf16,lora_nf4_int8,lora_int8_int8,lora_bnb_nf4,"
                                    "lora_int8_int8_unfused", []),
    "qlora_trainer_b8": ("trainer", 8, 1, "default", QLORA, []),
    "qlora_trainer_b1_ga8_profile": ("trainer", 1, 8, "default", "lora_bf16,lora_nf4_int8,lora_int8_int8",
                                     ["--profile"]),
    # + the loop alone: LoRA on a bf16 base through LowBitTrainer without a low-bit recipe (lora_bf16_lbt), so the
    # gain of its training loop (no host sync per micro-batch) shows apart from the low-bit compute's
    "qlora_trainer_b1_ga8_loop": ("trainer", 1, 8, "default", "lora_bf16,lora_bf16_lbt,lora_nf4_int8,lora_int8_int8,"
                                  "lora_bnb_nf4", ["--profile"]),
    "qlora_trainer_b1_ga8_nocg": ("trainer", 1, 8, "default", "lora_bf16,lora_nf4_int8", ["--no_cuda_graphs"]),
    "qlora_trainer_b1_ga8_gc": ("trainer", 1, 8, "default", QLORA, ["--grad_checkpointing"]),
    "qlora_trainer_b8_gc": ("trainer", 8, 1, "default", QLORA, ["--grad_checkpointing"]),
}


def run_block(name: str, seq: int, timeout: int, extra: list[str], keep_dir: str | None) -> tuple[dict, list[dict]]:
    """Run one block; its raw rows are kept in ``keep_dir/<block>.json`` (rewritten after each recipe, so a
    run cut short keeps what finished)."""
    path, batch, ga, mode, recipes, flags = BLOCKS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(keep_dir or tmp, f"{name}.json")
        cmd = [sys.executable, os.path.join(HERE, "benchmark_train.py"), "--path", path, "--batch", str(batch),
               "--grad_accum", str(ga), "--compile_mode", mode, "--recipes", recipes, "--seq", str(seq),
               "--timeout", str(timeout), "--json", out, *flags, *extra]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)
        if not os.path.exists(out):
            return {}, [{"block": name, "error": "no result"}]
        with open(out) as f:
            data = json.load(f)
    return data["meta"], block_records(name, data)


def block_records(name: str, data: dict) -> list[dict]:
    """The regimes records of block ``name`` from its ``benchmark_train.py`` JSON ``data``."""
    path, _, _, mode, _, _ = BLOCKS[name]
    records = []
    config = data["meta"]["config"]  # what ran (flags passed through may override the block's)
    batch, seq, ga = config["batch"], config["seq"], config["grad_accum"]
    for r in data["rows"]:
        rec = {"block": name, "recipe": r["recipe"] + (" + liger" if r.get("liger") else ""),
               "micro_batch_tokens": batch * seq, "grad_accum": ga,
               "path": path, "compile_mode": mode, "gradient_checkpointing": bool(config.get("grad_checkpointing")),
               "commit": data["meta"].get("commit")}
        if "error" in r:
            rec["error"] = r["error"][-600:]
        else:
            rec.update(tok_s=r["tokens_per_s"], vs_bf16=r.get("vs_bf16"), peak_gib=r["peak_mem_gib"],
                       mem_vs_bf16=r.get("mem_vs_bf16"), step_ms=r["step_ms"], warmup_s=r["warmup_s"],
                       first_loss=r["first_loss"], last_loss=r["last_loss"], graphs=r["compiled_graphs"],
                       graph_breaks=r["graph_breaks"], chosen=r.get("chosen"), profile=r.get("profile"),
                       timed_recompiles=r.get("timed_recompiles"), step_ms_median=r.get("step_ms_median"))
            # each timed step in order, the host's collections; why Inductor ran a graph without CUDA graphs; the
            # GPU's clocks and power over the timed steps
            for key in ("step_ms_seq", "gc_timed", "gc_ms_seq", "cudagraph_skips", "gpu_telemetry"):
                if r.get(key) is not None:
                    rec[key] = r[key]
            if r["recipe"].startswith("lora_"):  # LoRA rows: the reference is LoRA on a bf16 base
                rec["vs_lora_bf16"] = r.get("vs_bf16")
            if path == "trainer":
                rec.update(liger=bool(r.get("liger")), vs_no_liger=r.get("vs_no_liger"), mfu=r.get("mfu"),
                           logged_mfu=r.get("logged_mfu"), logged_tok_s=r.get("logged_tok_s"))
        records.append(rec)
    return records


def table(records: list[dict]) -> list[str]:
    lines = ["| block | path | tokens/micro-batch | grad accum | compile mode | recipe | tok/s | vs bf16 | MFU | peak GiB | "
             "mem vs bf16 | first / last loss | graphs / breaks |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        at = f" @{r['commit'][:7]}" if r.get("commit") else ""  # the commit measured, and the run where one commit
        at += f" ({r['run']})" if r.get("run") else ""  # was measured more than once
        head = (f"| {r['block']}{at} | {r.get('path', '')} | {r.get('micro_batch_tokens', '')} | "
                f"{r.get('grad_accum', '')} | {r.get('compile_mode', '')} | {r['recipe'] if 'recipe' in r else ''} |")
        if "error" in r:
            lines.append(head + f" {error_cell(r['error'], 90)} |||||||")
            continue
        chosen = r.get("chosen") or {}
        note = " (CUDA graphs)" if chosen.get("cuda_graphs") else ""
        ratio = f"**{r['vs_bf16']:.2f}x**" if r.get("vs_bf16") and r["recipe"] not in ("bf16", "lora_bf16") else (
            f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "–")
        mem = f"{r['mem_vs_bf16']:.2f}x" if r.get("mem_vs_bf16") else "–"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "–"
        lines.append(head + f" {r['tok_s']:,.0f}{note} | {ratio} | {mfu} | {r['peak_gib']:.1f} | {mem} | "
                     f"{r['first_loss']:.3f} / {r['last_loss']:.3f} | {r['graphs']} / {r['graph_breaks']} |")
    return lines


def plot(records: list[dict], meta: dict, dst: str) -> None:
    ok = [r for r in records if "error" not in r and r.get("vs_bf16") and r["recipe"] not in ("bf16", "lora_bf16")]
    blocks = list(dict.fromkeys(r["block"] for r in ok))
    recipes = list(dict.fromkeys(r["recipe"] for r in ok))
    commits = ", ".join(sorted({r.get("commit") or meta.get("commit") or "?" for r in records}))
    # a block measured in more than one run: its latest (records are appended run by run), by the median step where
    # recorded (one stalled step of ten does not move it; the table's ratios are by the mean)
    latest = {r["block"]: (r.get("commit"), r.get("run")) for r in records}

    def ratio(block, recipe):
        run = [r for r in records if r["block"] == block and (r.get("commit"), r.get("run")) == latest[block]
               and "error" not in r]
        mine = next((r for r in run if r["recipe"] == recipe and r.get("vs_bf16")), None)
        ref = next((r for r in run if r["recipe"] in ("bf16", "lora_bf16")), None)
        if mine is None:
            return None
        if ref is not None and mine.get("step_ms_median") and ref.get("step_ms_median"):
            return ref["step_ms_median"] / mine["step_ms_median"]
        return mine["vs_bf16"]

    bar_plot(dst, blocks, recipes, ratio, "tokens/s vs bf16 (same run; each block's latest, by median step)",
             f"{meta.get('gpu', '')}: 8 Llama-8B-shaped layers, commits {commits}", width=max(7, 1.1 * len(blocks)),
             fmt="%.2f", rotation=30, fontsize=8)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="all", help=f"comma-separated from {', '.join(BLOCKS)}, or all")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--timeout", type=int, default=240, help="seconds per recipe process")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--keep_dir", default=None, help="keep each block's raw benchmark_train JSON here")
    p.add_argument("--merge", nargs="*", default=[], help="regimes JSON files to merge (table/plot only, no runs)")
    a, extra = p.parse_known_args()
    meta, records = {}, []
    if a.merge:
        for src in a.merge:
            with open(src) as f:
                data = json.load(f)
            meta = meta or data["meta"]
            records += data["records"]
    else:
        names = list(BLOCKS) if a.blocks == "all" else a.blocks.split(",")
        for name in names:
            if name not in BLOCKS:
                raise SystemExit(f"--blocks: unknown block {name!r}; choose from {', '.join(BLOCKS)}")
            block_meta, recs = run_block(name, a.seq, a.timeout, extra, a.keep_dir)
            meta = meta or block_meta
            records += recs
            save_json(a.json, {"meta": meta, "records": records})
    lines = table(records)
    print("\n".join(lines))
    if a.merge:
        save_json(a.json, {"meta": meta, "records": records})
    if a.markdown:
        with open(a.markdown, "w") as f:
            commits = sorted({r.get("commit") or meta.get("commit") or "?" for r in records})
            f.write(f"{meta.get('gpu')}, torch {meta.get('torch')}, commit(s) measured: {', '.join(commits)} "
                    "(each record's `commit`)\n\n" + "\n".join(lines) + "\n")
    if a.plot and records:
        plot(records, meta, a.plot)


if __name__ == "__main__":
    main()
