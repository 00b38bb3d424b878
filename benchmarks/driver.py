"""The one driver of the benchmarks (not part of the ``hf_lowbit`` package): every script in ``benchmarks/`` builds
its model, applies its recipes, times its steps, writes its records and draws its plots with what is here, and
adds only what it varies (benchmarks/README.md lists them).

* the run: :func:`git_commit`, :func:`meta` (what a result records about the machine and the code);
* the model: :func:`add_int_flags`, :func:`llama_config`, :func:`build_model` (a recipe applied and checked);
* the recipes: ours (through ``LowBitTrainingArguments`` + ``prepare_model``) and the peers' (torchao,
  bitsandbytes), :func:`apply_recipe` / :func:`apply_lora_recipe` / :func:`recipe_args`, :func:`compile_layers`;
* a training step and its timing: :func:`train_step`, :func:`timed_steps`, :func:`median_ms`, :func:`graph_ms`,
  :func:`kernel_profile`;
* records: :func:`run_worker` (one process per recipe, its ``RESULT`` line), :func:`save_json`,
  :func:`write_results` (JSON + markdown, the commit named; both through :func:`write_atomic`), :func:`error_cell`;
* plots: :func:`bar_plot`, :func:`plot_results` (``python benchmarks/driver.py plot IN.json OUT.png``);
* :func:`allow_fsdp_on_cpu`: FSDP2 in gloo CPU processes, for the CPU checks of the distributed paths.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------------- the run
def git_commit() -> str:
    """The commit the measured code is at: ``HF_LOWBIT_COMMIT`` if set (a copy without ``.git``, e.g. on a lent
    GPU machine: export it before the run), else ``git rev-parse --short HEAD`` plus ``+dirty`` when tracked
    files differ from it, else ``"unknown"``."""
    if os.environ.get("HF_LOWBIT_COMMIT"):
        return os.environ["HF_LOWBIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")




def meta(device: str, key: str = "gpu", **more) -> dict:
    """What every result records: the commit, the accelerator (under ``key``: "gpu" or "device"; off CUDA the
    device's name), torch, Python and the command line; ``more`` adds to it."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return {"commit": git_commit(), key: name, "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(sys.argv), **more}


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


# ------------------------------------------------------------------------------------------------------ the model
def add_int_flags(parser, **defaults) -> None:
    """``--name`` integer flags with their defaults (the model's shape, batch, steps, ...)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)


def llama_config(a, vocab: int | None = None):
    """A Llama of the flags' shape (``a.hidden``, ``a.intermediate``, ``a.layers``, ``a.heads``, ``a.kv_heads``,
    ``a.vocab`` unless ``vocab``, ``a.seq`` positions), untied embeddings, no KV cache."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=vocab or a.vocab,
                       max_position_embeddings=a.seq, tie_word_embeddings=False,
                       use_cache=False)  # training: no KV cache (it also costs a recompile per layer)


# ---------------------------------------------------------------------------------------------------- the recipes
# fp8_tensorwise: FP8 with one scale per tensor (fp8_tensorwise_mixed_precision); its peer torchao_float8_tensorwise is
# torchao's "tensorwise" float8 recipe as torchao_float8 is its "rowwise" one
RECIPES = ("bf16", "int8", "fp8", "fp8_tensorwise", "torchao_int8", "torchao_float8", "torchao_float8_tensorwise",
           "qat_8da4w", "torchao_qat_8da4w")
# INT8 with matmuls switched off and/or stochastic rounding (the rows of issue 18's seed table,
# benchmark_seed_table.py): "fwd" = only Y = X·Wᵀ in INT8, "fwd_gi" = also dX, "_sr" = stochastic rounding
INT8_VARIANTS = {
    "int8_fwd": dict(lowbit_grad_input=False, lowbit_grad_weight=False),
    "int8_fwd_sr": dict(lowbit_grad_input=False, lowbit_grad_weight=False, lowbit_stochastic_rounding=True),
    "int8_fwd_gi": dict(lowbit_grad_weight=False),
    "int8_fwd_gi_sr": dict(lowbit_grad_weight=False, lowbit_stochastic_rounding=True),
    "int8_sr": dict(lowbit_stochastic_rounding=True),
}
# INT8 / FP8 with the weight cache on whatever the accumulation (LowBitTrainer turns it on only with accumulation)
CACHE_VARIANTS = {"int8_cache": "int8", "fp8_cache": "fp8"}
# INT8 / FP8 with one of MixedPrecisionConfig's backward switches on (its LowBitTrainingArguments flag is
# lowbit_<field>), to measure against int8 / fp8 in the same run (issue 25): dY quantized for both gradient matmuls by
# one op (hf_lowbit::quantize_dual); X's weight-gradient codes made in the forward and kept instead of X; the LM head's
# three matmuls in the format too (issue 25's directions: the largest matmul at 32k-128k vocab). (The fused MLP,
# <fmt>_swiglu, is one of LEVER_VARIANTS.)
SWITCH_VARIANTS = {f"{fmt}_{suffix}": (fmt, field) for fmt in ("int8", "fp8")
                   for suffix, field in (("dual", "dual_grad_quant"), ("xcodes", "save_x_codes"),
                                         ("head", "include_lm_head"))}
# INT8 / FP8 with the weight gradient accumulated by its matmul (lowbit_fused_grad_accum, issue 25; off by default)
# against autograd's separate add: the layers path's hand loop calls FusedGradAccumulation.prepare before each
# micro-batch, LowBitTrainer does it itself
FGA_VARIANTS = {f"{fmt}_fga": fmt for fmt in ("int8", "fp8")}
# Issue 25's two levers, set explicitly (unset: both on for INT8/FP8 full fine-tuning on CUDA since session 34, what
# int8 / fp8 run there). LowBitAdamW (lowbit_fused_adamw): AdamW in one Triton pass for each parameter of >= 2**20
# elements, a pass that for a cached per-row weight also leaves its row absmax (the refresh then reads the weight once).
# The fused MLP (lowbit_fused_swiglu): each MLP as one function whose SwiGLU and its row codes are one Triton kernel
# each way (LowBitSwiGLUMLP). recipe -> (format, None for bf16; LowBitAdamW; the fused MLP; the weight cache forced on:
# with gradient accumulation LowBitTrainer turns it on anyway, at GA 1 <fmt>_cache_adamw is the cache's and the fused
# refresh's case, <fmt>_adamw the optimizer's alone). <fmt>_swiglu_adamw, both levers set, is what int8 / fp8 run on
# CUDA now; its name is kept for the records measured under it (06f72c1)
LEVER_VARIANTS = {"bf16_adamw": (None, True, False, False),
                  **{f"{fmt}_{suffix}": (fmt, *levers) for fmt in ("int8", "fp8")
                     for suffix, levers in (("adamw", (True, False, False)), ("cache_adamw", (True, False, True)),
                                            ("swiglu", (False, True, False)), ("swiglu_adamw", (True, True, False)))}}
