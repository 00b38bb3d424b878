"""Supervised fine-tuning and pre-training entry point behind ``scripts/sft.py`` / ``hf-lowbit-sft``.

With no ``--model_name_or_path`` and no data flag it runs the embedded default: a tiny Llama-style
model built from a config learns 2-digit addition (generated data, character tokenizer) with INT8
mixed precision, in a few minutes on a laptop CPU. With a model, the data comes from ``--dataset``
(a local file or Hub dataset; ``--streaming`` for corpora larger than memory) or ``--token_files``
(pre-tokenized, memory-mapped). Data is read and checked before the model is loaded.

``main(argv)`` raises on errors (for tests and callers); :func:`cli` is the command line: a user
mistake ends in one line naming the ``--flag`` or the file and line, with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

from .. import atomic
from ..args import LowBitTrainingArguments
from ..data.records import (ARITHMETIC_CHARS, DataFormatError, arithmetic_records, build_char_tokenizer,
                            completion_accuracy)
from ..qat import cuda_capability_problem
from ..warnings import UnsupportedSetupError


class UsageError(ValueError):
    """A mistake in the command line (a flag, a value, a combination); the message names the flag."""


def _at_least(owner, name: str, low, optional: bool = False) -> None:
    """``--name`` must be >= ``low`` (``None`` allowed where ``optional``), else one line naming it."""
    value = getattr(owner, name)
    if not (optional and value is None) and value < low:
        raise UsageError(f"--{name} must be >= {low}, got {value}")


def _fraction(owner, name: str) -> None:
    """``--name`` must be in [0, 1)."""
    value = getattr(owner, name)
    if not 0 <= value < 1:
        raise UsageError(f"--{name} must be in [0, 1), got {value}")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": (
        "Hub model id or local directory of a causal LM. Without it (and without --dataset/--token_files) the "
        "embedded default runs: a tiny Llama built from a config.")})
    model_dtype: str = field(default="auto", metadata={"help": (
        "dtype to load the weights in: auto, bfloat16, float16 or float32.")})

    def __post_init__(self):
        if self.model_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise UsageError(f"--model_dtype must be auto, bfloat16, float16 or float32, got {self.model_dtype!r}")


@dataclass
class DataArguments:
    dataset: str | None = field(default=None, metadata={"help": (
        "Hub dataset name, or a local .json/.jsonl/.parquet file. Records hold 'text', 'messages', "
        "'prompt'+'completion' or 'instruction'(+'input')+'output'. Read with `datasets` (Arrow, memory-mapped, "
        "cached); tokenized once and cached.")})
    dataset_split: str = field(default="train", metadata={"help": "Split to load from a Hub dataset."})
    streaming: bool = field(default=False, metadata={"help": (
        "Read --dataset as a stream (datasets' streaming=True): tokenized on the fly and packed into blocks as "
        "it is read, memory bounded whatever the corpus size; needs --max_steps. Checkpoints record the stream "
        "position, so --resume_from_checkpoint continues from there.")})
    token_files: str | None = field(default=None, metadata={"help": (
        "Pre-training from pre-tokenized data: a directory (or one file) of .npy or raw .bin token files, "
        "memory-mapped and cut into --block_size blocks (the last --eval_fraction of blocks held out).")})
    token_dtype: str = field(default="uint16", metadata={"help": (
        "Token type of raw .bin --token_files: uint16, uint32 or int32 (.npy files carry their own).")})
    block_size: int = field(default=128, metadata={"help": (
        "Tokens per packed training block; every step sees the same shape (what compiled low-bit "
        "training needs).")})
    eval_fraction: float = field(default=0.05, metadata={"help": (
        "Share of records (blocks with --token_files) held out for evaluation.")})
    eval_blocks: int = field(default=0, metadata={"help": (
        "With --streaming: hold out the stream's first N blocks for evaluation (never trained on).")})
    max_records: int | None = field(default=None, metadata={"help": "Use at most this many records."})
    completion_only_loss: bool = field(default=True, metadata={"help": (
        "Loss on the completions only: the tokens of a 'prompt', of an instruction (up to '### Response:') and "
        "of the non-assistant turns of a chat get label -100; 'text' records and --token_files train on every "
        "token. False: train on every token. The embedded default runs with False (as its quoted results did).")})
    dataset_num_proc: int | None = field(default=None, metadata={"help": (
        "Processes that tokenize a --dataset (datasets' map num_proc). Default: one.")})
    arithmetic_train_records: int = field(default=40000, metadata={"help": (
        "Embedded default only: addition problems to train on.")})
    arithmetic_eval_records: int = field(default=200, metadata={"help": (
        "Embedded default only: held-out problems for the final accuracy.")})

    def __post_init__(self):
        _at_least(self, "block_size", 2)
        _fraction(self, "eval_fraction")
        _at_least(self, "max_records", 1, optional=True)
        _at_least(self, "eval_blocks", 0)
        _at_least(self, "dataset_num_proc", 1, optional=True)
        if self.arithmetic_train_records < 1 or self.arithmetic_eval_records < 0:
            raise UsageError("--arithmetic_train_records must be >= 1 and --arithmetic_eval_records >= 0")
        if self.dataset and self.token_files:
            raise UsageError("--dataset and --token_files: give one source of training data")
        if self.streaming and not self.dataset:
            raise UsageError("--streaming streams a --dataset; --token_files are memory-mapped already")


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
        _at_least(self, "lora_r", 1)
        _fraction(self, "lora_dropout")

    def peft_config(self, args: LowBitTrainingArguments):
        """A ``LoraConfig`` when LoRA is asked for (or a quantized base needs it), else None."""
        if not (self.use_lora or args.lora_base_quant):
            return None
        from peft import LoraConfig

        targets = self.lora_target_modules
        targets = targets[0] if targets == ["all-linear"] else targets
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")


# Training settings of the embedded run; any flag given on the command line wins. They are not the
# flags' defaults: with --model_name_or_path the defaults --help shows apply.
EMBEDDED_DEFAULTS = dict(
    output_dir="runs/sft-default", int8_mixed_precision=True, max_steps=1000, per_device_train_batch_size=16,
    per_device_eval_batch_size=16, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=20,
    weight_decay=0.0, logging_steps=50, eval_strategy="steps", eval_steps=250, eval_on_start=True,
    save_strategy="no", report_to="none", seed=0, optim="adamw_torch", dataloader_num_workers=0,
    completion_only_loss=False,  # trains on the whole "a+b=c" as the run in docs/results/sft_default_cpu.json did
)
DATA_FLAGS = ("--dataset", "--token_files")
# The TrainingArguments flags --help shows; --help_all shows all of them.
COMMON_TRAINER_FLAGS = (
    "output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "optim",
    "bf16", "torch_compile", "torch_compile_mode", "gradient_checkpointing", "logging_steps", "eval_strategy",
    "eval_steps", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint", "seed",
    "report_to", "disable_tqdm", "dataloader_num_workers", "use_liger_kernel",
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


def tiny_llama_config(vocab_size: int, block_size: int, **overrides):
    """The embedded default model: 2 layers, hidden 128, about 0.4M parameters."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(block_size, 64),
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    kw.update(overrides)
    return LlamaConfig(**kw)


