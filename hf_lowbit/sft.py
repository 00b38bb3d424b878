"""Supervised fine-tuning entry point behind ``scripts/sft.py``.

With no ``--model_name_or_path`` and no ``--dataset`` it runs the embedded default: a tiny
Llama-style model built from a config learns 2-digit addition (generated data, character tokenizer)
with INT8 mixed precision, in a few minutes on a laptop CPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig, TrainerCallback

from .args import LowBitTrainingArguments
from .data import (ARITHMETIC_CHARS, arithmetic_records, build_char_tokenizer, completion_accuracy,
                   format_records, load_records, pack, split_records)
from .trainer import LowBitTrainer


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": (
        "Hub model id or local directory of a causal LM. Default: a tiny Llama built from a config "
        "(the embedded default run).")})
    model_dtype: str = field(default="auto", metadata={"help": (
        "dtype to load the weights in: auto, bfloat16, float16 or float32.")})

    def __post_init__(self):
        if self.model_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--model_dtype must be auto, bfloat16, float16 or float32, got {self.model_dtype!r}")


@dataclass
class DataArguments:
    dataset: str | None = field(default=None, metadata={"help": (
        "Hub dataset name, or a local .json/.jsonl/.parquet file. Records hold 'text', 'messages', "
        "'prompt'+'completion' or 'instruction'(+'input')+'output'. Default: generated addition problems.")})
    dataset_split: str = field(default="train", metadata={"help": "Split to load from a Hub dataset."})
    block_size: int = field(default=128, metadata={"help": (
        "Tokens per packed training block; every step sees the same shape (what compiled low-bit "
        "training needs).")})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of records held out for evaluation."})
    max_records: int | None = field(default=None, metadata={"help": "Use at most this many records."})
    arithmetic_train_records: int = field(default=40000, metadata={"help": (
        "Embedded default only: addition problems to train on.")})
    arithmetic_eval_records: int = field(default=200, metadata={"help": (
        "Embedded default only: held-out problems for the final accuracy.")})

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"--block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.max_records is not None and self.max_records < 1:
            raise ValueError(f"--max_records must be >= 1, got {self.max_records}")


@dataclass
class LoraArguments:
    use_lora: bool = field(default=False, metadata={"help": (
        "Train LoRA adapters (PEFT) instead of the full model; implied by --lora_base_quant.")})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={"help": (
        "Module names (or 'all-linear': every linear but the LM head, quantized bases included) that get adapters.")})

    def __post_init__(self):
        if self.lora_r < 1:
            raise ValueError(f"--lora_r must be >= 1, got {self.lora_r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")

    def peft_config(self, args: LowBitTrainingArguments):
        """A ``LoraConfig`` when LoRA is asked for (or a quantized base needs it), else None."""
        if not (self.use_lora or args.lora_base_quant):
            return None
        from peft import LoraConfig

        targets = self.lora_target_modules
        targets = targets[0] if targets == ["all-linear"] else targets
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")


# Training defaults of the embedded run; any flag given on the command line wins.
EMBEDDED_DEFAULTS = dict(
    output_dir="runs/sft-default", int8_mixed_precision=True, max_steps=1000, per_device_train_batch_size=16,
    per_device_eval_batch_size=16, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=20,
    weight_decay=0.0, logging_steps=50, eval_strategy="steps", eval_steps=250, save_strategy="no",
    report_to="none", seed=0, optim="adamw_torch", dataloader_num_workers=0,
)


class StepTimeCallback(TrainerCallback):
    """Mean wall time per step after the first third of the steps (compile/autotune warm-up);
    evaluation and logging that fall between steps count in it."""

    def __init__(self):
        self.marks: list[tuple[int, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append((state.global_step, time.perf_counter()))

    def step_ms(self) -> float | None:
        if len(self.marks) < 6:
            return None
        (s0, t0), (s1, t1) = self.marks[len(self.marks) // 3], self.marks[-1]
        return 1000 * (t1 - t0) / (s1 - s0)


def tiny_llama_config(vocab_size: int, block_size: int, **overrides) -> LlamaConfig:
    """The embedded default model: 2 layers, hidden 128, about 0.4M parameters."""
    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(block_size, 64),
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    kw.update(overrides)
    return LlamaConfig(**kw)


def parse_args(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser((ModelArguments, DataArguments, LoraArguments, LowBitTrainingArguments))
    embedded = not any(a.split("=")[0] in ("--model_name_or_path", "--dataset") for a in argv)
    if embedded:
        defaults = dict(EMBEDDED_DEFAULTS)
        if any(a.split("=")[0] == "--qat_scheme" for a in argv):  # QAT replaces INT8 compute; hidden 128: group 32
            defaults.update(int8_mixed_precision=False, qat_group_size=32)
        parser.set_defaults(**defaults)
    model_args, data_args, lora_args, train_args = parser.parse_args_into_dataclasses(args=argv)
    return model_args, data_args, lora_args, train_args, embedded


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, lora_args, args, embedded = parse_args(argv)
    if (model_args.model_name_or_path is None) != (data_args.dataset is None):
        raise SystemExit("give both --model_name_or_path and --dataset, or neither (the embedded default)")

    eval_records = None
    if embedded:
        tokenizer = build_char_tokenizer(ARITHMETIC_CHARS)
        train_records, eval_records = arithmetic_records(data_args.arithmetic_train_records,
                                                         data_args.arithmetic_eval_records, seed=args.seed)
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), data_args.block_size))
        source = "embedded arithmetic"
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        dtype = model_args.model_dtype if model_args.model_dtype == "auto" else getattr(torch, model_args.model_dtype)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
        records = load_records(data_args.dataset, data_args.dataset_split)
        if data_args.max_records:
            records = records[: data_args.max_records]
        train_records, eval_records = split_records(records, data_args.eval_fraction, args.seed)
        source = data_args.dataset

    model.config.use_cache = False  # training builds no KV cache (generation turns it back on per call)
    train_ds = pack(format_records(train_records, tokenizer, source), tokenizer, data_args.block_size)
    eval_ds = None
    if eval_records:
        eval_texts = format_records(eval_records, tokenizer, source + " (eval)")
        try:
            eval_ds = pack(eval_texts, tokenizer, data_args.block_size)
        except ValueError as e:  # a held-out set shorter than one block: no eval loss, training goes on
            warnings.warn(f"no held-out loss: {e} (raise --eval_fraction or lower --block_size)")
    if eval_ds is None:
        args.eval_strategy = "no"

    trainer = LowBitTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                            processing_class=tokenizer, callbacks=[timer := StepTimeCallback()],
                            peft_config=lora_args.peft_config(args))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    model.config.use_cache = True  # the saved config serves inference

    acc = trainer.accelerator
    metrics = {"train_blocks": len(train_ds), "block_size": data_args.block_size,
               "distributed_type": str(acc.distributed_type).split(".")[-1], "num_processes": acc.num_processes,
               "train_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if timer.step_ms() is not None:
        metrics["train_step_ms"] = timer.step_ms()
    if eval_ds is not None:
        ev = trainer.evaluate()
        metrics.update(eval_loss=ev["eval_loss"], eval_perplexity=math.exp(min(ev["eval_loss"], 50)))
    if embedded:
        metrics["eval_accuracy"] = completion_accuracy(trainer.model, tokenizer, eval_records)
    if trainer.is_fsdp_enabled:  # checkpoints stay sharded; the final model is gathered to rank 0, written once
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(args.output_dir)
    quantized_dir = None
    if args.qat_scheme is not None:  # every rank: a distributed run gathers the model, rank 0 writes it
        quantized_dir = os.path.join(args.output_dir, "quantized")  # converted: loads with from_pretrained
        trainer.save_quantized(quantized_dir)
        metrics["quantized_dir"] = quantized_dir
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "sft_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        print("[hf_lowbit] final: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in metrics.items() if not isinstance(v, list)))
        print(f"[hf_lowbit] model and tokenizer saved to {args.output_dir}")
        if quantized_dir:
            print(f"[hf_lowbit] {args.qat_scheme} quantized checkpoint saved to {quantized_dir}")
    return metrics