# INT8 / FP8 (and with the weight cache forced on) with both issue-25 levers off, LowBitAdamW and the fused MLP (the
# default before session 34: torch's AdamW, each MLP per linear), to measure the levers against in the same run
PLAIN_VARIANTS = {f"{base}_plain": base for base in ("int8", "fp8", "int8_cache", "fp8_cache")}
LEVERS_OFF = {"lowbit_fused_adamw": False, "lowbit_fused_swiglu": False}
# the trainer path only: the layers path keeps the LM head bf16 and compiles only the decoder layers (apply_recipe)
HEAD_VARIANTS = tuple(r for r, (_, field) in SWITCH_VARIANTS.items() if field == "include_lm_head")
# bf16 / INT8 / FP8 with Inductor's partitioner free to recompute, in the backward, activations that a matmul or a
# Triton kernel reads there (torch._functorch.config.ban_recompute_materialized_backward = False, set for the whole
# process before anything compiles: apply_process_setting): what is kept for the backward then is the layer's input
# and what attention and SwiGLU need, not the linears' normed / SwiGLU inputs (issue 25's memory target;
# benchmarks/activation_memory_probe.py). bf16_recompute is the stock bf16 recipe (Trainer) with the same setting
RECOMPUTE_VARIANTS = {f"{base}_recompute": base for base in ("bf16", "int8", "fp8")}
# INT8 / FP8 with X's column codes never shared by sibling linears (issue 25): each linear quantizes its input X per
# column for itself (hf_lowbit.kernels.shares_codes made False for the whole process); *_shared: always shared on
# CUDA, whatever the rows (the default shares from hf_lowbit.kernels.quantize_t.SHARE_MIN_ROWS rows): both against
# the default in the same run
UNSHARED_VARIANTS = {f"{fmt}_unshared": fmt for fmt in ("int8", "fp8")}
SHARED_VARIANTS = {f"{fmt}_shared": fmt for fmt in ("int8", "fp8")}
# INT8 / FP8 with activations and output gradients quantized per column by a given one of quantize_t_triton's
# two-pass variants (hf_lowbit.kernels.quantize_t.ACTIVATION_VARIANT[fmt] set for the process; same bits): the
# two-kernel pair, the atomic column absmax, and that with one correctly rounded reciprocal a column instead of a
# division an element; whichever is the format's default is also its plain recipe
QUANT_VARIANTS = {f"{fmt}_{variant}": fmt for fmt in ("int8", "fp8") for variant in ("two_kernel", "atomic", "atomic_rcp")}
# FP8 with its activation codes rounded in float32 before the cast (hf_lowbit.kernels.quantize_t.FP8_CAST = "soft",
# the only way before 2026-12-03) against the hardware cast, the default on CUDA: the same bits
CAST_VARIANTS = {"fp8_softcast": "fp8"}
# bf16 / INT8 / FP8 with Inductor's multi-kernel on (torch._inductor.config.triton.multi_kernel = 1 for the process):
# a reduction up to 16x wider than its usual 1024 (INNER) also gets a persistent variant, the faster of the two
# picked by timing at the first call (issue 25: the quantizing SwiGLU kernels reduce over 14,336-wide rows in
# Inductor's looped form, ~2x their traffic floor in the 8x2048 profile; RMSNorm's 4,096-wide rows too, in bf16 as
# well). bf16_multikernel is the stock bf16 recipe (Trainer) with the same setting
MULTIKERNEL_VARIANTS = {f"{base}_multikernel": base for base in ("bf16", "int8", "fp8")}
PROCESS_VARIANTS = {**RECOMPUTE_VARIANTS, **UNSHARED_VARIANTS, **SHARED_VARIANTS,
                    **QUANT_VARIANTS, **CAST_VARIANTS, **MULTIKERNEL_VARIANTS}  # a base recipe + a process setting
# bf16 as a stock user runs it (no hf_lowbit), alone or with a process setting
STOCK_BF16 = ("bf16", "bf16_recompute", "bf16_multikernel")
# the trainer path only: LowBitTrainer with lowbit_skip_causal_mask=False, i.e. with the causal mask that transformers
# materializes under torch.compile (SDPA then computes every block; the default lets SDPA skip them as it does
# eagerly: hf_lowbit.integrations.causal_mask), to tell that gain from the low-bit compute's in the same run
MASK_VARIANTS = {"bf16_lbt_mask": "bf16_lbt", "int8_mask": "int8", "fp8_mask": "fp8",
                 "fp8_tensorwise_mask": "fp8_tensorwise"}
OURS = ("int8", "fp8", "fp8_tensorwise", *INT8_VARIANTS, *CACHE_VARIANTS, *SWITCH_VARIANTS, *FGA_VARIANTS,
        *LEVER_VARIANTS, *PLAIN_VARIANTS, "bf16_lbt",
        "int8_recompute",
        "fp8_recompute", *UNSHARED_VARIANTS, *SHARED_VARIANTS, *QUANT_VARIANTS, *CAST_VARIANTS,
        "int8_multikernel", "fp8_multikernel", *MASK_VARIANTS)  # full fine-tunes, LowBitTrainer
FULL_RECIPES = (RECIPES + tuple(INT8_VARIANTS) + tuple(CACHE_VARIANTS) + tuple(SWITCH_VARIANTS) + tuple(FGA_VARIANTS)
                + tuple(LEVER_VARIANTS) + tuple(PLAIN_VARIANTS)
                + ("bf16_lbt",) + tuple(RECOMPUTE_VARIANTS) + tuple(UNSHARED_VARIANTS)
                + tuple(SHARED_VARIANTS) + tuple(QUANT_VARIANTS) + tuple(CAST_VARIANTS) + tuple(MULTIKERNEL_VARIANTS)
                + tuple(MASK_VARIANTS))  # compared with bf16
QAT_GROUP_SIZE = 256  # the seed recipe's 8da4w group
# LoRA (r = --lora_r on every decoder linear, PEFT) over: a bf16 base; our NF4 base with bf16 compute, with
# INT8 compute (per step dequantize+quantize, or an INT8 copy cached once); our INT8 base with INT8 compute;
# and the peers: torchtune-style LoRA over a torchao NF4Tensor base (linear_nf4), and that base through
# torchao's INT8 mixed-precision function. The first LoRA recipe run is the reference of the lora rows.
# *_unfused: the same with the LoRA up-projection beside the base matmul instead of in its epilogue
# (LoraLinear.fuse_into_base = False), to measure the fusion in the same run.
# lora_bf16_lbt: LoRA on a bf16 base through LowBitTrainer with no low-bit recipe (LOOP_ONLY, below).
LORA_RECIPES = ("lora_bf16", "lora_nf4", "lora_nf4_int8", "lora_nf4_int8cache", "lora_int8_int8",
                "lora_nf4_int8_unfused", "lora_int8_int8_unfused", "lora_torchao_nf4", "lora_torchao_nf4_int8",
                "lora_bnb_nf4", "lora_bf16_lbt")
_LORA_ARGS = {"lora_bf16": {}, "lora_bf16_lbt": {}, "lora_nf4": dict(lora_base_quant="nf4"),
              "lora_nf4_int8": dict(lora_base_quant="nf4", int8_mixed_precision=True),
              "lora_nf4_int8cache": dict(lora_base_quant="nf4", int8_mixed_precision=True, lora_base_int8_cache=True),
              "lora_int8_int8": dict(lora_base_quant="int8", int8_mixed_precision=True)}
