#!/usr/bin/env bash
# The H200 measurements behind docs/benchmarks.md, in stages that each fit a 10-minute device call.
#   bash scripts/run_h200_benchmarks.sh train   OUTDIR   # 8-layer training bench, 5 recipes (<=110 s each; 2-layer warm-ups took 3-30 s)
#   bash scripts/run_h200_benchmarks.sh kernels OUTDIR   # linear + per-layout matmuls (~4 min)
#   bash scripts/run_h200_benchmarks.sh quality OUTDIR   # 300-step loss curves bf16/INT8/FP8 (~3 min)
# On the lent H200, carry torchao's wheel (.whl/) and set PYTHONPATH to where it was installed.
set -euo pipefail
stage=${1:?stage: train, kernels or quality}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  train)
    python3 scripts/benchmark_train.py --timeout 110 --json "$out/train_h200.json" --markdown "$out/train_h200.md"
    python3 scripts/plot_benchmark.py "$out/train_h200.json" "$out/train_h200.png" ;;
  kernels)
    python3 scripts/benchmark_linear.py --json "$out/linear_h200.json" --markdown "$out/linear_h200.md"
    python3 scripts/plot_benchmark.py "$out/linear_h200.json" "$out/linear_h200.png"
    python3 scripts/benchmark_mm.py --json "$out/mm_h200.json" --markdown "$out/mm_h200.md" ;;
  quality)
    python3 scripts/benchmark_quality.py --compile --json "$out/quality_h200.json" \
        --markdown "$out/quality_h200.md" --plot "$out/quality_h200.png" ;;
  *) echo "unknown stage $stage (train, kernels or quality)" >&2; exit 2 ;;
esac
