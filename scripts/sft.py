#!/usr/bin/env python
"""Supervised fine-tuning with hf_lowbit's low-bit recipes.

    python scripts/sft.py                       # embedded default: tiny Llama learns addition, INT8, CPU ok
    python scripts/sft.py --help                # every flag (model, data, TrainingArguments, low-bit)
    accelerate launch --config_file accelerate_configs/single_gpu.yaml scripts/sft.py \
        --model_name_or_path <hub id or dir> --dataset <hub name or .json/.jsonl/.parquet> \
        --int8_mixed_precision --torch_compile --bf16
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_lowbit.sft import main  # noqa: E402

if __name__ == "__main__":
    main()