_LORA_ARGS.update({r + "_unfused": _LORA_ARGS[r] for r in ("lora_nf4_int8", "lora_int8_int8")})
# the trainer path only: bf16 (full fine-tune, and LoRA on a bf16 base) through LowBitTrainer with no low-bit recipe,
# to tell what its training loop gives (no host sync per micro-batch) from what the low-bit compute gives
LOOP_ONLY = ("bf16_lbt", "lora_bf16_lbt")
OURS_LORA = tuple(r for r in _LORA_ARGS if r != "lora_bf16")  # through LowBitTrainer on the trainer path


def _torchao_nf4_lora(model, r: int, int8: bool):
    """torchtune-style LoRA (bf16 adapters beside an ``F.linear`` on a torchao ``NF4Tensor``) on every
    decoder linear; ``int8`` runs the base through torchao's INT8 mixed-precision autograd function."""
    import torch
    from torch import nn
    from torchao.prototype.quantized_training.int8_mixed_precision import (
        Int8MixedPrecisionTrainingConfig, _Int8MixedPrecisionTrainingLinearFunction)
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    class TorchaoNf4LoraLinear(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
            self.lora_a = nn.Linear(linear.in_features, r, bias=False, device=linear.weight.device,
                                    dtype=linear.weight.dtype)
            self.lora_b = nn.Linear(r, linear.out_features, bias=False, device=linear.weight.device,
                                    dtype=linear.weight.dtype)
            nn.init.zeros_(self.lora_b.weight)
            self.config = Int8MixedPrecisionTrainingConfig(grad_weight=False) if int8 else None

        def forward(self, x):
            if self.config is not None:
                y = _Int8MixedPrecisionTrainingLinearFunction.apply(x, self.weight, None, self.config)
            else:
                y = linear_nf4(x, self.weight)
            return y + self.lora_b(self.lora_a(x)) * 2.0  # alpha / r = 2, as LoraConfig(lora_alpha=2r)

    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for name, mod in list(layer.named_modules()):
            if type(mod) is nn.Linear:
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, TorchaoNf4LoraLinear(mod))
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return model


def _bnb_nf4_lora(model, r: int):
    """What Hugging Face users pick for QLoRA: the model loaded through ``BitsAndBytesConfig`` (4-bit NF4,
    double quant, bf16 compute; saved and reloaded, as from the Hub) and PEFT LoRA on every decoder linear."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = model.device
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        torch.cuda.empty_cache()
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=q, dtype=torch.bfloat16,
                                                     device_map={"": str(device)}, attn_implementation="sdpa")
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def mixed_precision_args(recipe: str) -> dict:
    """The ``LowBitTrainingArguments`` fields of our INT8/FP8 recipe ``recipe`` (``int8``, ``fp8``, INT8_VARIANTS,
    CACHE_VARIANTS, SWITCH_VARIANTS, FGA_VARIANTS, LEVER_VARIANTS, PLAIN_VARIANTS, PROCESS_VARIANTS)."""
    recipe = PROCESS_VARIANTS.get(recipe, recipe)
    if recipe in INT8_VARIANTS:
        return {"int8_mixed_precision": True, **INT8_VARIANTS[recipe]}
    if recipe in CACHE_VARIANTS:
        return {f"{CACHE_VARIANTS[recipe]}_mixed_precision": True, "lowbit_weight_cache": True}
    if recipe in SWITCH_VARIANTS:
        fmt, field = SWITCH_VARIANTS[recipe]
        return {f"{fmt}_mixed_precision": True, f"lowbit_{field}": True}
    if recipe in PLAIN_VARIANTS:
        return {**mixed_precision_args(PLAIN_VARIANTS[recipe]), **LEVERS_OFF}
    if recipe in FGA_VARIANTS:
        return {f"{FGA_VARIANTS[recipe]}_mixed_precision": True, "lowbit_fused_grad_accum": True}
    if recipe in LEVER_VARIANTS:
        fmt, adamw, swiglu, cache = LEVER_VARIANTS[recipe]
        return {**({f"{fmt}_mixed_precision": True, "lowbit_fused_swiglu": swiglu} if fmt else {}),
                **({"lowbit_weight_cache": True} if cache else {}), "lowbit_fused_adamw": adamw}
    return {f"{recipe}_mixed_precision": True}


def apply_lora_recipe(model, recipe: str, min_features: int, r: int):
    """``recipe`` from LORA_RECIPES: returns the model to train (a ``PeftModel`` for ours)."""
    from peft import LoraConfig

    if recipe == "lora_bnb_nf4":
        return _bnb_nf4_lora(model, r)
    if recipe in ("lora_torchao_nf4", "lora_torchao_nf4_int8"):
        return _torchao_nf4_lora(model, r, int8=recipe.endswith("int8"))
    from hf_lowbit import LowBitTrainingArguments, prepare_model

    with tempfile.TemporaryDirectory() as tmp:
        args = LowBitTrainingArguments(output_dir=tmp, report_to="none", lowbit_min_features=min_features,
                                       **_LORA_ARGS[recipe])
        # lm_head stays full precision and adapter-free, as in PEFT's "all-linear"
        return prepare_model(model, args, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))


def _lift_recompute_ban() -> None:
    import torch._functorch.config as functorch_config

    functorch_config.ban_recompute_materialized_backward = False


def _recompute_ban_lifted() -> bool:
    import torch._functorch.config as functorch_config

    return not functorch_config.ban_recompute_materialized_backward


def _sharing_rule(rule):
    """(set it, whether it is set) for ``hf_lowbit.kernels.shares_codes`` replaced by ``rule`` for the process
    (the package imported when called, as the other settings import what they set)."""

    def apply() -> None:
        import hf_lowbit.kernels as K

        K.shares_codes = rule

    def is_set() -> bool:
        import hf_lowbit.kernels as K

        return K.shares_codes is rule

    return apply, is_set


def _never_share(x) -> bool:
    return False


def _always_share(x) -> bool:
    return x.device.type == "cuda"


def _quantize_t_setting(attr: str, value, key: str | None = None):
    """(set it, whether it is set) for ``hf_lowbit.kernels.quantize_t.<attr> = value`` (``<attr>[key]`` with
    ``key``): QUANT_VARIANTS' ``ACTIVATION_VARIANT[fmt] = variant``, CAST_VARIANTS' ``FP8_CAST = "soft"``."""
    module = "hf_lowbit.kernels.quantize_t"  # imported by name: the package's attribute quantize_t is the op

    def apply() -> None:
        m = importlib.import_module(module)
        if key is None:
            setattr(m, attr, value)
        else:
            getattr(m, attr)[key] = value

    def is_set() -> bool:
        current = getattr(importlib.import_module(module), attr)
        return (current if key is None else current[key]) == value

    return apply, is_set


def _multi_kernel_on() -> None:
    import torch._inductor.config as inductor_config

    inductor_config.triton.multi_kernel = 1


def _multi_kernel_is_on() -> bool:
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.multi_kernel)


# PROCESS_VARIANTS' settings, by family: (set it, whether it is set, what "not active" means)
_PROCESS_SETTINGS = (
    (RECOMPUTE_VARIANTS, _lift_recompute_ban, _recompute_ban_lifted,
     "the partitioner still bans recomputing materialized activations"),
    (UNSHARED_VARIANTS, *_sharing_rule(_never_share), "X's column codes are still shared"),
    (SHARED_VARIANTS, *_sharing_rule(_always_share), "X's column codes are shared only from SHARE_MIN_ROWS rows"),
    *(({recipe: base}, *_quantize_t_setting("ACTIVATION_VARIANT", recipe.split("_", 1)[1], key=base),
       "activations are quantized by another quantize_t variant") for recipe, base in QUANT_VARIANTS.items()),
    (CAST_VARIANTS, *_quantize_t_setting("FP8_CAST", "soft"), "FP8's activation codes still come from the hardware cast"),
    (MULTIKERNEL_VARIANTS, _multi_kernel_on, _multi_kernel_is_on, "Inductor's multi-kernel is off"),
)


def apply_process_setting(recipe: str) -> bool:
    """A PROCESS_VARIANTS recipe's process-wide setting (call it before anything compiles; each recipe runs in its
    own process); return whether the recipe is one. RECOMPUTE_VARIANTS: let Inductor's partitioner recompute
    activations that the backward materializes (``torch._functorch.config.ban_recompute_materialized_backward =
    False``); UNSHARED_VARIANTS: every linear quantizes its X per column itself (``hf_lowbit.kernels.shares_codes``
    always False: no ``hf_lowbit::quantize_t_shared``); SHARED_VARIANTS: siblings share X's column codes on CUDA at
    any number of rows (``shares_codes`` true on CUDA, not only from ``SHARE_MIN_ROWS`` rows); QUANT_VARIANTS
    (``{fmt}_{variant}``): ``hf_lowbit.kernels.quantize_t.ACTIVATION_VARIANT[fmt] = variant``; CAST_VARIANTS
    (``fp8_softcast``): ``quantize_t.FP8_CAST = "soft"``; MULTIKERNEL_VARIANTS: Inductor's
    ``config.triton.multi_kernel = 1``."""
    for family, apply, _, _ in _PROCESS_SETTINGS:
        if recipe in family:
            apply()
            return True
    return False


def apply_recipe(model, recipe: str, min_features: int, weight_cache: bool = False):
    """Swap the model's decoder linears for ``recipe`` (LM head and embeddings always stay bf16);
    ``weight_cache``: our INT8/FP8 layers quantize each weight once per optimizer step (with gradient
    accumulation), as ``LowBitTrainer`` does by default then. PROCESS_VARIANTS swap as their base recipe (their
    setting is :func:`apply_process_setting`'s)."""
    import torch
    from torch import nn

    recipe = PROCESS_VARIANTS.get(recipe, recipe)
    if recipe in HEAD_VARIANTS:
        raise ValueError(f"apply_recipe: {recipe!r} swaps the LM head, which this path keeps bf16 outside its compiled "
                         "decoder layers; it runs through LowBitTrainer (benchmark_train.py --path trainer)")
    if recipe in ("bf16", "bf16_adamw"):  # (bf16_adamw: the loop's LowBitAdamW alone)
        return
    if recipe in OURS:
        from hf_lowbit import LowBitTrainingArguments, prepare_model

        with tempfile.TemporaryDirectory() as tmp:
            fields = {"lowbit_weight_cache": weight_cache or None, **mixed_precision_args(recipe)}
            args = LowBitTrainingArguments(output_dir=tmp, report_to="none", lowbit_min_features=min_features, **fields)
            prepare_model(model, args)
        return
    if recipe == "qat_8da4w":
        from hf_lowbit import LowBitTrainingArguments, prepare_model

        with tempfile.TemporaryDirectory() as tmp:
            prepare_model(model, LowBitTrainingArguments(output_dir=tmp, report_to="none", qat_scheme="8da4w",
                                                         qat_group_size=QAT_GROUP_SIZE))
        return
    not_head = lambda m, fqn: isinstance(m, nn.Linear) and "lm_head" not in fqn  # noqa: E731
    if recipe == "torchao_int8":
        from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
        from torchao.quantization import quantize_

        # module_swap=True: with torchao 0.18 the default tensor-subclass form leaves F.linear in full
        # precision (outputs equal plain F.linear bit for bit; checked on CPU and seen on the H200)
        quantize_(model, Int8MixedPrecisionTrainingConfig(module_swap=True), filter_fn=not_head)
    elif recipe in TORCHAO_FLOAT8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(TORCHAO_FLOAT8[recipe]),
                                   module_filter_fn=not_head)
    elif recipe == "torchao_qat_8da4w":
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
        from torchao.quantization.qat import QATConfig

        base = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(QAT_GROUP_SIZE))
        quantize_(model, QATConfig(base, step="prepare"), filter_fn=not_head)
    else:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {RECIPES}")


