#!/usr/bin/env bash
# FSDP2 run of each landed recipe through `accelerate launch` (bf16 FSDP mixed precision, the embedded
# tiny model) on NPROC GPUs (default 1), then a resume from the sharded half-way checkpoint; writes
# OUTDIR/fsdp2_h200.json: {recipe: {losses, resumed_losses, distributed_type, ...}}. ~2-3 min on an H200.
#   bash benchmarks/run_fsdp2_h200.sh OUTDIR          # STEPS=4 for a quick CPU check of the plumbing
#   NPROC=2 bash benchmarks/run_fsdp2_h200.sh OUTDIR  # 2 GPUs
set -euo pipefail
out=${1:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=${STEPS:-40}
half=$((steps / 2))
run="--max_steps $steps --logging_steps $((steps >= 20 ? 5 : 1)) --eval_strategy no --save_strategy steps --save_steps $half
     --arithmetic_train_records 4000 --arithmetic_eval_records 50 --disable_tqdm True --report_to none"
launch() { accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes "${NPROC:-1}" scripts/sft.py $run "$@"; }
declare -A recipes=([int8_mixed_precision]="--int8_mixed_precision True"
                     [fp8_mixed_precision]="--fp8_mixed_precision True"
                     [qat]="--qat_scheme 8da4w"
                     [qlora_nf4_int8]="--lora_base_quant nf4 --int8_mixed_precision True")
recipe_list=${RECIPES:-int8_mixed_precision fp8_mixed_precision qat qlora_nf4_int8}
for recipe in $recipe_list; do
  flags="--int8_mixed_precision False --fp8_mixed_precision False ${recipes[$recipe]}"
  launch $flags --output_dir "$out/$recipe"
  launch $flags --output_dir "$out/$recipe-resumed" --resume_from_checkpoint "$out/$recipe/checkpoint-$half"
done
python3 - "$out" "$half" $recipe_list <<'PY'
import json, os, sys
out, half = sys.argv[1], sys.argv[2]
result = {}
for recipe in sys.argv[3:]:
    m = json.load(open(os.path.join(out, recipe, "sft_metrics.json")))
    r = json.load(open(os.path.join(out, recipe + "-resumed", "sft_metrics.json")))
    result[recipe] = {"distributed_type": m["distributed_type"], "num_processes": m["num_processes"],
                      "losses": m["train_losses"], "resumed_losses": r["train_losses"],
                      "eval_loss": m.get("eval_loss"), "eval_accuracy": m.get("eval_accuracy"),
                      "sharded_checkpoint": os.path.isdir(os.path.join(out, recipe, f"checkpoint-{half}", "pytorch_model_fsdp_0")),
                      "final_model": any(os.path.isfile(os.path.join(out, recipe, f)) for f in ("model.safetensors", "adapter_model.safetensors")),
                      "quantized_export": m.get("quantized_dir"),
                      # a resumed run that started from scratch would have saved its own half-way checkpoint
                      "resume_skipped_first_half": not os.path.exists(os.path.join(out, recipe + "-resumed", f"checkpoint-{half}"))}
json.dump(result, open(os.path.join(out, "fsdp2_h200.json"), "w"), indent=2)
print(json.dumps(result, indent=2))
PY
