"""Training steps with Liger's Triton kernels on the CPU, run by test_liger.py in a subprocess with
TRITON_INTERPRET=1 (set before triton is imported, and Liger's module-level patches stay in that process).

Prints one JSON line: losses and call counts for INT8 full fine-tuning with and without Liger, and QLoRA
(NF4 base, INT8 compute, LoRA) with Liger.

Liger's RMSNorm kernel calls libdevice's ``rsqrt``, which Triton 3.6's interpreter does not implement, so
``rms_norm`` is switched off here (its patching is checked in-process by test_liger.py); the SwiGLU, RoPE and
fused linear cross-entropy kernels run.
"""

import json
import os
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _interpreter_float_args() -> None:
    """Compiled Triton passes a Python float kernel argument as an fp32 scalar; Triton 3.6's interpreter passes
    the bare float, on which Liger's kernels call ``.to(...)`` (``eps``, the SwiGLU multipliers). Do what the
    compiler does, only where the interpreter lacks it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if not isinstance(interpreter._implicit_cvt(1.0), float):
        return
    plain = interpreter._implicit_cvt

    def convert(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return plain(arg)

    interpreter._implicit_cvt = convert


_interpreter_float_args()

import torch  # noqa: E402
from conftest import arithmetic_blocks, tiny_model  # noqa: E402
from peft import LoraConfig  # noqa: E402

from hf_lowbit import LowBitTrainer, LowBitTrainingArguments, MixedPrecisionLinear  # noqa: E402
from hf_lowbit.qlora.base import QuantizedBaseLinear  # noqa: E402

LIGER_CONFIG = {"rms_norm": False}


def run(liger: bool, peft_config=None, **recipe) -> dict:
    import liger_kernel.transformers.swiglu as liger_swiglu

    out = tempfile.mkdtemp()
    args = LowBitTrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, learning_rate=3e-3,
                                   logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True,
                                   lowbit_min_features=16, disable_tqdm=True, optim="adamw_torch",
                                   use_liger_kernel=liger, liger_kernel_config=LIGER_CONFIG if liger else None,
                                   **recipe)
    trainer = LowBitTrainer(tiny_model(), args, train_dataset=arithmetic_blocks(8), peft_config=peft_config)
    model = trainer.model.get_base_model() if peft_config is not None else trainer.model
    calls = {"lowbit": 0, "lm_head": 0, "swiglu": 0}

    def count(key):
        def hook(*_):
            calls[key] += 1
        return hook

    for m in model.modules():
        if isinstance(m, (MixedPrecisionLinear, QuantizedBaseLinear)):
            m.register_forward_hook(count("lowbit"))
    model.lm_head.register_forward_hook(count("lm_head"))
    fused = liger_swiglu._swiglu_dispatch
    liger_swiglu._swiglu_dispatch = lambda *a, **k: (count("swiglu")(), fused(*a, **k))[1]
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    try:
        trainer.train()
    finally:
        liger_swiglu._swiglu_dispatch = fused
    moved = [bool((p.detach() != lora_b[n]).any()) for n, p in trainer.model.named_parameters() if n in lora_b]
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "calls": calls,
            "lora_b_trained": moved}


def main() -> None:
    torch.set_num_threads(1)
    result = {"int8": run(False, int8_mixed_precision=True), "int8_liger": run(True, int8_mixed_precision=True),
              "qlora_liger": run(True, LoraConfig(r=4, target_modules="all-linear"), lora_base_quant="nf4",
                                 int8_mixed_precision=True)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