# torchao float8 recipe -> its Float8LinearConfig.from_recipe_name name
TORCHAO_FLOAT8 = {"torchao_float8": "rowwise", "torchao_float8_tensorwise": "tensorwise"}


def check_recipe_active(model, recipe: str, device: str) -> None:
    """Fail loudly if ``recipe`` left the first decoder MLP projection computing plain ``F.linear``, or (our FP8
    formats, torchao's float8 recipes) computing with the other scaling (row-wise for tensorwise, or the reverse)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    for family, _, is_set, unset in _PROCESS_SETTINGS:
        if recipe in family:
            if not is_set():
                raise RuntimeError(f"recipe {recipe!r} is not active: {unset} (apply_process_setting was not called)")
            recipe = family[recipe]
    if recipe in ("bf16", "bf16_adamw"):  # (bf16_adamw: LowBitAdamW, made by the loop, swaps nothing)
        return
    if recipe in LORA_RECIPES:
        from hf_lowbit import Int8Linear, LoraLinear, Nf4Linear

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        mod = inner.model.layers[0].mlp.up_proj
        want = {"lora_bf16": nn.Linear, "lora_nf4": Nf4Linear, "lora_nf4_int8": Nf4Linear, "lora_int8_int8": Int8Linear,
                "lora_nf4_int8cache": Nf4Linear}.get(recipe.removesuffix("_unfused"))
        if LoraLinear.fuse_into_base == recipe.endswith("_unfused"):
            raise RuntimeError(f"recipe {recipe!r} is not active: LoraLinear.fuse_into_base is {LoraLinear.fuse_into_base}")
        base = getattr(mod, "base_layer", None)
        if want is not None and not (isinstance(mod, LoraLinear if want is not nn.Linear else nn.Module)
                                     and type(base) is want and (("int8" in recipe[5:]) == (getattr(base, "compute", None) is not None))):
            raise RuntimeError(f"recipe {recipe!r} is not active: up_proj is {type(mod).__name__} over {type(base).__name__}")
        return
    mlp = model.model.layers[0].mlp
    mod = mlp.up_proj
    fused_mlp = levers(recipe, device)[1]
    if fused_mlp != (type(mlp).__name__ == "LowBitSwiGLUMLP"):
        raise RuntimeError(f"recipe {recipe!r} is not active: the MLP is a {type(mlp).__name__}, the fused one "
                           f"expected: {fused_mlp}")
    if recipe.endswith(("_cache", "_cache_adamw", "_cache_plain")) and not getattr(mod, "weight_cache", False):
        raise RuntimeError(f"recipe {recipe!r} is not active: up_proj's weight cache is off")
    if recipe in SWITCH_VARIANTS and not getattr(getattr(mod, "lowbit_config", None), SWITCH_VARIANTS[recipe][1], False):
        raise RuntimeError(f"recipe {recipe!r} is not active: up_proj's {SWITCH_VARIANTS[recipe][1]} is off")
    if recipe in HEAD_VARIANTS:
        from hf_lowbit import MixedPrecisionLinear

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not isinstance(inner.get_output_embeddings(), MixedPrecisionLinear):
            raise RuntimeError(f"recipe {recipe!r} is not active: the LM head is "
                               f"{type(inner.get_output_embeddings()).__name__} (its vocab a multiple of 16?)")
    fmt = getattr(getattr(mod, "lowbit_config", None), "format", None)
    if recipe in ("fp8", "fp8_tensorwise") and fmt != recipe:
        raise RuntimeError(f"recipe {recipe!r} is not active: up_proj computes in {fmt!r}")
    if recipe in TORCHAO_FLOAT8:
        scaling = getattr(getattr(getattr(mod, "config", None), "cast_config_input", None), "scaling_granularity", None)
        want = {"rowwise": "AXISWISE", "tensorwise": "TENSORWISE"}[TORCHAO_FLOAT8[recipe]]
        if getattr(scaling, "name", None) != want:
            raise RuntimeError(f"recipe {recipe!r} is not active: up_proj is {type(mod).__name__} scaling {scaling}")
    weight = getattr(mod.weight, "_data", mod.weight)
    x = torch.randn(256, mod.in_features, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        if torch.equal(mod(x), F.linear(x, weight.to(x.dtype))):
            raise RuntimeError(f"recipe {recipe!r} is not active: {type(mod).__name__} computes plain F.linear")


def build_model(a, device: str, weight_cache: bool = False):
    """The bench's model (``a``: the parsed flags) on ``device`` with ``a.recipe`` applied and checked."""
    from transformers import AutoModelForCausalLM

    if a.recipe.endswith("_unfused"):  # one recipe a process: the class switch holds for this run only
        from hf_lowbit import LoraLinear

        LoraLinear.fuse_into_base = False
    apply_process_setting(a.recipe)  # before anything compiles (the Trainer path's model too)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(a), dtype=torch.bfloat16, attn_implementation="sdpa")
    if getattr(a, "path", "layers") == "trainer" and a.recipe in (*STOCK_BF16, *OURS, *OURS_LORA):
        return model  # the Trainer path: LowBitTrainer swaps and wraps (stock Trainer for bf16)
    if getattr(a, "path", "layers") == "trainer" and a.recipe == "lora_bf16":
        from peft import LoraConfig, get_peft_model  # what a stock Trainer user runs: PEFT's own LoRA

        return get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear"))
    if a.recipe in LORA_RECIPES:
        model = apply_lora_recipe(model, a.recipe, a.min_features, a.lora_r)
    else:
        apply_recipe(model, a.recipe, a.min_features, weight_cache=weight_cache)
    check_recipe_active(model, a.recipe, device)
    if a.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def compile_layers(model, n_layers: int, forward_only: bool = False, mode: str | None = None) -> None:
    """Compile each decoder layer (``nn.Module.compile``), or with ``forward_only`` just its ``forward``
    so that module hooks (FSDP2's all-gather / reshard) run eagerly around the compiled graph."""
    import torch
    import torch._dynamo

    # One compiled graph per decoder layer; each layer instance guards on its own attributes
    # (layer_idx), so the recompile limit must cover the layer count or dynamo falls back to eager.
    torch._dynamo.config.cache_size_limit = max(64, 2 * n_layers)
    torch._dynamo.config.accumulated_cache_size_limit = max(256, 4 * n_layers)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        if forward_only:
            layer.forward = torch.compile(layer.forward, mode=mode)
        else:
            layer.compile(mode=mode)


