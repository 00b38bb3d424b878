#!/usr/bin/env python
"""Supervised fine-tuning and pre-training with hf_lowbit's low-bit recipes (also installed as ``hf-lowbit-sft``).

    python scripts/sft.py                       # embedded default: tiny Llama learns addition, INT8, CPU ok
    python scripts/sft.py --help                # the low-bit, model, data, LoRA and common training flags
    python scripts/sft.py --help_all            # ... and every TrainingArguments flag
    accelerate launch --config_file accelerate_configs/single_gpu.yaml scripts/sft.py \
        --model_name_or_path <hub id or dir> --dataset <hub name or .json/.jsonl/.parquet> \
        --int8_mixed_precision --torch_compile --bf16
    python scripts/sft.py --model_name_or_path <model> --dataset big.jsonl --streaming --max_steps 10000
    python scripts/sft.py --model_name_or_path <model> --token_files tokens/ --token_dtype uint16 --max_steps 10000
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_lowbit.cli.sft import cli  # noqa: E402

if __name__ == "__main__":
    cli()