# ------------------------------------------------------------------------------------- the parser
DESCRIPTION = """\
Fine-tune or pre-train a causal LM with hf_lowbit's low-bit recipes (INT8/FP8 mixed precision, QLoRA, QAT).

  hf-lowbit-sft                                    embedded default (tiny Llama learns addition, INT8, CPU ok)
  hf-lowbit-sft --model_name_or_path M --dataset data.jsonl --int8_mixed_precision --output_dir out
  hf-lowbit-sft --model_name_or_path M --dataset big.jsonl --streaming --max_steps 10000 --block_size 2048
  hf-lowbit-sft --model_name_or_path M --token_files tokens/ --token_dtype uint16 --max_steps 10000
  accelerate launch --config_file accelerate_configs/fsdp2.yaml scripts/sft.py ...   (same flags)

Defaults below are those of a run with --model_name_or_path (transformers' TrainingArguments defaults:
output to trainer_output/, a checkpoint with optimizer state every --save_steps and at the end; give
--save_strategy no for none). The embedded default (no --model_name_or_path) instead uses:
  {embedded}
each overridable by its flag."""


def _flag_args(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        out += [f"--{k}", str(v)]
    return out


def _given(argv: list[str]) -> set[str]:
    """Field names given on the command line (``--x``, ``--x=v``, ``--no_x``)."""
    names = set()
    for a in argv:
        if a.startswith("--"):
            name = a[2:].split("=")[0].replace("-", "_")  # HfArgumentParser also accepts --model-name-or-path
            names.add(name)
            if name.startswith("no_"):
                names.add(name[3:])
    return names


def _embedded_settings(given: set[str]) -> dict:
    settings = dict(EMBEDDED_DEFAULTS)
    if given & {"qat_scheme", "fp8_mixed_precision", "fp8_tensorwise_mixed_precision"}:  # each replaces INT8 compute
        settings["int8_mixed_precision"] = False
    if "qat_scheme" in given:
        settings["qat_group_size"] = 32  # hidden 128: group 32
    if "eval_strategy" in given:  # the user chose when to evaluate
        settings.pop("eval_on_start")
    return {k: v for k, v in settings.items() if k not in given}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def build_parser(show_all: bool = False) -> HfArgumentParser:
    embedded = " ".join(_flag_args(EMBEDDED_DEFAULTS)).replace(" True", "")
    import textwrap

    parser = HfArgumentParser((ModelArguments, DataArguments, LoraArguments, LowBitTrainingArguments),
                              prog="hf-lowbit-sft", formatter_class=_HelpFormatter,
                              usage="hf-lowbit-sft [--model_name_or_path M (--dataset D | --token_files DIR)] [flags]",
                              description=DESCRIPTION.format(embedded="\n  ".join(textwrap.wrap(embedded, 100))),
                              epilog=None if show_all else "--help_all lists every TrainingArguments flag (~100 more).")
    parser.add_argument("--help_all", action="store_true", help="Show every flag, the Trainer's included, and exit.")
    lowbit = {f.name for f in dataclasses.fields(LowBitTrainingArguments)} - \
        {f.name for f in dataclasses.fields(TrainingArguments)}
    groups = [
        ("low-bit recipes (hf_lowbit)", lowbit),
        ("model", {f.name for f in dataclasses.fields(ModelArguments)}),
        ("data", {f.name for f in dataclasses.fields(DataArguments)}),
        ("LoRA", {f.name for f in dataclasses.fields(LoraArguments)}),
        ("training (the most used TrainingArguments)", set(COMMON_TRAINER_FLAGS)),
    ]
    default_group = parser._optionals  # HfArgumentParser puts every dataclass field there
    moved = set()
    for title, dests in groups:
        group = parser.add_argument_group(title)
        for action in list(default_group._group_actions):
            if action.dest in dests:
                default_group._group_actions.remove(action)
                group._group_actions.append(action)
                moved.add(id(action))
    for action in parser._actions:
        if action.dest == "output_dir":  # TrainingArguments' None becomes trainer_output/ in its __post_init__
            action.help = "Where the final model, sft_metrics.json and checkpoints are written."
            action.default = "trainer_output"
        if action.dest == "resume_from_checkpoint":
            action.help = ("A checkpoint-N directory to resume from; True: the last complete checkpoint in "
                           "--output_dir; False: start over. Unset: the last complete checkpoint in --output_dir if "
                           "there is one (a killed run goes on when the same command runs again), else start over.")
    other = parser.add_argument_group("all other TrainingArguments (transformers)")
    for action in list(default_group._group_actions):
        if action.dest in ("help", "help_all"):
            continue
        default_group._group_actions.remove(action)
        other._group_actions.append(action)
        if not show_all:
            action.help = argparse.SUPPRESS
    return parser


_FIELD_RE = re.compile(r"\b(?:LowBitTrainingArguments|TrainingArguments)\.(\w+)")


def _flag_message(message: str, dests: set[str]) -> str:
    """Name the ``--flag`` a CLI user typed, not the dataclass field, in a validation error."""
    message = _FIELD_RE.sub(lambda m: f"--{m.group(1)}", message)
    return re.sub(r"(?<![-\w])([a-z0-9]+(?:_[a-z0-9]+)+)(?![\w(])",
                  lambda m: f"--{m.group(1)}" if m.group(1) in dests else m.group(1), message)


def parse_args(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help_all" in argv:
        build_parser(show_all=True).print_help()
        raise SystemExit(0)
    parser = build_parser()
    given = _given(argv)
    embedded = not ({"model_name_or_path"} | {f[2:] for f in DATA_FLAGS}) & given
    full = _flag_args(_embedded_settings(given)) + argv if embedded else argv
    try:
        model_args, data_args, lora_args, train_args, _ = parser.parse_args_into_dataclasses(args=full)
    except UsageError:
        raise
    except (ValueError, TypeError) as e:  # a dataclass's __post_init__ rejected a value
        dests = {a.dest for a in parser._actions}
        raise UsageError(_flag_message(str(e).strip().splitlines()[0], dests)) from None
    check_training_values(train_args, data_args, embedded)
    from ..integrations.distributed import check_deepspeed

    try:  # what DeepSpeed cannot run, before minutes of data and model loading
        check_deepspeed(train_args)
    except UnsupportedSetupError as e:
        raise UsageError(_flag_message(str(e), {a.dest for a in parser._actions})) from None
    train_args.resume_from_checkpoint = resume_checkpoint(train_args.resume_from_checkpoint, train_args.output_dir)
    if not ({"dataloader_pin_memory", "no_dataloader_pin_memory"} & given) and not torch.cuda.is_available():
        train_args.dataloader_pin_memory = False  # nothing to pin to: spare the DataLoader's warning
    return model_args, data_args, lora_args, train_args, embedded


def check_training_values(args: LowBitTrainingArguments, data_args: DataArguments, embedded: bool) -> None:
    """Reject values the Trainer would take silently and do something odd with."""
    if args.max_steps == 0 or args.max_steps < -1:
        raise UsageError(f"--max_steps must be > 0, or -1 to train for --num_train_epochs; got {args.max_steps}")
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise UsageError(f"--num_train_epochs must be > 0, got {args.num_train_epochs}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        _at_least(args, name, 1)
    _at_least(args, "learning_rate", 0)
    _at_least(args, "warmup_steps", 0)
    for name in ("logging_steps", "save_steps", "eval_steps"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name} must be > 0, got {value}")
    if data_args.streaming and args.max_steps < 1:
        raise UsageError("--streaming needs --max_steps: a stream has no length to count epochs in")
    if data_args.streaming and args.dataloader_num_workers > 1:
        raise UsageError("--streaming with --dataloader_num_workers > 1: each worker would read the whole stream; "
                         "use 0 or 1 (--dataset_num_proc does not apply to a stream)")


def resume_checkpoint(value: str | None, output_dir: str) -> str | None:
    """The checkpoint directory a run resumes from (None: it starts over), for ``--resume_from_checkpoint value``.

    Unset, the last complete ``checkpoint-N`` in ``output_dir`` (checkpoints are renamed into place only once
    written, so a killed save is never one), else none: running the same command again after a kill goes on
    from the last checkpoint. ``True``/``False`` ask for the last one / none, anything else is a checkpoint
    directory, which must hold a ``trainer_state.json``."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if value is None:
        return last
    if value.lower() in ("false", "no", "none"):
        return None
    if value.lower() in ("true", "yes", "last"):
        if last is None:
            raise UsageError(f"--resume_from_checkpoint {value}: no checkpoint in --output_dir {output_dir}; "
                             "leave the flag out to start over")
        return last
    if not os.path.isfile(os.path.join(value, TRAINER_STATE_NAME)):
        raise UsageError(f"--resume_from_checkpoint {value}: not a Trainer checkpoint (no {TRAINER_STATE_NAME}); "
                         "give a checkpoint-N directory, True for the last one in --output_dir, or False")
    return value


# ------------------------------------------------------------------------------------------- data
def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_name_or_path {name!r}: no tokenizer could be loaded "
                         f"({str(e).strip().splitlines()[0][:200]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise UsageError(f"--model_name_or_path {name!r}: the tokenizer has no EOS token, which packing needs "
                         "between documents")
    return tokenizer


def build_data(data_args: DataArguments, tokenizer, seed: int, embedded: bool):
    """(train dataset, eval dataset or None, eval records for the accuracy or None, description)."""
    import datasets as hfds

    from ..data import packing

    bs = data_args.block_size
    completion_only = data_args.completion_only_loss
    if embedded:
        hfds.disable_progress_bars()  # 40000 short records: bars for each step would be noise
        train_records, eval_records = arithmetic_records(data_args.arithmetic_train_records,
                                                         data_args.arithmetic_eval_records, seed=seed)
        locate = lambda i: f"embedded arithmetic, record {i}"  # noqa: E731
        train = packing.packed_dataset(packing.tokenize(hfds.Dataset.from_list(train_records), tokenizer, locate,
                                                        completion_only=completion_only), bs)
        eval_ds = None
        if eval_records:
            try:
                eval_ds = packing.packed_dataset(
                    packing.tokenize(hfds.Dataset.from_list(eval_records), tokenizer, locate,
                                     completion_only=completion_only), bs)
            except ValueError as e:  # a held-out set shorter than one block: no eval loss, training goes on
                warnings.warn(f"no held-out loss: {e} (raise --eval_fraction or lower --block_size)")
        return train, eval_ds, eval_records, "embedded arithmetic"
    if data_args.token_files:
        blocks = packing.TokenFileBlocks(data_args.token_files, bs, data_args.token_dtype)
        vocab = len(tokenizer)
        n_eval = round(len(blocks) * data_args.eval_fraction)
        train, eval_ds = blocks.split(n_eval) if n_eval and n_eval < len(blocks) else (blocks, None)
        top = max(int(a[: 1 << 20].max()) for a in blocks.arrays if len(a))
        if top >= vocab:
            raise DataFormatError(f"--token_files {data_args.token_files}: token id {top} >= the tokenizer's "
                                  f"vocabulary size {vocab} (check --token_dtype and the tokenizer)")
        return train, eval_ds, None, data_args.token_files
    locate = packing.Locator(data_args.dataset)
    if os.path.isfile(data_args.dataset) and os.path.getsize(data_args.dataset) < 64 << 20:
        hfds.disable_progress_bars()  # a small file reads in a blink: its bars would only be noise
    raw = packing.load_raw(data_args.dataset, data_args.dataset_split, streaming=data_args.streaming)
    if data_args.max_records:
        raw = (raw.take(data_args.max_records) if data_args.streaming
               else raw.select(range(min(len(raw), data_args.max_records))))
    if data_args.streaming:
        stream = packing.StreamingBlocks(packing.tokenize(raw, tokenizer, locate, completion_only=completion_only), bs)
        eval_ds = stream.head(data_args.eval_blocks) if data_args.eval_blocks else None
        stream.skip_blocks = len(eval_ds or [])
        if eval_ds is None:
            stream.head(1)  # the first records are read and checked before the model loads
        return stream, eval_ds, None, data_args.dataset
    tokenized = packing.tokenize(raw, tokenizer, locate, num_proc=data_args.dataset_num_proc,
                                 completion_only=completion_only)
    eval_ds = None
    if data_args.eval_fraction > 0 and len(tokenized) > 1:
        n_eval = max(1, round(len(tokenized) * data_args.eval_fraction))
        parts = tokenized.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
        tokenized = parts["train"]
        try:
            eval_ds = packing.packed_dataset(parts["test"], bs)
        except ValueError as e:
            warnings.warn(f"no held-out loss: {e} (raise --eval_fraction or lower --block_size)")
    try:
        train = packing.packed_dataset(tokenized, bs)
    except ValueError as e:
        raise DataFormatError(f"{data_args.dataset}: {e}; lower --block_size or give more data") from None
    return train, eval_ds, None, data_args.dataset


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, lora_args, args, embedded = parse_args(argv)
    if embedded and (data_args.streaming or data_args.token_files):
        raise UsageError("--streaming/--token_files need --model_name_or_path")
    if not embedded and model_args.model_name_or_path is None:
        raise UsageError("--dataset/--token_files need --model_name_or_path (or give neither: the embedded default)")
    if not embedded and not (data_args.dataset or data_args.token_files):
        raise UsageError("--model_name_or_path needs --dataset or --token_files (or give neither: the embedded "
                         "default)")

    # data first: a mistake in it shows before minutes of model loading
    tokenizer = build_char_tokenizer(ARITHMETIC_CHARS) if embedded else _load_tokenizer(model_args.model_name_or_path)
    train_ds, eval_ds, eval_records, source = build_data(data_args, tokenizer, args.seed, embedded)
    if eval_ds is None:
        args.eval_strategy = "no"
        args.eval_on_start = False

    from transformers import AutoModelForCausalLM

    from ..trainer import LowBitTrainer

    if embedded:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), data_args.block_size))
    else:
        dtype = model_args.model_dtype if model_args.model_dtype == "auto" else getattr(torch, model_args.model_dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
        except (OSError, ValueError) as e:  # no such repo or directory; a directory without a model's config
            raise UsageError(f"--model_name_or_path {model_args.model_name_or_path!r}: no model could be loaded "
                             f"({str(e).strip().splitlines()[0][:200]})") from None
    model.config.use_cache = False  # training builds no KV cache (generation turns it back on per call)

    trainer = LowBitTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                            processing_class=tokenizer, callbacks=[timer := StepTimeCallback()],
                            peft_config=lora_args.peft_config(args))
    if args.resume_from_checkpoint and trainer.is_world_process_zero():
        print(f"[hf_lowbit] resuming from {args.resume_from_checkpoint} (--resume_from_checkpoint False starts over)",
              flush=True)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    model.config.use_cache = True  # the saved config serves inference

    acc = trainer.accelerator
    history = trainer.state.log_history
    metrics = {"train_blocks": len(train_ds) if hasattr(train_ds, "__len__") else None,
               "block_size": data_args.block_size, "data": source,
               "distributed_type": str(acc.distributed_type).split(".")[-1], "num_processes": acc.num_processes,
               "train_losses": [h["loss"] for h in history if "loss" in h]}
    if metrics["train_blocks"] is None:  # streaming: blocks seen
        metrics["train_blocks"] = trainer.state.global_step * args.per_device_train_batch_size * \
            args.gradient_accumulation_steps * args.world_size
    first_eval = next((h for h in history if "eval_loss" in h), None)
    if first_eval is not None and first_eval.get("step") == 0:
        metrics["initial_eval_loss"] = first_eval["eval_loss"]
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
    no_export = args.qat_scheme is not None and cuda_capability_problem(args.qat_scheme)
    if no_export:  # a GPU scheme trained without its GPU (LowBitTrainer warned): the plain checkpoint is the result
        metrics["quantized_dir"] = None
        print(f"[hf_lowbit] {args.qat_scheme} export skipped: {no_export}; export {args.output_dir} where that GPU is "
              "(docs/qat.md, 'Where they convert')")
    elif args.qat_scheme is not None:  # every rank: a distributed run gathers the model, rank 0 writes it
        quantized_dir = os.path.join(args.output_dir, "quantized")  # converted: loads with from_pretrained
        trainer.save_quantized(quantized_dir)
        metrics["quantized_dir"] = quantized_dir
    if trainer.is_world_process_zero():
        atomic.write_json(os.path.join(args.output_dir, "sft_metrics.json"), metrics)
        print("[hf_lowbit] final: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in metrics.items() if not isinstance(v, list)))
        print(f"[hf_lowbit] model and tokenizer saved to {args.output_dir}")
        if quantized_dir:
            print(f"[hf_lowbit] {args.qat_scheme} quantized checkpoint saved to {quantized_dir}")
    return metrics


USER_ERRORS = (UsageError, DataFormatError, UnsupportedSetupError)


def cli(argv: list[str] | None = None) -> None:
    """The ``hf-lowbit-sft`` command: user mistakes end in one line on stderr and exit status 2;
    anything else is our bug and keeps its traceback."""
    def one_line(message, category, filename, lineno, file=None, line=None):
        print(f"[hf_lowbit] {category.__name__}: {message}", file=file or sys.stderr)

    warnings.showwarning = one_line  # the CLI's warnings are messages to read, not code locations
    try:
        main(argv)
    except USER_ERRORS as e:
        print(f"hf-lowbit-sft: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