def load_blocks(a):
    """``--data``: token blocks ``[n, seq]`` (int64, ``torch.save``d) to train on instead of random ids."""
    import torch

    blocks = torch.load(a.data)
    if blocks.dim() != 2 or blocks.shape[1] != a.seq or blocks.shape[0] < a.batch or int(blocks.max()) >= a.vocab:
        raise SystemExit(f"--data {a.data}: need >= {a.batch} blocks of {a.seq} ids below {a.vocab}, "
                         f"got shape {tuple(blocks.shape)}, max id {int(blocks.max())}")
    return blocks


def check_recipes(recipes: list[str], known: tuple[str, ...], path: str) -> None:
    """Stop with one line on a recipe the script does not know, or a LOOP_ONLY or HEAD_VARIANTS one off the trainer
    path."""
    for recipe in recipes:
        if recipe not in known:
            raise SystemExit(f"--recipes: unknown recipe {recipe!r}; choose from {', '.join(known)}")
        if recipe in LOOP_ONLY and path != "trainer":
            raise SystemExit(f"--recipes: {recipe} is LowBitTrainer's loop with no low-bit recipe: --path trainer only")
        if recipe in MASK_VARIANTS and path != "trainer":
            raise SystemExit(f"--recipes: {recipe} is a LowBitTrainer setting (lowbit_skip_causal_mask=False): "
                             "--path trainer only")
        if recipe in HEAD_VARIANTS and path != "trainer":
            raise SystemExit(f"--recipes: {recipe} swaps the LM head, which the {path} path keeps bf16 (it compiles "
                             "the decoder layers only): --path trainer only")


def levers(recipe: str, device) -> tuple[bool, bool]:
    """(LowBitAdamW, the fused MLP): issue 25's two levers as ``LowBitTrainingArguments`` resolve them for ``recipe`` on
    ``device`` (full fine-tuning, not sharded; unset: on for INT8/FP8 on CUDA); both off for recipes not ours."""
    if recipe not in OURS:
        return False, False
    from hf_lowbit import LowBitTrainingArguments

    # the device given, not TrainingArguments' own: its set-up resets accelerate's state, which a Trainer made before
    # this call in the same process still reads
    on = type("OnDevice", (LowBitTrainingArguments,), {"device": property(lambda self: torch.device(device))})
    with tempfile.TemporaryDirectory() as tmp:
        args = on(output_dir=tmp, report_to="none", **recipe_args(recipe))
        return args.resolved_fused_adamw(), args.resolved_fused_swiglu()


def recipe_args(recipe: str) -> dict:
    """The ``LowBitTrainingArguments`` fields of ``recipe`` run through ``prepare_model``: ours (full fine-tunes and
    LoRA over our bases); ``bf16`` and ``lora_bf16`` have none."""
    if recipe in _LORA_ARGS:
        return dict(_LORA_ARGS[recipe])
    if recipe in MASK_VARIANTS:
        return {**recipe_args(MASK_VARIANTS[recipe]), "lowbit_skip_causal_mask": False}
    return {} if recipe in (*STOCK_BF16, "bf16_lbt") else mixed_precision_args(recipe)


