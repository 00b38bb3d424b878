#!/usr/bin/env python
"""The GPU measurements behind docs/benchmarks.md: one table of stages, each sized to fit a 10-minute device call.

    python benchmarks/run.py --list                  # the stages and what each measures
    python benchmarks/run.py STAGE OUTDIR            # run one: its commands, in order, results into OUTDIR

A stage's commands are bash lines run from the repository root with ``$OUT`` set to OUTDIR; ``${NAME:-default}``
reads an environment variable (``${NAME:?}``: one the stage needs). Export ``HF_LOWBIT_COMMIT`` (the commit you
measure) in the device command: the copied tree's git metadata there is the session's starting commit. On the
lent H200, carry torchao's wheel in ``.whl/`` and put where it was installed on ``PYTHONPATH`` (bitsandbytes' and
liger-kernel's too, for the stages that use them). ``tests/test_scripts.py`` checks that every command's flags are
its script's.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = "python3 benchmarks/"

STAGES = {  # stage: (what it measures, roughly how long on one H200, its commands)
    "cuda_tests": ("every test with 'cuda' in its id, on WORKERS (default 8) pytest-xdist processes when xdist imports "
                   "(carry its wheel and execnet's in .whl, installed like torchao's): Triton's compiles, on the CPU, "
                   "dominate, and one process took > 9 min (session 9)", "~6.5 min on 10 workers (b4e3db1: 375 s, bound by "
                   "the autotuned INT8 matmul tests, 345 s and 188 s; one test per case since, not yet re-timed)", [
        "python3 -m pytest -q -rfEs -p no:cacheprovider -k cuda tests/ --durations=25 "
        "$(python3 -c 'import xdist' 2>/dev/null && echo \"-n ${WORKERS:-8}\") 2>&1 | tee $OUT/pytest_cuda.txt"]),
    "regimes": ("1x2048 / 8x2048 tokens, gradient accumulation, hand loop and Trainer, Liger (docs/benchmarks.md "
                "'Regimes'); BLOCKS: a subset (all: ~25 min, so split them over calls or GPUs; *_liger blocks need "
                "liger-kernel; issue 25's lowbit_dual_grad_quant: layers_b1_dual, layers_b8_dual, trainer_b1_ga8_dual, "
                "and lowbit_save_x_codes: layers_b8_xcodes, trainer_b8_xcodes; the partitioner's recompute setting: "
                "layers_b8_recompute, trainer_b8_recompute; X's column codes shared by q/k/v and gate/up against not: "
                "layers_b8_shared, trainer_b8_shared, and forced at 1x2048: layers_b1_shared, trainer_b1_ga8_shared; "
                "one a call; quantize_t's variants against each format's default: layers_b8_atomic, layers_b1_atomic, "
                "trainer_b1_ga8_atomic (FP8's loss through the Trainer with atomic_rcp); FP8's hardware cast against "
                "its float32 rounding (fp8_softcast): layers_b8_cast, layers_b1_cast (profiled), trainer_b1_ga8_cast; FP8 tensorwise and torchao's: "
                "layers_b8_tensorwise, layers_b1_tensorwise, trainer_b1_ga8_tensorwise, trainer_b8_tensorwise; the LM head in low bit "
                "(lowbit_include_lm_head, Trainer path only): trainer_b8_head, trainer_b1_ga8_head; the causal mask left to SDPA "
                "(lowbit_skip_causal_mask) against materialized: trainer_b1_ga8_mask, trainer_b8_mask; the weight gradient "
                "accumulated in its matmul (lowbit_fused_grad_accum) against autograd's add: layers_b1_ga8_fga "
                "(profiled), trainer_b1_ga8_fga; LowBitAdamW (lowbit_fused_adamw): layers_b1_adamw (profiled), "
                "layers_b1_ga8_adamw, layers_b8_adamw, trainer_b1_ga8_adamw, trainer_b8_adamw; Inductor's multi-kernel "
                "for wide reductions: layers_b8_multikernel, layers_b1_multikernel (profiled); the MLP as one function with "
                "our SwiGLU kernels (lowbit_fused_swiglu): layers_b8_swiglu, layers_b1_swiglu (profiled), "
                "layers_b1_ga8_swiglu, trainer_b1_ga8_swiglu, trainer_b8_swiglu; both with LowBitAdamW: layers_b1_levers, "
                "layers_b8_levers, layers_b1_ga8_levers; EXTRA: flags for "
                "benchmark_train.py, e.g. EXTRA='--recipes bf16,fp8_unshared' to run part of a block)",
                "~3.5 min per 5-recipe layers block (5600f0c: 205 s at 8x2048, 158 s at 1x2048); a Trainer block of 4 "
                "recipes ~6 min (5600f0c: 345 s, warm-ups 32-76 s a recipe with the Triton analysis cache; 85-120 s "
                "before it; trainer_b1_ga8_cast at 51cd30c: 332 s)", [
        B + "benchmark_regimes.py --timeout 240 --blocks ${BLOCKS:-all} --keep_dir $OUT --json $OUT/regimes_h200.json "
        "--markdown $OUT/regimes_h200.md ${EXTRA:-}"]),
    "sdpa_mask_probe": ("SDPA forward + backward with the causal mask materialized (a whole-model-compiled transformers "
                        "model's) against is_causal=True (lowbit_skip_causal_mask's), Llama-8B attention shape, batch "
                        "1 and 8: the kernel-level check of the Trainer path's attention (docs/design.md)", "~30 s", [
        B + "sdpa_mask_probe.py --json $OUT/sdpa_mask_probe_h200.json"]),
    "trainer_grad_check": ("FP8's Trainer loss with accumulation (trainer_b1_ga8_atomic at 47a45b8: fp8 10.33 "
                           "against bf16 8.39; this stage placed it in the rows refresh's transposed FP8 codes; fixed "
                           "since, the rows refresh is FP8's default again at de9803d; refresh2k / refreshrows: a "
                           "refresh kernel forced): "
                           "LowBitTrainer's own compiled loop (2 Llama-8B-shaped layers, "
                           "1x2048, accumulation 8, weight cache, CUDA graphs, bf16 autocast), checked at each step's "
                           "first micro-batch: the weight cache against a fresh quantization, the loss and every "
                           "gradient against the same recipe run eagerly uncached and against bf16 (cosines). One "
                           "process per CONFIGS entry (fmt:variant[+nocache|+nographs|+refresh2k|+noanalysis]; the "
                           "JSON is rewritten after each: a cut call keeps what finished)",
                           "~50 s per config (47a45b8: 6 configs in 302 s)", [
        "timeout 570 " + B + "trainer_grad_check.py --timeout 150 --configs ${CONFIGS:-fp8:two_kernel,fp8:atomic_rcp,"
        "fp8:two_kernel+refreshrows,int8:atomic_rcp} "
        "--json $OUT/trainer_grad_check_h200.json --markdown $OUT/trainer_grad_check_h200.md"]),
    "qlora_regimes": ("issue 24: LoRA r16 over a bf16 base, our NF4+INT8 and INT8+INT8 bases, PEFT + bitsandbytes; hand "
                      "loop and Trainer; BLOCKS: a subset of the qlora_* blocks", "4-5 min per block", [
        B + "benchmark_regimes.py --timeout 200 --keep_dir $OUT --blocks "
        "${BLOCKS:-qlora_b1,qlora_trainer_b1_ga8,qlora_trainer_b8,qlora_trainer_b1_ga8_gc,qlora_trainer_b8_gc} "
        "--json $OUT/qlora_regimes_h200.json --markdown $OUT/qlora_regimes_h200.md"]),
    "train": ("the 8-layer bench: 7 recipes and a kernel profile", "~6 min", [
        B + "benchmark_train.py --timeout 110 --profile --json $OUT/train_h200.json --markdown $OUT/train_h200.md "
        "--plot $OUT/train_h200.png"]),
    "kernels": ("one linear; the matmuls per layout; each matmul of a layer per backend, tiles swept, quantization "
                "kernels", "~5 min", [
        B + "benchmark_linear.py --json $OUT/linear_h200.json --markdown $OUT/linear_h200.md --plot $OUT/linear_h200.png",
        B + "benchmark_mm.py --json $OUT/mm_h200.json --markdown $OUT/mm_h200.md",
        B + "benchmark_mm.py --backends --sweep --quant --json $OUT/mm_backends_h200.json "
        "--markdown $OUT/mm_backends_h200.md"]),
    "quant_sweep": ("issue 25: the quantization kernels' tiles, one-kernel variants and the atomic / atomic_rcp "
                    "two-pass variants (activation operands, int8 and fp8, fp8 with the hardware cast and *_soft with the "
                    "float32 rounding; the weight refresh) on a Llama-8B layer's "
                    "shapes at 2048 and 16384 tokens, each checked equal to the default's output", "~3 min", [
        B + "benchmark_mm.py --quant_sweep --tokens 2048 --json $OUT/quant_sweep_h200_t2048.json "
        "--markdown $OUT/quant_sweep_h200_t2048.md",
        B + "benchmark_mm.py --quant_sweep --tokens 16384 --json $OUT/quant_sweep_h200_t16384.json "
        "--markdown $OUT/quant_sweep_h200_t16384.md"]),
    "adamw_refresh": ("issue 25: LowBitAdamW (lowbit_fused_adamw) on the GPU: its CUDA tests (the kernel's bits against "
                      "the float32 reference and torch's fused AdamW, the optimizer beside torch's), then AdamW + the "
                      "weight cache's refresh per Llama-8B layer weight, torch's fused AdamW + the rows kernel against "
                      "the one-pass kernel + the refresh from its row absmax, the kernel alone on every weight and the "
                      "embedding / LM head (GPU ms, GB/s, bits checked). Then, a call each: regimes with "
                      "BLOCKS=layers_b1_adamw (profiled), layers_b1_ga8_adamw, trainer_b1_ga8_adamw (and "
                      "layers_b8_adamw, trainer_b8_adamw)", "~2 min (estimate; not yet run)", [
        "python3 -m pytest -q -rfEs -p no:cacheprovider -v tests/test_triton_int8.py -k 'adamw and cuda' 2>&1 "
        "| tee $OUT/pytest_cuda_adamw.txt || echo 'CUDA TESTS FAILED: the benchmark still runs (it checks its bits)'",
        B + "benchmark_refresh.py --tiles 4x256x4,16x256x8,8x512x8,8x1024x8 --json $OUT/refresh_h200.json "
        "--markdown $OUT/refresh_h200.md"]),
    "swiglu": ("issue 25: a Llama-8B MLP's SwiGLU with its row quantizations at 2048 and 16384 tokens: Inductor's fusion "
               "(what the low-bit layers run today; also with triton.multi_kernel=1) against hf_lowbit's kernels "
               "(hf_lowbit::swiglu_quant / swiglu_backward_quant, tiles swept, a row in one tile or looped), and the "
               "weight gradients' column side (quantize_t of h, dg, du against the column absmax taken in our "
               "kernels + the encode pass alone); GPU ms, GB/s of the floor, codes checked; first the CUDA tests of "
               "the kernels and of the fused MLP (LowBitSwiGLUMLP, eager and compiled). Then regimes with "
               "BLOCKS=layers_b8_swiglu / layers_b1_swiglu (profiled) for whole steps (docs/design.md, 'The MLP as one "
               "function')", "~4 min (estimate; not yet run: ~30 Inductor compiles)", [
        "python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_triton_int8.py tests/test_swiglu_mlp.py "
        "-k 'cuda and (swiglu or fused_mlp)' 2>&1 | tee $OUT/pytest_cuda_swiglu.txt "
        "|| echo 'CUDA TESTS FAILED: the benchmark still runs (it checks its own codes)'",
        B + "benchmark_swiglu.py --json $OUT/swiglu_h200.json --markdown $OUT/swiglu_h200.md"]),
    "quant_dual": ("issue 25: dY quantized per row (times the weight's scales, for dX) and per column (for dW): "
                   "today's pair (compiled plain torch + quantize_t, three reads of dY) vs quantize_dual_triton (two "
                   "reads) at each DUAL_SWEEP tile config, int8 and fp8, a Llama-8B layer's dY shapes at 2048 and "
                   "16384 tokens; each config's outputs compared with the CPU references (the fraction that differs "
                   "recorded) and timed", "~75 s (65798e8, both token counts)", [
        B + "benchmark_mm.py --dual --tokens 2048 --json $OUT/quant_dual_h200_t2048.json "
        "--markdown $OUT/quant_dual_h200_t2048.md",
        B + "benchmark_mm.py --dual --tokens 16384 --json $OUT/quant_dual_h200_t16384.json "
        "--markdown $OUT/quant_dual_h200_t16384.md"]),
    "quality": ("300-step loss curves, bf16 / INT8 / FP8", "> 170 s: give it ~5 min", [
        B + "benchmark_quality.py --compile --json $OUT/quality_h200.json --markdown $OUT/quality_h200.md "
        "--plot $OUT/quality_h200.png"]),
    "quality_parity": ("issue 14's loss parity: 143M Llama, 1,500 steps, the recipes at once on one GPU, each layer "
                       "compiled; the corpus adds installed packages' docstrings (~5.6M tokens) so the steps do not "
                       "repeat it; run it alone in a call; RECIPES: which (default bf16,int8,fp8; e.g. "
                       "bf16,fp8,fp8_tensorwise for FP8 tensorwise's parity; bf16,int8,int8_head,fp8,fp8_head for the LM "
                       "head in the format, lowbit_include_lm_head, its head uncompiled outside the compiled layers)",
                       "~9.5 min estimated; measured 184 s (4 recipes, de9803d) and 231 s (5, with the heads, 51cd30c)", [
        "timeout 570 " + B + "benchmark_quality.py --compile_layers --parallel --corpus_packages "
        "torch,transformers,sympy,networkx,numpy --layers 12 --hidden 1024 --intermediate 2816 --heads 16 --kv_heads 4 "
        "--seq 256 --batch 8 --steps 1500 --warmup 100 --lr 3e-4 --json $OUT/quality_parity_h200.json "
        "--markdown $OUT/quality_parity_h200.md --plot $OUT/quality_parity_h200.png --recipes ${RECIPES:-bf16,int8,fp8}"]),
    "seed_table": ("issue 18's seed table: TinyLlama-1.1B shape, 16x2048 real-text tokens, bf16 + 5 INT8 rows; BATCH: "
                   "16 as in the seed (if bf16 runs out of memory the script says so: rerun with BATCH=8)", "7-8 min", [
        B + "benchmark_seed_table.py --batch ${BATCH:-16} --timeout 170 --raw $OUT/seed_table_rows.json "
        "--json $OUT/seed_table_h200.json --markdown $OUT/seed_table_h200.md --plot $OUT/seed_table_h200.png"]),
    "sr_quality": ("bf16 / INT8 / INT8+SR late in training: 300 bf16 steps, then 200 at lr 3e-5 each", "3-4 min", [
        B + "benchmark_quality.py --compile --recipes bf16,int8,int8_sr --pretrain_steps 300 --late_lr 3e-5 --steps 200 "
        "--json $OUT/sr_quality_h200.json --markdown $OUT/sr_quality_h200.md --plot $OUT/sr_quality_h200.png"]),
    "qlora_train": ("LoRA r16 over bf16 / NF4 / INT8 bases beside the torchao NF4 (+ INT8) peers, 8 layers 8x2048, "
                    "bf16 autocast as Trainer(bf16=True) runs it", "~7 min", [
        B + "benchmark_train.py --timeout 110 --autocast --json $OUT/qlora_train_h200.json --markdown "
        "$OUT/qlora_train_h200.md --plot $OUT/qlora_train_h200.png --recipes "
        "lora_bf16,lora_nf4,lora_nf4_int8,lora_nf4_int8cache,lora_int8_int8,lora_torchao_nf4,lora_torchao_nf4_int8"]),
    "qlora_train_noautocast": ("the same without autocast: PEFT's float32 adapters compute in float32", "~3 min", [
        B + "benchmark_train.py --timeout 110 --json $OUT/qlora_train_noautocast_h200.json --markdown "
        "$OUT/qlora_train_noautocast_h200.md --recipes lora_bf16,lora_nf4_int8,lora_int8_int8"]),
    "qat": ("QAT 8da4w beside bf16 and torchao's QAT (8 layers 8x2048), then what QAT recovers at group 256", "~6 min", [
        B + "benchmark_train.py --timeout 150 --recipes bf16,qat_8da4w,torchao_qat_8da4w --json $OUT/train_qat_h200.json "
        "--markdown $OUT/train_qat_h200.md --plot $OUT/train_qat_h200.png",
        B + "eval_qat.py --group_size 256 --json $OUT/qat_h200.json --markdown $OUT/qat_h200.md"]),
    "qat_ptq_hurts": ("issue 26: QAT where int4 PTQ hurts: the 143M Llama of quality_parity pretrained from scratch on "
                      "~5.6M tokens (about one epoch), int4 everywhere but the input embedding (SCHEME int4_tinygemm, "
                      "GROUP 256: the largest tinygemm group dividing 1024 and 2816; GROUP=-1 is per channel, with "
                      "SCHEME int4_weight_only or 8da4w), one model seed per call: FIRST "
                      "(0, 1, 2; the corpus is the same in each). First FIRST=0 alone to see whether PTQ costs >= 2% "
                      "held-out loss (on the CPU its damage grew with the pre-training rate: raise PRETRAIN_LR if not, "
                      "in every call), then FIRST=1 and FIRST=2, then qat_ptq_hurts_merge. A one-seed try cut at "
                      "320 s (90f002d) had not finished one seed and printed nothing: give each call 10 minutes; "
                      "progress lines (seconds since start) go to the log under $OUT. Build the corpus on the CPU "
                      "first and carry .corpus_cache (CORPUS_CACHE): eval_qat.py --corpus_only with this command's "
                      "corpus flags (--corpus_packages, --vocab, --seq, --corpus_cache)",
                      "> 5 min/call (one seed; the 3-min estimate was wrong; not yet measured)", [
        "timeout 580 " + B + "eval_qat.py --compile --include_lm_head --scheme ${SCHEME:-int4_tinygemm} "
        "--group_size ${GROUP:-256} --repeats 1 --repeat_from ${FIRST:-0} --corpus_packages "
        "torch,transformers,sympy,networkx,numpy "
        "--corpus_cache ${CORPUS_CACHE:-.corpus_cache} --layers 12 --hidden 1024 --intermediate 2816 --heads 16 "
        "--kv_heads 4 --vocab 8192 --seq 256 --batch 8 --pretrain_steps 1500 --pretrain_lr ${PRETRAIN_LR:-2e-3} "
        "--finetune_steps 300 --finetune_lr ${FINETUNE_LR:-3e-4} "
        "--json $OUT/qat_ptq_hurts_h200_seed${FIRST:-0}.json --markdown $OUT/qat_ptq_hurts_h200_seed${FIRST:-0}.md "
        "2>&1 | tee $OUT/qat_ptq_hurts_h200_seed${FIRST:-0}.log"]),
    "qat_ptq_hurts_merge": ("issue 26: the three qat_ptq_hurts calls' seeds (FIRST=0, 1, 2) joined into one summary, as "
                            "one 3-seed run would write it (refused if their flags differ, e.g. another PRETRAIN_LR; a "
                            "call's file that is missing, e.g. one cut short before its seed finished, is left out, "
                            "and said so)", "seconds", [
        B + "eval_qat.py --merge $OUT/qat_ptq_hurts_h200_seed0.json $OUT/qat_ptq_hurts_h200_seed1.json "
        "$OUT/qat_ptq_hurts_h200_seed2.json --json $OUT/qat_ptq_hurts_h200.json --markdown $OUT/qat_ptq_hurts_h200.md"]),
    "ptq_sensitivity": ("issue 26: where int4 PTQ hurts, to pick qat_ptq_hurts' setting from data: pretrain base models "
                        "as eval_qat.py does (no fine-tuning, no QAT; the package corpus of qat_ptq_hurts, the same "
                        ".corpus_cache entry: CORPUS_CACHE) and PTQ each 14 ways (int4_weight_only groups 32-256, "
                        "= hidden and per channel, with and without the LM head; int4_tinygemm 64-256; 8da4w g256 and "
                        "per channel); per base the held-out loss, its train / held-out gap, tokens per parameter, "
                        "the weights' outliers, and per variant the PTQ'd loss and its increase. CONFIGS, in order: "
                        "s6x512_lr1e-2, s6x512_lr3e-3 (6 x 512, MLP 1536, 27M params, 1500 steps of 32 x 256: ~4.8 "
                        "epochs, 0.45 tokens/param; ~76 s each, FLOP-scaled, a low bound), m12x1024_lr8e-3, "
                        "m12x1024_lr4e-3 (qat_ptq_hurts' 143M model, 1500 steps of 8 x 256, ~1.2 epochs; ~120 s each: "
                        "its 83 s of compile + pretraining measured at c73fbe2, 36 s of PTQ rows), m12x1024_lr2e-3 "
                        "(the 0.08% setting, as a control: --deadline_s skips it unless the others ran faster). "
                        "A variant or base that fails is an error record, the rest runs; files rewritten after each "
                        "base (meta.partial until the last). Carry the corpus (built on the CPU: ptq_sensitivity.py "
                        "--corpus_only --corpus_packages torch,transformers,sympy,networkx,numpy --corpus_cache "
                        ".corpus_cache --vocab 8192 --seq 256, the entry qat_ptq_hurts uses): built on the device it "
                        "would take minutes of the call. EXTRA: more flags, last "
                        "(a CPU dry run: EXTRA='--device cpu --override layers=1,hidden=64,intermediate=128,heads=4,"
                        "kv_heads=2,batch=4,steps=3 --max_docs 300 --vocab 512 --eval_blocks 8 --deadline_s 0'). "
                        "Run at 2dda4b0 (session 17, 335 s, all 5 bases): no variant reached 2% (at most +0.66%; "
                        "docs/results/ptq_sensitivity_h200.md)", "~6 min (estimate: python benchmarks/ptq_sensitivity.py --plan "
                        "--deadline_s 500), cut at 500 s by --deadline_s", [
        "timeout 540 " + B + "ptq_sensitivity.py --compile --configs "
        "${CONFIGS:-s6x512_lr1e-2,s6x512_lr3e-3,m12x1024_lr8e-3,m12x1024_lr4e-3,m12x1024_lr2e-3} --corpus_packages "
        "torch,transformers,sympy,networkx,numpy --corpus_cache ${CORPUS_CACHE:-.corpus_cache} --vocab 8192 --seq 256 "
        "--eval_blocks 512 --deadline_s 500 ${EXTRA:-} --json $OUT/ptq_sensitivity_h200.json "
        "--markdown $OUT/ptq_sensitivity_h200.md 2>&1 | tee $OUT/ptq_sensitivity_h200.log"]),
    "serve_probe": ("issue 26: which of torchao 0.18's int4 / FP8 serving configs quantize and run (eager and "
                    "compiled) on this image, one small linear each, with the one-line reason for the others",
                    "1-2 min (estimate)", [
        B + "benchmark_serve.py --probe_only --timeout 300 --json $OUT/serve_probe_h200.json "
        "--markdown $OUT/serve_probe_h200.md"]),
    "serve": ("issue 26: QAT exports served by plain transformers (from_pretrained + generate, one process each) on 8 "
              "Llama-8B-shaped layers: bf16, our QAT export and torchao's PTQ of int4_tinygemm and fp8_rowwise, QAT "
              "8da4w and int4_weight_only; load time, bytes, prefill 1x2048, decode at batch 1 and 8, peak memory. "
              "One call per MODES / CHECKPOINTS set, each with its own bf16 row: MODES=eager (all, the default); "
              "then MODES=compiled TAG=int4 CHECKPOINTS=qat_int4_tinygemm,ptq_int4_tinygemm; then MODES=compiled "
              "TAG=fp8 CHECKPOINTS=qat_fp8_rowwise,ptq_fp8_rowwise; then serve_merge. The compiled calls took 4.0 "
              "and 4.3 min (90f002d); the eager call is not yet run (estimate 6-7 min)", "4-7 min/call", [
        "timeout 580 " + B + "benchmark_serve.py --timeout 300 --layers ${LAYERS:-8} --modes ${MODES:-eager} --checkpoints "
        "${CHECKPOINTS:-qat_int4_tinygemm,ptq_int4_tinygemm,qat_fp8_rowwise,ptq_fp8_rowwise,qat_8da4w,qat_int4_weight_only} "
        "--json $OUT/serve_${MODES:-eager}_${TAG:-all}_h200.json --markdown $OUT/serve_${MODES:-eager}_${TAG:-all}_h200.md"]),
    "serve_profile": ("issue 26: where the compiled path's time goes: bf16 and our int4_tinygemm / fp8_rowwise exports "
                      "in MODES (compiled; compiled_unwrapped: after torchao's unwrap_tensor_subclass; compiled_lean: "
                      "hf_lowbit/qat/serving.py's prepare_for_serving, our unwrap and Dynamo's nn-module guards "
                      "skipped), each prefill "
                      "and decode (two generate lengths) once more under torch.profiler: GPU ms and busy share per "
                      "decoded token, host syncs, CUDA-graph replays, kernel launches, cudagraph skips, top kernels, and "
                      "(since d4ef01f) the top host ops' self ms and calls per token. "
                      "MODES=compiled took 4.8 min (5913b2b: GPU busy 61% for bf16, 30% for int4 at batch 1); "
                      "MODES=compiled_lean is not yet run (expected about the same)",
                      "~5 min", [
        "timeout 580 " + B + "benchmark_serve.py --timeout 300 --layers ${LAYERS:-8} --modes ${MODES:-compiled} --profile --checkpoints "
        "qat_int4_tinygemm,qat_fp8_rowwise --json $OUT/serve_profile_${MODES:-compiled}_h200.json "
        "--markdown $OUT/serve_profile_${MODES:-compiled}_h200.md"]),
    "int4_mm": ("issue 26: hf_lowbit's int4 kernels against tinygemm (aten._weight_int4pack_mm) and bf16 "
                "F.linear on the Llama-8B layer shapes and LM heads, M = 1 and 8 (and the 2048-row prefill path): "
                "ours (the first GEMV, our packed layout), tile (the tile GEMV on tinygemm's own layout, "
                "int4_tile_linear decode='triton'; prefill: tile dequantize + cuBLAS, what Int4ServingLinear "
                "serves), factored (M = 1: decode='triton_factored', the scale and zero out of the sum) and mma (M <= 16: "
                "decode='triton_mma', the bf16 weight on tensor cores), GPU µs (CUDA graph), GB/s of the bytes each must read, the split-K chosen, the largest "
                "difference from tinygemm's output. tile_vs_tinygemm at M = 1 and 8 decides Int4ServingLinear's "
                "decode default (tinygemm until tile wins). SWEEP=--sweep adds the tile GEMV's tiles x split-K at "
                "M = 1 (to set TILE_DECODE_TILES; many Triton compiles). With gemlite's wheel in .whl "
                "(tools/device_prep.sh) its A16W4 linear is a column too (its fast autotune: the shapes take longer; "
                "GEMLITE=--gemlite_autotune max: ~7 min a shape)",
                "38 s measured before the tile GEMV (95d20f0), ~35 s with the factored and mma columns (51cd30c); with gemlite (fast): over 200 s for 5 shapes with "
                "prefill (4a4f0d0, cut at 200 s after 14 of 15 rows); 5-8 min with --sweep (estimate); SWEEP='--sweep "
                "--sweep_kernels mma --shapes 28672x4096,4096x14336,6144x4096,4096x4096 --ms 1 --prefill 0': ~40 s "
                "(3053b85)", [
        "timeout 580 " + B + "benchmark_int4.py ${SWEEP:-} ${GEMLITE:-} --json $OUT/int4_mm_h200.json "
        "--markdown $OUT/int4_mm_h200.md"]),
    "int4_read_probe": ("issue 26: what bounds the int4 GEMVs at one row: a kernel that only reads the tile words "
                        "(the mma GEMV's loads and grid; the same through TMA) beside the mma GEMV, tinygemm and bf16, "
                        "each call on its own weight copy (benchmarks/int4_read_probe.py)", "35 s (4a4a7a2)", [
        "timeout 580 " + B + "int4_read_probe.py --json $OUT/int4_read_probe_h200.json "
        "--markdown $OUT/int4_read_probe_h200.md"]),
    "int4_variants": ("issue 26: the one-row mma GEMV with parts changed (int4_read_probe.py --variants: as served "
                      "before session 26, without the scale epilogue, the bf16 weight first (served since), windowed) "
                      "on the served shapes, 4 tiles x split 1-8, beside tinygemm", "51 s warm (70b92ac)", [
        "timeout 580 " + B + "int4_read_probe.py --variants --json $OUT/int4_variants_h200.json "
        "--markdown $OUT/int4_variants_h200.md"]),
    "serve_int4k": ("issue 26: the int4_tinygemm export served with hf_lowbit's int4 kernels beside compiled_lean "
                    "(torchao's tinygemm weight), bf16 in the same call, under the profiler (GPU ms per decoded token, "
                    "prefill GPU ms), decode at batch 1 (issue 26's bar; BATCHES=1,8 adds 8): compiled_int4k "
                    "(use_int4_kernels(stack_siblings=False) + prepare_for_serving: tinygemm decode, our tile dequantize + "
                    "cuBLAS prefill; compiled_int4k_stacked: stacked siblings, the default), compiled_int4k_triton (decode='triton': our tile GEMV decodes too), and compiled_int4k_factored / compiled_int4k_mma (stacked, decode='triton_factored' / 'triton_mma': our factored GEMVs). Run int4_mm first: if "
                    "a kernel is slower than tinygemm there, this call will say the same. Split if it runs out of "
                    "time: MODES=compiled_lean,compiled_int4k TAG=a, then MODES=compiled_int4k_triton TAG=b "
                    "(each with its own bf16 row)",
                    ("~6-8 min (estimate: serve_profile's 4.8 min for 3 checkpoint x mode pairs at batches 1,8; "
                     "here 6 pairs at batch 1 only; not yet run at 8 layers); LAYERS=32 MODES=compiled_int4k_stacked: 271 s "
                     "(226593a); LAYERS=32 MODES=compiled_int4k,compiled_int4k_stacked: 470 s (55d8bf8); LAYERS=32 "
                     "MODES=compiled_int4k_stacked,compiled_int4k_mma: ~340 s (51cd30c), 455 s (488e6b9, a slower host); "
                     "LAYERS=32 MODES=compiled_int4k_mma: ~400 s (5b8f89c); LAYERS=32 "
                     "MODES=compiled_int4k_stacked,compiled_int4k_mma: 404 s (3a63beb), 326 s (5ed2021)"), [
        "timeout 580 " + B + ("benchmark_serve.py --timeout 420 --layers ${LAYERS:-8} --modes "
                              "${MODES:-compiled_lean,compiled_int4k,compiled_int4k_triton} --batches ${BATCHES:-1} "
                              "--profile --checkpoints qat_int4_tinygemm --json $OUT/serve_int4k_${TAG:-all}_h200.json "
                              "--markdown $OUT/serve_int4k_${TAG:-all}_h200.md")]),
    "serve_fp8k": ("issue 26: the fp8_rowwise export served with hf_lowbit's FP8 kernels (compiled_fp8k: "
                   "use_fp8_kernels + prepare_for_serving: a decode GEMV with the activation quantized inside, "
                   "_scaled_mm for prefill) beside compiled_lean (torchao's Float8Tensor), bf16 in the same call, under "
                   "the profiler. Run fp8_gemv first: if the kernel is slower than _scaled_mm there, this call will say "
                   "the same. MODES, BATCHES (default 1,8), TAG (a suffix of the output files) and TIMEOUT (seconds "
                   "per process, default 300) narrow or stretch it: at LAYERS=32 run MODES=compiled_fp8k BATCHES=1 "
                   "TAG=_l32 TIMEOUT=420 (each compile is ~2-3x longer)", "~5-6 min (estimate at 8 layers); LAYERS=32 "
                   "MODES=compiled_fp8k,compiled_fp8k_stacked BATCHES=1: 466 s (226593a)", [
        "timeout 580 " + B + "benchmark_serve.py --timeout ${TIMEOUT:-300} --layers ${LAYERS:-8} --modes "
        "${MODES:-compiled_lean,compiled_fp8k} --batches ${BATCHES:-1,8} --profile --checkpoints qat_fp8_rowwise "
        "--json $OUT/serve_fp8k${TAG:-}_h200.json --markdown $OUT/serve_fp8k${TAG:-}_h200.md"]),
    # LAYERS (serve, serve_profile, serve_int4k, serve_fp8k): decoder layers of the served model, 8 by default (issue
    # 26's model). At 8 layers generate()'s host loop (~2-3 ms a token) exceeds every checkpoint's GPU time
    # (bf16 1.40 ms, int4 0.92), so decode ratios measure the host; LAYERS=32 (Llama-8B's depth, ~16 GB of bf16
    # weights) weighs the GPU as a served 8B model does (226593a: serve_fp8k and serve_int4k, docs/qat.md).
    "serve_defer": ("issue 26: decode with generate's stop check deferred (hf_lowbit.qat.serving.deferred_stop_check, "
                    "on by default in prepare_for_serving) beside the plain decode, on the same graphs, bf16 in the "
                    "same call, no profiler: at 32 layers (int4 export on decode='triton_mma' 2.14x / 1.87x bf16 at "
                    "batch 1 deferred, 1.60x plain). CHECKPOINTS (default qat_int4_tinygemm), MODES (default "
                    "compiled_int4k_mma), LAYERS (default 32), BATCHES (default 1,8) and TAG name a call: the peer is "
                    "CHECKPOINTS=ptq_int4_tinygemm MODES=compiled_lean TAG=ptq (torchao's tinygemm path), ours and "
                    "the peer in one call: CHECKPOINTS=qat_int4_tinygemm,ptq_int4_tinygemm@compiled_lean BATCHES=1 "
                    "TAG=int4_ptq (NAME@MODE: that checkpoint's own modes), FP8 is "
                    "CHECKPOINTS=qat_fp8_rowwise MODES=compiled_fp8k_stacked TAG=fp8",
                    "32 layers, 2 checkpoints x 1 mode at batches 1,8: ~430 s (88b0f63: 461 s with 33 s of tests); "
                    "8 layers: ~180 s (544c11d)", [
        "timeout 580 " + B + ("benchmark_serve.py --timeout 420 --layers ${LAYERS:-32} --modes "
                              "${MODES:-compiled_int4k_mma} --batches ${BATCHES:-1,8} --reps 5 --defer_stop_check "
                              "--checkpoints ${CHECKPOINTS:-qat_int4_tinygemm} "
                              "--json $OUT/serve_defer_${TAG:-int4}_h200.json "
                              "--markdown $OUT/serve_defer_${TAG:-int4}_h200.md")]),
    "serve_merge": ("issue 26: the serve calls' JSON (and the probe's) joined, ratios kept per call (a call's file "
                    "that is missing is left out, and said so); the PNG needs matplotlib (merge on any machine that "
                    "has it)", "seconds", [
        B + "benchmark_serve.py --merge $OUT/serve_eager_all_h200.json $OUT/serve_compiled_int4_h200.json "
        "$OUT/serve_compiled_fp8_h200.json $OUT/serve_probe_h200.json --json $OUT/serve_h200.json "
        "--markdown $OUT/serve_h200.md --plot $OUT/serve_h200.png"]),
    "fp8_gemv": ("issue 26: the FP8 row-wise linear at decode (M = 1 and 8): our Triton GEMV's two designs in one run "
                 "(fused: activation quantized inside, both absmax choices; codes: quantized once by a row kernel, the "
                 "weight streamed, row sums at M = 1, and codes_dot) vs torchao's path (compiled row quantization + "
                 "_scaled_mm, and its Float8Tensor eagerly) vs bf16 F.linear, a Llama-8B layer's shapes and LM heads, "
                 "µs and GB/s of weight traffic; then the codes design's tile sweep",
                 "~2 + ~3 min (estimate; the fused design's run of session 12 took under 2 min)", [
        B + "benchmark_fp8_gemv.py --json $OUT/fp8_gemv_h200.json --markdown $OUT/fp8_gemv_h200.md",
        B + "benchmark_fp8_gemv.py --sweep --json $OUT/fp8_gemv_sweep_h200.json --markdown $OUT/fp8_gemv_sweep_h200.md"]),
    "qlora_memory": ("peak memory: 32 layers, 1x2048, checkpointing, eager", "~3 min", [
        B + "benchmark_train.py --timeout 150 --layers 32 --batch 1 --grad_checkpointing --no_compile --warmup 1 "
        "--steps 3 --recipes lora_bf16,lora_nf4,lora_nf4_int8 --json $OUT/qlora_memory_h200.json "
        "--markdown $OUT/qlora_memory_h200.md"]),
    "qlora_gc_memory": ("issue 24's open question: with gradient checkpointing at 8x2048 our NF4 + INT8 and PEFT + "
                        "bitsandbytes peak ~7.6 GiB above LoRA on bf16 less their smaller weights (90f002d), which the "
                        "CPU does not show (same saved tensors): saved bytes per layer-token, memory after the forward, "
                        "step and run peaks, what is live at the peak by allocation site; 2 layers, 8x2048, one process "
                        "per variant (CPU smoke-run only; not yet run on a GPU)", "~2 min per command (estimate)", [
        B + "gc_memory_probe.py --variants bf16,bnb,nf4_int8 --snapshot --json $OUT/gc_memory_a.json",
        B + "gc_memory_probe.py --variants nf4_int8_cg,nf4_int8_aot,bnb_aot --snapshot --json $OUT/gc_memory_b.json"]),
    "qlora_nf4": ("the NF4 quantizer vs torchao to_nf4 (128256x4096), quantize-on-load", "~2 min", [
        B + "benchmark_nf4.py --json $OUT/nf4_h200.json --markdown $OUT/nf4_h200.md"]),
    "qlora_nf4_decode": ("the NF4 -> INT8 operand per call on a Llama-8B layer's shapes: our one-pass decode (both "
                         "layouts) vs dequantize-then-quantize, bitsandbytes' dequantize and a copy", "~2 min", [
        B + "benchmark_nf4_decode.py --json $OUT/nf4_decode_h200.json --markdown $OUT/nf4_decode_h200.md"]),
    "qlora_quality": ("LoRA adapters over a bf16-pretrained base, 200 steps", "~4 min", [
        B + "benchmark_quality.py --compile --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_int8_int8 --steps 200 "
        "--pretrain_steps 300 --json $OUT/qlora_quality_h200.json --markdown $OUT/qlora_quality_h200.md "
        "--plot $OUT/qlora_quality_h200.png"]),
    "fsdp2": ("needs 2 GPUs: the FSDP2 bench, 32 layers, 1 and 2 GPUs", "~7 min + ~3 min LoRA", [
        B + "benchmark_fsdp2.py --concurrent --gpus 1,2 --timeout 240 --recipes bf16,int8,fp8,qat_8da4w,torchao_float8 "
        "--json $OUT/fsdp2_h200x2.json --markdown $OUT/fsdp2_h200x2.md --plot $OUT/fsdp2_h200x2.png",
        B + "benchmark_fsdp2.py --concurrent --gpus 1,2 --timeout 150 --recipes lora_bf16,lora_nf4_int8 "
        "--json $OUT/fsdp2_lora_h200x2.json --markdown $OUT/fsdp2_lora_h200x2.md --plot $OUT/fsdp2_lora_h200x2.png"]),
    "fsdp2_regimes": ("needs 2 GPUs: LowBitTrainer under accelerate_configs/fsdp2.yaml, 32 layers, one regime and GPU "
                      "count per call, appended to one file; each launch <= 240 s, so <= 2 launches per call (1-GPU "
                      "runs go two at a time). The calls, in order: BATCH=1 GA=8 GPUS=1 RECIPES=bf16,int8,fp8,lora_bf16; "
                      "BATCH=1 GA=8 GPUS=1 RECIPES=lora_nf4_int8; BATCH=1 GA=8 GPUS=2 RECIPES=bf16,int8, then "
                      "fp8,lora_bf16, then lora_nf4_int8; BATCH=4 GA=1 GPUS=2 the same three (4x2048 does not fit 1 "
                      "GPU)", "<= 8 min per call", [
        B + "benchmark_fsdp2.py --path trainer --concurrent --append --timeout 240 --gpus ${GPUS:?GPUS} "
        "--batch ${BATCH:?BATCH} --grad_accum ${GA:?GA} --recipes ${RECIPES:?RECIPES} --warmup 3 --steps 5 "
        "--json $OUT/fsdp2_regimes_h200x2.json --markdown $OUT/fsdp2_regimes_h200x2.md "
        "--plot $OUT/fsdp2_regimes_h200x2.png"]),
    "fsdp2_sft": ("scripts/sft.py under FSDP2 for each recipe, then a resume from the sharded half-way checkpoint; "
                  "NPROC GPUs (default 1), STEPS (default 40; 4 for a quick CPU check)", "2-3 min", [
        "bash benchmarks/run_fsdp2_h200.sh $OUT"]),
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        for name, (what, how_long, _) in STAGES.items():
            print(f"{name:24s} {how_long:22s} {what}")
        return 0
    if len(argv) != 2 or argv[0] not in STAGES:
        print(f"usage: python benchmarks/run.py STAGE OUTDIR  (--list; stages: {', '.join(STAGES)})", file=sys.stderr)
        return 2
    stage, out = argv
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OUT": os.path.abspath(out), "PYTHONUNBUFFERED": "1"}
    for command in STAGES[stage][2]:
        print("+", command, flush=True)
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env)
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
