#!/usr/bin/env bash
# The H200 measurements behind docs/benchmarks.md, in stages that each fit a 10-minute device call.
#   bash benchmarks/run_h200_benchmarks.sh cuda_tests OUTDIR # every test with "cuda" in its id, fast ones first (~4-5 min: autotune)
#   BLOCKS=... bash benchmarks/run_h200_benchmarks.sh regimes OUTDIR  # 1x2048 / 8x2048, grad accumulation, layers and
#                                                            # Trainer paths, QLoRA vs bitsandbytes (docs/benchmarks.md "Regimes")
#   BLOCKS=... bash benchmarks/run_h200_benchmarks.sh qlora_regimes OUTDIR  # QLoRA vs LoRA on bf16 vs bitsandbytes,
#                                                            # layers and Trainer paths (docs/benchmarks.md "QLoRA regimes")
#   bash benchmarks/run_h200_benchmarks.sh train   OUTDIR   # 8-layer bench, 7 recipes + profile (~50-70 s each, ~6 min)
#   bash benchmarks/run_h200_benchmarks.sh kernels OUTDIR   # linear + per-layout matmuls (~4 min) + mm_backends with
#                                                            # --sweep --quant (~1 min on the H200)
#   bash benchmarks/run_h200_benchmarks.sh quality OUTDIR   # 300-step loss curves bf16/INT8/FP8 (> 170 s: give it ~5 min)
#   bash benchmarks/run_h200_benchmarks.sh quality_parity OUTDIR  # issue 14's loss parity: 143M Llama, 1,500 steps,
#                                                            # bf16/INT8/FP8 at once on one GPU, each layer compiled; compiled
#                                                            # whole, INT8 did not finish in 330 s beside the CUDA tests:
#                                                            # run it alone in a call
#   BATCH=16 bash benchmarks/run_h200_benchmarks.sh seed_table OUTDIR  # issue 18's seed table: TinyLlama-1.1B shape,
#                                                            # 16x2048 real-text tokens, bf16 + 5 INT8 rows (~7-8 min)
#   bash benchmarks/run_h200_benchmarks.sh sr_quality OUTDIR   # bf16 / INT8 / INT8+SR late in training: 300 bf16 steps,
#                                                            # then 200 steps at lr 3e-5 each (~3-4 min)
#   bash benchmarks/run_h200_benchmarks.sh qlora_train OUTDIR   # LoRA r16 over bf16/NF4/INT8 bases beside the torchao NF4
#                                                            # (+ torchao INT8) peers, 8 layers 8x2048, bf16 autocast as
#                                                            # Trainer(bf16=True) runs it, one run (~7 min)
#   bash benchmarks/run_h200_benchmarks.sh qlora_train_noautocast OUTDIR  # the same without autocast: PEFT's float32
#                                                            # adapters then compute in float32 (~3 min)
#   bash benchmarks/run_h200_benchmarks.sh qat OUTDIR           # QAT 8da4w beside bf16 and torchao's QAT (8 layers 8x2048),
#                                                            # then benchmarks/eval_qat.py at group 256 (~6 min)
#   bash benchmarks/run_h200_benchmarks.sh qlora_memory OUTDIR  # peak memory: 32 layers, 1x2048, checkpointing (eager)
#   bash benchmarks/run_h200_benchmarks.sh qlora_nf4 OUTDIR     # NF4 quantizer vs torchao to_nf4 (128256x4096), quantize-on-load
#   bash benchmarks/run_h200_benchmarks.sh qlora_quality OUTDIR # LoRA adapters over a bf16-pretrained base, 200 steps
#   bash benchmarks/run_h200_benchmarks.sh fsdp2 OUTDIR         # needs 2 GPUs: FSDP2 bench, 32 layers, 1 and 2 GPUs (~7 min + ~3 min LoRA)
#   GPUS=.. BATCH=.. GA=.. RECIPES=.. bash benchmarks/run_h200_benchmarks.sh fsdp2_regimes OUTDIR  # needs 2 GPUs: the
#                                                            # Trainer path under FSDP2, appended per call (see the stage)
# Export HF_LOWBIT_COMMIT (the commit you measure) in the device command: the copied tree's git metadata there
# is the session's starting commit. On the lent H200, carry torchao's wheel (.whl/) and set PYTHONPATH to where it was installed.
set -euo pipefail
stage=${1:?stage: cuda_tests, regimes, qlora_regimes, train, kernels, quality, quality_parity, seed_table, sr_quality, qat, fsdp2, fsdp2_regimes or qlora_*}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  cuda_tests)  # the quick kernel checks first: the Triton matmul check autotunes ~24 shape/layout keys
    python3 -m pytest -q -p no:cacheprovider -k cuda tests/ --deselect tests/test_triton_int8.py::test_triton_int8_scaled_mm_cuda \
        2>&1 | tee "$out/pytest_cuda.txt"
    python3 -m pytest -q -p no:cacheprovider tests/test_triton_int8.py::test_triton_int8_scaled_mm_cuda \
        2>&1 | tee -a "$out/pytest_cuda.txt" ;;
  regimes)  # BLOCKS: comma-separated blocks of benchmark_regimes.py (default all: ~25 min, so split them over
           # calls or GPUs, e.g. BLOCKS=layers_b1,layers_b8 on GPU 0 beside BLOCKS=trainer_b1_ga8 on GPU 1);
           # the *_liger blocks (~5 min each) need liger-kernel: carry its wheel in .whl/ like torchao's
    python3 benchmarks/benchmark_regimes.py --timeout 240 --blocks "${BLOCKS:-all}" --keep_dir "$out" \
        --json "$out/regimes_h200.json" --markdown "$out/regimes_h200.md" ;;
  qlora_regimes)  # issue 24: LoRA r16 over a bf16 base / our NF4+INT8 and INT8+INT8 bases / PEFT + bitsandbytes (carry
                  # its wheel), layers and Trainer paths; BLOCKS: a subset of the qlora_* blocks (~4-5 min per block)
    python3 benchmarks/benchmark_regimes.py --timeout 200 --keep_dir "$out" \
        --blocks "${BLOCKS:-qlora_b1,qlora_trainer_b1_ga8,qlora_trainer_b8,qlora_trainer_b1_ga8_gc,qlora_trainer_b8_gc}" \
        --json "$out/qlora_regimes_h200.json" --markdown "$out/qlora_regimes_h200.md" ;;
  train)
    python3 benchmarks/benchmark_train.py --timeout 110 --profile --json "$out/train_h200.json" --markdown "$out/train_h200.md"
    python3 benchmarks/plot_benchmark.py "$out/train_h200.json" "$out/train_h200.png" ;;
  kernels)
    python3 benchmarks/benchmark_linear.py --json "$out/linear_h200.json" --markdown "$out/linear_h200.md"
    python3 benchmarks/plot_benchmark.py "$out/linear_h200.json" "$out/linear_h200.png"
    python3 benchmarks/benchmark_mm.py --json "$out/mm_h200.json" --markdown "$out/mm_h200.md"
    python3 benchmarks/benchmark_mm_backends.py --sweep --quant --json "$out/mm_backends_h200.json" \
        --markdown "$out/mm_backends_h200.md" ;;
  quality)
    python3 benchmarks/benchmark_quality.py --compile --json "$out/quality_h200.json" \
        --markdown "$out/quality_h200.md" --plot "$out/quality_h200.png" ;;
  quality_parity)  # the corpus adds installed packages' docstrings (~5.6M tokens) so 1,500 steps do not repeat it
    timeout 570 python3 benchmarks/benchmark_quality.py --compile_layers --parallel --corpus_packages torch,transformers,sympy,networkx,numpy \
        --layers 12 --hidden 1024 --intermediate 2816 --heads 16 --kv_heads 4 --seq 256 --batch 8 --steps 1500 \
        --warmup 100 --lr 3e-4 --json "$out/quality_parity_h200.json" --markdown "$out/quality_parity_h200.md" \
        --plot "$out/quality_parity_h200.png" ;;
  seed_table)  # BATCH: 16 as in the seed; if bf16 runs out of memory the script says so: rerun with BATCH=8
    python3 benchmarks/benchmark_seed_table.py --batch "${BATCH:-16}" --timeout 170 --json "$out/seed_table_h200.json" \
        --markdown "$out/seed_table_h200.md" --plot "$out/seed_table_h200.png" ;;
  sr_quality)
    python3 benchmarks/benchmark_quality.py --compile --recipes bf16,int8,int8_sr --pretrain_steps 300 --late_lr 3e-5 \
        --steps 200 --json "$out/sr_quality_h200.json" --markdown "$out/sr_quality_h200.md" --plot "$out/sr_quality_h200.png" ;;
  qlora_train)
    python3 benchmarks/benchmark_train.py --timeout 110 --autocast --json "$out/qlora_train_h200.json" \
        --markdown "$out/qlora_train_h200.md" \
        --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_nf4_int8cache,lora_int8_int8,lora_torchao_nf4,lora_torchao_nf4_int8
    python3 benchmarks/plot_benchmark.py "$out/qlora_train_h200.json" "$out/qlora_train_h200.png" ;;
  qlora_train_noautocast)
    python3 benchmarks/benchmark_train.py --timeout 110 --json "$out/qlora_train_noautocast_h200.json" \
        --markdown "$out/qlora_train_noautocast_h200.md" --recipes lora_bf16,lora_nf4_int8,lora_int8_int8 ;;
  qat)
    python3 benchmarks/benchmark_train.py --timeout 150 --recipes bf16,qat_8da4w,torchao_qat_8da4w \
        --json "$out/train_qat_h200.json" --markdown "$out/train_qat_h200.md"
    python3 benchmarks/plot_benchmark.py "$out/train_qat_h200.json" "$out/train_qat_h200.png"
    python3 benchmarks/eval_qat.py --group_size 256 --json "$out/qat_h200.json" --markdown "$out/qat_h200.md" ;;
  qlora_memory)
    python3 benchmarks/benchmark_train.py --timeout 150 --layers 32 --batch 1 --grad_checkpointing --no_compile \
        --warmup 1 --steps 3 --recipes lora_bf16,lora_nf4,lora_nf4_int8 \
        --json "$out/qlora_memory_h200.json" --markdown "$out/qlora_memory_h200.md" ;;
  qlora_nf4)
    python3 benchmarks/benchmark_nf4.py --json "$out/nf4_h200.json" --markdown "$out/nf4_h200.md" ;;
  qlora_quality)
    python3 benchmarks/benchmark_quality.py --compile --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_int8_int8 \
        --steps 200 --pretrain_steps 300 --json "$out/qlora_quality_h200.json" \
        --markdown "$out/qlora_quality_h200.md" --plot "$out/qlora_quality_h200.png" ;;
  fsdp2)
    python3 benchmarks/benchmark_fsdp2.py --concurrent --gpus 1,2 --timeout 240 \
        --recipes bf16,int8,fp8,qat_8da4w,torchao_float8 --json "$out/fsdp2_h200x2.json" \
        --markdown "$out/fsdp2_h200x2.md" --plot "$out/fsdp2_h200x2.png"
    python3 benchmarks/benchmark_fsdp2.py --concurrent --gpus 1,2 --timeout 150 --recipes lora_bf16,lora_nf4_int8 \
        --json "$out/fsdp2_lora_h200x2.json" --markdown "$out/fsdp2_lora_h200x2.md" --plot "$out/fsdp2_lora_h200x2.png" ;;
  fsdp2_regimes)  # needs 2 GPUs. LowBitTrainer under accelerate_configs/fsdp2.yaml, 32 layers, one regime and GPU count
                  # per call, appended to one file (docs/results/fsdp2_regimes_h200x2.json); each launch <= 240 s, so
                  # keep <= 2 launches per call (1-GPU runs go two at a time). The calls, in order:
                  #   BATCH=1 GA=8 GPUS=1 RECIPES=bf16,int8,fp8,lora_bf16   (2 rounds of 2 concurrent launches)
                  #   BATCH=1 GA=8 GPUS=1 RECIPES=lora_nf4_int8
                  #   BATCH=1 GA=8 GPUS=2 RECIPES=bf16,int8   then fp8,lora_bf16   then lora_nf4_int8
                  #   BATCH=4 GA=1 GPUS=2 RECIPES=bf16,int8   then fp8,lora_bf16   then lora_nf4_int8  (4x2048 does not fit 1 GPU)
    python3 benchmarks/benchmark_fsdp2.py --path trainer --concurrent --append --timeout 240 --gpus "${GPUS:?GPUS}" \
        --batch "${BATCH:?BATCH}" --grad_accum "${GA:?GA}" --recipes "${RECIPES:?RECIPES}" --warmup 3 --steps 5 \
        --json "$out/fsdp2_regimes_h200x2.json" --markdown "$out/fsdp2_regimes_h200x2.md" \
        --plot "$out/fsdp2_regimes_h200x2.png" ;;
  *) echo "unknown stage $stage (cuda_tests, regimes, qlora_regimes, train, kernels, quality, quality_parity, seed_table, sr_quality, fsdp2, fsdp2_regimes, qlora_train, qlora_train_noautocast, qat, qlora_memory, qlora_nf4, qlora_quality)" >&2; exit 2 ;;
esac