# -------------------------------------------------------------------------------------- a training step, timed
def train_step(model, micro_batches, opt, *, fwd=None, autocast: bool = False, clip: float | None = None,
               sched=None, set_to_none: bool = True, before: Callable[[], None] | None = None,
               plain: bool = False) -> list:
    """One optimizer step over ``micro_batches`` (token ids, their own labels; or ``(ids, labels)`` pairs, labels
    -100 where no loss is taken; gradient accumulation), the forward through ``fwd`` (a compiled model) if given: the
    micro-batches' losses divided by their count, detached and not read (a timed loop reads them after). ``clip``: the
    gradient norm; ``sched``: stepped after the optimizer; ``before``: called before each micro-batch (e.g.
    ``FusedGradAccumulation.prepare``); ``plain``: the forwards within ``hf_lowbit``'s ``plain_causal``, as
    ``LowBitTrainer`` runs a batch with no padding or packing (for a model ``plain_causal_model`` accepts: eagerly
    no host sync a forward in transformers' packed-sequence check)."""
    from hf_lowbit.integrations.causal_mask import plain_causal

    losses = []
    for mb in micro_batches:
        if before is not None:
            before()
        ids, labels = mb if isinstance(mb, tuple) else (mb, mb)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast), plain_causal(plain):
            loss = (model if fwd is None else fwd)(input_ids=ids, labels=labels).loss / len(micro_batches)
        loss.backward()
        losses.append(loss.detach())
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=set_to_none)
    return losses


def cudagraph_skips() -> list[str]:
    """A list that fills with Inductor's reasons for running a compiled graph without CUDA graphs (under
    ``mode="reduce-overhead"``: e.g. a graph that mutates an input), as Inductor logs them: the counter alone
    (``counters["inductor"]["cudagraph_skips"]``) does not say which graph or why."""
    import logging

    from torch._inductor import cudagraph_utils

    reasons: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            # what the function that counts skips logs (its messages vary: "skipping cudagraphs due to ...",
            # "disabling cudagraphs due to incompatible op ...", "graph with symbolic shapes inputs ..."), not the
            # log's other warnings (the dynamic-shapes one on re-recorded sizes)
            if record.funcName == cudagraph_utils.log_cudagraph_skip_and_bump_counter.__name__:
                reasons.append(record.getMessage()[:400])

    cudagraph_utils.cudagraphs_log.addHandler(_Collect(logging.WARNING))
    return reasons


class GpuTelemetry:
    """The GPU's SM clock, power draw, temperature and active clock-event (throttle) reasons, sampled by one
    ``nvidia-smi`` process in loop mode every ``ms`` milliseconds between :meth:`start` and :meth:`stop` and read by
    a thread: whether a GPU-bound step runs at lower clocks than the kernels' profile (taken with the GPU partly
    idle) saw. :meth:`stop` returns ``None`` where ``nvidia-smi`` is missing or answered nothing (a CPU machine)."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
    # a bit mask (NVML's clock-event reasons: 0x1 idle, 0x4 software power cap, 0x8 hardware slowdown, 0x20 / 0x40
    # software / hardware thermal, 0x80 power brake); newer drivers' field name, then the older one
    REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")

    def __init__(self, ms: int = 100):
        """Finds ``nvidia-smi`` and the field list it accepts now (construct it before the warm-up: the probe's
        calls then stay out of the timed window and do not leave the GPU idle just before it)."""
        import shutil

        self.ms = ms
        self.proc = None
        self.lines: list[str] = []
        self.exe, self.gpu, self.query = shutil.which("nvidia-smi"), self._gpu(), None
        for reason in (*self.REASONS, None) if self.exe else ():  # the first field list this nvidia-smi accepts
            fields = ",".join(self.FIELDS + ((reason,) if reason else ()))
            try:
                ok = subprocess.run([self.exe, f"--id={self.gpu}", f"--query-gpu={fields}",
                                     "--format=csv,noheader,nounits"], capture_output=True, timeout=20).returncode == 0
            except (OSError, subprocess.SubprocessError):
                return
            if ok:
                self.query = fields
                return

    @staticmethod
    def _gpu() -> str:
        """torch's current GPU as nvidia-smi names it: by UUID (CUDA's device order and nvidia-smi's can differ)."""
        if torch.cuda.is_available():
            uuid = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", "") or "")
            if uuid:
                return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return visible.split(",")[index].strip() if visible else str(index)

    def start(self) -> "GpuTelemetry":
        import threading

        if self.query is None:
            return self
        self.proc = subprocess.Popen([self.exe, f"--id={self.gpu}", f"--query-gpu={self.query}",
                                      "--format=csv,noheader,nounits", f"-lms={self.ms}"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)  # its own process group, ended whole by stop()
        self.reader = threading.Thread(target=lambda: self.lines.extend(line.strip() for line in self.proc.stdout),
                                       daemon=True)
        self.reader.start()
        return self

    def stop(self) -> dict | None:
        if self.proc is None:
            return None
        import signal

        for sig in (signal.SIGINT, signal.SIGKILL):  # SIGINT first: nvidia-smi ends as at Ctrl-C, its output flushed
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # it ended already
                pass
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        self.reader.join(timeout=10)
        columns: list[list[float]] = [[] for _ in self.FIELDS]
        reasons: set[str] = set()
        samples = 0
        for line in self.lines:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < len(self.FIELDS):
                continue
            samples += 1
            for values, part in zip(columns, parts):
                try:
                    values.append(float(part))
                except ValueError:  # "[N/A]", "[Not Supported]"
                    pass
            if len(parts) > len(self.FIELDS) and re.fullmatch(r"0x[0-9a-fA-F]+", parts[-1]) and int(parts[-1], 16):
                reasons.add(parts[-1])
        if not any(columns):
            return None

        def min_median_max(values):
            v = sorted(values)
            return [v[0], v[len(v) // 2], v[-1]] if v else None

        sm, power, temp = (min_median_max(v) for v in columns)
        return {"samples": samples, "every_ms": self.ms, "sm_mhz": sm, "power_w": power, "temp_c": temp,
                "clock_event_reasons": sorted(reasons)}


def timed_steps(step: Callable[[int], object], warmup: int, steps: int, cuda: bool, warm: Callable = lambda r: r,
                before_timing: Callable[[], None] = lambda: None) -> dict:
    """``step(i)`` for ``warmup`` steps (compile, autotune; each result through ``warm``), the peak memory reset, then
    ``steps`` timed ones (CUDA events between them on a GPU): their results, ``warmup_s``, ``elapsed`` seconds,
    the sorted per-step milliseconds ``step_ms`` (CUDA only; ``step_ms_seq`` in the steps' order), ``gc``: Python's
    garbage collections during the timed steps, per generation ``[count, total ms, longest ms]`` (a full collection
    over a large heap can stall the host for a step's time), and ``gc_ms_seq``: their milliseconds in each step's
    host time (a collection belongs to the step whose host work it interrupted, which on a GPU the device may show in
    a later step)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    warm_results = [warm(step(i)) for i in range(warmup)]
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    before_timing()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    by_generation: dict[int, list] = {}
    gc_ms_seq = [0.0] * steps
    started = [0.0]  # collections do not nest

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = 1000 * (time.perf_counter() - started[0])
        c = by_generation.setdefault(info["generation"], [0, 0.0, 0.0])
        c[0], c[1], c[2] = c[0] + 1, c[1] + ms, max(c[2], ms)
        gc_ms_seq[min(len(results), steps - 1)] += ms

    results = []
    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        for i in range(steps):  # the batches after the warm-up's
            if cuda:
                events[i].record()
            results.append(step(warmup + i))
        if cuda:
            events[-1].record()
        sync()
        elapsed = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    step_ms_seq = [events[i].elapsed_time(events[i + 1]) for i in range(steps)] if cuda else []
    return {"warm": warm_results, "timed": results, "warmup_s": warmup_s, "elapsed": elapsed,
            "step_ms": sorted(step_ms_seq), "step_ms_seq": step_ms_seq,
            "gc": {str(g): by_generation[g] for g in sorted(by_generation)}, "gc_ms_seq": gc_ms_seq}


def median_ms(fn: Callable[[], object], device: str = "cuda", reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def require_device(device: str, script: str, smoke: str) -> None:
    """A GPU benchmark's device check: ``cuda`` needs one; ``cpu`` runs its Triton kernels in the interpreter
    (``TRITON_INTERPRET=1``), a smoke test whose flags ``smoke`` names."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU ({smoke} under TRITON_INTERPRET=1 smoke-tests it)")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")


def kernel_us(fn: Callable[[], object], device: str) -> tuple[float, str]:
    """Microseconds of one ``fn()`` and how they were taken. CUDA: :func:`graph_ms` (the GPU alone: timed eagerly, a
    ~50 µs kernel read the host's launch time on the H200, 53dd5e7); a call that cannot be captured falls back to
    ``triton.testing.do_bench``, said in the second value. Elsewhere one warm call's wall time (a smoke run)."""
    if device == "cuda":
        try:
            return graph_ms(fn) * 1000, "cuda graph"
        except Exception as e:  # noqa: BLE001 - record why and measure the eager way
            from triton.testing import do_bench

            print(f"  not capturable ({type(e).__name__}: {str(e)[:80]}); timing eagerly", flush=True)
            torch.cuda.synchronize()
            return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000, "eager (do_bench)"
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6, "wall (CPU smoke)"


def graph_ms(fn: Callable[[], object], reps: int = 10, inner: int = 10) -> float:
    """Median milliseconds of one ``fn()`` on the GPU alone: ``inner`` calls captured in one CUDA graph (after a
    warm-up call, which autotunes), replayed ``reps`` times. Kernels of ~0.1 ms are shorter than a Python launch,
    so timing calls with events around them (:func:`median_ms`) measured the host as much as the kernel."""
    side = torch.cuda.Stream()  # warm up (autotune, compile) on a side stream, as CUDA-graph capture recommends
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]


# Kernel-name patterns -> category, first match wins (CUDA kernel names as the profiler records them;
# Inductor's generated kernels all start with "triton_", cuBLAS FP8 GEMMs carry "qq" in nvjet names).
_CATEGORIES = (
    ("int8 matmul (ours, Triton)", ("_int8_scaled_mm_kernel",)),
    # lowbit_fused_grad_accum's weight-gradient product added into .grad (INT8 and FP8 alike)
    ("low-bit matmul into .grad (ours, Triton)", ("_scaled_mm_accumulate_kernel",)),
    ("quantize_t (ours, Triton)", ("_col_amax_kernel", "_quantize_t_kernel", "_col_amax_atomic_kernel",
                                   "_quantize_t_amax_kernel", "_quantize_t_fused_kernel",
                                   "_quantize_rows_kernel")),
    ("nf4 -> int8 (ours, Triton)", ("_nf4_to_int8_kernel",)),
    ("nf4 dequantize (bitsandbytes)", ("kdequantize",)),
    ("Inductor fused: norms, activations, quantize", ("triton_",)),
    ("attention (flash / cuDNN SDPA)", ("flash", "fmha", "sdpa", "attention")),
    ("fp8 matmul (cuBLAS)", ("_qqtst_", "qqtst", "f8f8", "e4m3", "fp8")),
    ("bf16 matmul (cuBLAS)", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("cross entropy / softmax", ("softmax", "nll", "cross_entropy")),
    # ATen's own elementwise kernels: with accumulation mostly autograd's .grad += (a read and write of every
    # gradient a micro-batch), and casts / copies
    ("aten elementwise (.grad adds, casts, copies)", ("elementwise_kernel",)),
    ("memset", ("memset",)),
)


def kernel_category(name: str) -> str:
    """The profile category of a kernel name: the first of ``_CATEGORIES`` with a pattern in it, else "other"."""
    low = name.lower()
    return next((c for c, pats in _CATEGORIES if any(p in low for p in pats)), "other")


_CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")  # the CUDA runtime's synchronizing calls
_HOST_READS = ("aten::_local_scalar_dense",)  # .item(), bool(tensor): on CUDA one cudaStreamSynchronize each


def kernel_profile(fn: Callable[[], object], steps: int = 2, top: int = 25, host: bool = False) -> dict:
    """Profile ``steps`` calls of ``fn`` on CUDA: device ms per step by category and the top kernels; ``host``: the
    CPU side too (host syncs and the host's own top ops, :func:`profile_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * host) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return profile_summary(prof, steps, top)


def profile_summary(prof, steps: int, top: int = 25, device: str = "cuda", own_syncs: int = 1) -> dict:
    """A finished ``torch.profiler.profile`` of ``steps`` steps: device ms per step by kernel category and the top
    kernels. ``device="cpu"``: the CPU ops' self time instead (a CPU smoke run; every op lands in "other").
    ``own_syncs``: the ``cudaDeviceSynchronize`` calls the profiling code itself made inside the profile (its final
    wait for the kernels), left out of ``host_syncs_per_step``."""
    from torch.autograd import DeviceType

    # a record_function range (the optimizer's "Optimizer.step#AdamW.step") shows on the GPU timeline as a user
    # annotation spanning its kernels: not a kernel, and counted twice if summed (da7f528's Trainer profiles did)
    events = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)]
    if device == "cpu":
        kernels = [(e.key, e.self_cpu_time_total / 1000 / steps, e.count // steps)
                   for e in events if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0]
    else:
        kernels = [(e.key, e.self_device_time_total / 1000 / steps, e.count // steps)
                   for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    # where the host waited for the device, seen when CPU ops were recorded: on CUDA the runtime's synchronizing
    # calls (an .item() / bool(tensor) is one cudaStreamSynchronize inside aten::_local_scalar_dense: counted once),
    # on a CPU the reads themselves
    cpu_ops = any(e.device_type == DeviceType.CPU and e.key.startswith("aten::") for e in events)
    runtime = any(e.key.startswith("cuda") for e in events)
    wanted = _CUDA_SYNCS if runtime else _HOST_READS
    syncs = {e.key: e.count / steps for e in events if e.key in wanted} if cpu_ops else None
    if syncs and runtime and "cudaDeviceSynchronize" in syncs:  # the profiler's caller's own final wait: not a step's
        syncs["cudaDeviceSynchronize"] = max(0.0, syncs["cudaDeviceSynchronize"] - own_syncs / steps)
    categories: dict[str, float] = {}
    for name, ms, _ in kernels:
        cat = kernel_category(name)
        categories[cat] = categories.get(cat, 0.0) + ms
    kernels.sort(key=lambda k: -k[1])
    out = {"device_ms_per_step": sum(categories.values()), "host_syncs_per_step": syncs,
           "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
           "top_kernels": [{"name": n[:160], "ms": ms, "calls": c} for n, ms, c in kernels[:top]]}
    if cpu_ops and device != "cpu":  # where the host's time went: its own ops' self time (runtime calls included),
        # apart from its waits for the device (the synchronizing calls: the profiled function's own final one too)
        host = sorted(((e.key, e.self_cpu_time_total / 1000 / steps, e.count / steps) for e in events
                       if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0), key=lambda k: -k[1])
        out["host_ms_per_step"] = sum(ms for name, ms, _ in host if name not in _CUDA_SYNCS)
        out["host_wait_ms_per_step"] = sum(ms for name, ms, _ in host if name in _CUDA_SYNCS)
        out["top_host_ops"] = [{"name": n[:120], "ms": ms, "calls": c} for n, ms, c in host[:top]]
    return out


# -------------------------------------------------------------------------------------------------------- records
def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path``, its folder made, through a temporary sibling renamed into place: a process
    killed mid-write (a device call's timeout) leaves the previous file or the new one whole, never half of it."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open(path, "w") would make it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_json(path: str | None, data, indent: int = 1) -> None:
    """Write ``data`` to ``path`` (if any), its folder made, atomically (:func:`write_atomic`); scripts rewrite it
    after every row, so a run cut short keeps the rows it finished."""
    if path:
        write_atomic(path, json.dumps(data, indent=indent))


def spread(values: list[float]) -> dict:
    """Mean, min, max and sample standard deviation (0 for one value) of a result over seeds."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {"mean": mean, "min": min(values), "max": max(values), "std": math.sqrt(var), "n": len(values)}


def error_cell(error: str, n: int = 80) -> str:
    """A failed row's cell: the error's last line."""
    return "error: " + (error.strip().splitlines()[-1][:n] if error.strip() else "?")


def run_worker(cmd: list[str], label: dict, timeout: int, env: dict | None = None) -> dict:
    """Run one benchmark worker process (``env``: extra environment variables); its last
    ``RESULT {json}`` line, or ``label`` + an ``error``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {**label, "error": f"timed out after {timeout} s"}
    out = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if out:
        return json.loads(out[-1][len("RESULT "):])
    # under torchrun the ranks' own tracebacks are the "[rankN]:" lines, before the launcher's
    ranks = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    return {**label, "error": ("\n".join(ranks) if ranks else proc.stderr)[-1500:]}


def write_results(data: dict, table: list[str], header: str, json_path: str | None = None,
                  markdown_path: str | None = None) -> None:
    """Print the markdown ``table``; write ``data`` as JSON and ``header`` + table as markdown if asked (each
    atomically: :func:`write_atomic`).

    ``data["meta"]["commit"]`` records the commit measured (:func:`git_commit`, unless the script set it); the
    markdown header names it too."""
    meta = data.setdefault("meta", {})
    meta.setdefault("commit", git_commit())
    header = f"{header}, commit {meta['commit']}"
    print("\n".join(table))
    if json_path:
        write_atomic(json_path, json.dumps(data, indent=1))
    if markdown_path:
        write_atomic(markdown_path, header + "\n\n" + "\n".join(table) + "\n")


# ----------------------------------------------------------------------------------------------------------- plots
def bar_plot(path: str, groups: list, series: list, value: Callable, ylabel: str, title: str, *, width: float = 7,
             fmt: str = "%.2fx", label=str, rotation: int = 0, fontsize: float = 8) -> None:
    """Grouped bars: along x one group each, in it a bar per series, ``value(group, series)`` high (None: no bar);
    a dashed line at 1 (the reference's ratio). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 3.5 if width < 9 else 4))
    step = 0.8 / max(1, len(series))
    for j, s in enumerate(series):
        pts = [(i + j * step, value(g, s)) for i, g in enumerate(groups)]
        pts = [(x, v) for x, v in pts if v is not None]
        bars = ax.bar([x for x, _ in pts], [v for _, v in pts], step, label=label(s))
        ax.bar_label(bars, fmt=fmt, fontsize=fontsize - 1)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([i + step * (len(series) - 1) / 2 for i in range(len(groups))], groups, rotation=rotation,
                  ha="right" if rotation else "center", fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10 if width < 9 else 9)
    ax.legend(fontsize=fontsize - 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_results(src: str, dst: str) -> None:
    """Bars of speed vs bf16 from a benchmark_linear.py, benchmark_train.py or benchmark_seed_table.py JSON."""
    with open(src) as f:
        data = json.load(f)
    meta = data["meta"]
    rows = [r for r in data["rows"] if "error" not in r]
    for r in rows:  # benchmark_train rows: one mode, ratio under "vs_bf16" (benchmark_seed_table: "speedup")
        r.setdefault("mode", "compiled step")
        r.setdefault("speedup_vs_bf16", r.get("vs_bf16", r.get("speedup", 0)))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if "shape" in meta:
        m, k, n = meta["shape"]
        title = f"{meta['gpu']}: one linear fwd+bwd, {m} tokens x {k} -> {n}"
    else:
        c = meta["config"]
        title = f"{meta['gpu']}: training step, {c['layers']} layers h{c['hidden']}, {c['batch']}x{c['seq']} tokens"
    bar_plot(dst, recipes, modes, lambda rec, mode: next((r["speedup_vs_bf16"] for r in rows
                                                          if r["recipe"] == rec and r["mode"] == mode), 0),
             "speed vs bf16 (same mode)", title, rotation=20 if len(recipes) > 5 else 0,
             fontsize=8 if len(recipes) > 5 else 10)


def allow_fsdp_on_cpu() -> None:
    """Let accelerate run FSDP in CPU processes (gloo), for CPU tests of the distributed code paths.

    accelerate 1.15 turns FSDP on only for accelerator devices: in CPU processes (``ACCELERATE_USE_CPU``)
    ``AcceleratorState`` keeps ``MULTI_CPU`` and the model would silently get DDP. torch's ``fully_shard``
    works on a CPU device mesh, so this makes the state take the FSDP plugin the launcher configured,
    as it does on GPUs. Call it before creating the ``Accelerator`` / ``Trainer``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, "_hf_lowbit_cpu_fsdp", False):
        return

    def init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self.mixed_precision)
            # what AcceleratorState does for GPU processes (it keeps PartialState in step the same way)
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    init_with_cpu_fsdp._hf_lowbit_cpu_fsdp = True
    AcceleratorState.__init__ = init_with_cpu_fsdp


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "plot":
        raise SystemExit("python benchmarks/driver.py plot RESULTS.json PLOT.png   (needs matplotlib)")
    plot_results(sys.argv[2], sys.argv[3])
