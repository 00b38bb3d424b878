#!/usr/bin/env python
"""Training throughput of the low-bit recipes beside bf16 and torchao, in one run.

    python benchmarks/benchmark_train.py --json docs/results/train_h200.json --markdown docs/results/train_h200.md

Default bench: a Llama-8B-shaped block (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 32000),
8 layers, random init from a config, bf16 weights, fused AdamW, batch 8 x 2048 tokens, each decoder
layer compiled. Each recipe runs in its own process: warm-up steps (compile, autotune) are timed and
reported apart, then the timed steps give tokens/s, the ratio to bf16, peak memory and the first/last
loss. The number of compiled graphs and graph breaks is recorded so a silent fall-back to eager shows.

LoRA / QLoRA (see LORA_RECIPES; adapters on every decoder linear, only they train; rows compare to the
first LoRA recipe of the run):

    python benchmarks/benchmark_train.py --recipes lora_bf16,lora_nf4,lora_nf4_int8,lora_int8_int8 --lora_r 16
    python benchmarks/benchmark_train.py --recipes lora_bf16,lora_nf4 --layers 32 --batch 1 --grad_checkpointing

`--path trainer --liger both` runs every recipe twice, without and with ``use_liger_kernel=True`` (stock
``Trainer`` and ``LowBitTrainer`` alike; rows carry ``liger``, ``vs_no_liger``), so what Liger adds to each
recipe is measured in the same run; every ratio is to the bf16 row without Liger. Each trainer-path row also
carries the MFU of its timed steps (``mfu``: hf_lowbit.integrations.throughput's formula, for every recipe) and, for
``LowBitTrainer`` rows, the mean ``train_mfu`` / ``train_tokens_per_second`` it logged (``logged_*``).

`--autocast` runs the forward under bf16 autocast, as `Trainer(bf16=True)` does (accelerate wraps the
forward). It matters for LoRA: without it PEFT computes its float32 adapters in float32, under it in bf16
(our `LoraLinear` computes the adapters in the compute dtype either way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

RECIPES = ("bf16", "int8", "fp8", "torchao_int8", "torchao_float8", "qat_8da4w", "torchao_qat_8da4w")
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
OURS = ("int8", "fp8", *INT8_VARIANTS, *CACHE_VARIANTS)  # full fine-tunes through hf_lowbit's recipes
FULL_RECIPES = RECIPES + tuple(INT8_VARIANTS) + tuple(CACHE_VARIANTS)  # full fine-tunes: compared with bf16
QAT_GROUP_SIZE = 256  # the seed recipe's 8da4w group
# LoRA (r = --lora_r on every decoder linear, PEFT) over: a bf16 base; our NF4 base with bf16 compute, with
# INT8 compute (per step dequantize+quantize, or an INT8 copy cached once); our INT8 base with INT8 compute;
# and the peers: torchtune-style LoRA over a torchao NF4Tensor base (linear_nf4), and that base through
# torchao's INT8 mixed-precision function. The first LoRA recipe run is the reference of the lora rows.
LORA_RECIPES = ("lora_bf16", "lora_nf4", "lora_nf4_int8", "lora_nf4_int8cache", "lora_int8_int8",
                "lora_torchao_nf4", "lora_torchao_nf4_int8", "lora_bnb_nf4")
_LORA_ARGS = {"lora_bf16": {}, "lora_nf4": dict(lora_base_quant="nf4"),
              "lora_nf4_int8": dict(lora_base_quant="nf4", int8_mixed_precision=True),
              "lora_nf4_int8cache": dict(lora_base_quant="nf4", int8_mixed_precision=True, lora_base_int8_cache=True),
              "lora_int8_int8": dict(lora_base_quant="int8", int8_mixed_precision=True)}
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
    CACHE_VARIANTS)."""
    if recipe in INT8_VARIANTS:
        return {"int8_mixed_precision": True, **INT8_VARIANTS[recipe]}
    if recipe in CACHE_VARIANTS:
        return {f"{CACHE_VARIANTS[recipe]}_mixed_precision": True, "lowbit_weight_cache": True}
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


def apply_recipe(model, recipe: str, min_features: int, weight_cache: bool = False):
    """Swap the model's decoder linears for ``recipe`` (LM head and embeddings always stay bf16);
    ``weight_cache``: our INT8/FP8 layers quantize each weight once per optimizer step (with gradient
    accumulation), as ``LowBitTrainer`` does by default then."""
    import torch
    from torch import nn

    if recipe == "bf16":
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
    elif recipe == "torchao_float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=not_head)
    elif recipe == "torchao_qat_8da4w":
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
        from torchao.quantization.qat import QATConfig

        base = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(QAT_GROUP_SIZE))
        quantize_(model, QATConfig(base, step="prepare"), filter_fn=not_head)
    else:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {RECIPES}")


def check_recipe_active(model, recipe: str, device: str) -> None:
    """Fail loudly if ``recipe`` left the first decoder MLP projection computing plain ``F.linear``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if recipe == "bf16":
        return
    if recipe in LORA_RECIPES:
        from hf_lowbit import Int8Linear, LoraLinear, Nf4Linear

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        mod = inner.model.layers[0].mlp.up_proj
        want = {"lora_bf16": nn.Linear, "lora_nf4": Nf4Linear, "lora_nf4_int8": Nf4Linear, "lora_int8_int8": Int8Linear,
                "lora_nf4_int8cache": Nf4Linear}.get(recipe)
        base = getattr(mod, "base_layer", None)
        if want is not None and not (isinstance(mod, LoraLinear if want is not nn.Linear else nn.Module)
                                     and type(base) is want and (("int8" in recipe[5:]) == (getattr(base, "compute", None) is not None))):
            raise RuntimeError(f"recipe {recipe!r} is not active: up_proj is {type(mod).__name__} over {type(base).__name__}")
        return
    mod = model.model.layers[0].mlp.up_proj
    if recipe.endswith("_cache") and not getattr(mod, "weight_cache", False):
        raise RuntimeError(f"recipe {recipe!r} is not active: up_proj's weight cache is off")
    weight = getattr(mod.weight, "_data", mod.weight)
    x = torch.randn(256, mod.in_features, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        if torch.equal(mod(x), F.linear(x, weight.to(x.dtype))):
            raise RuntimeError(f"recipe {recipe!r} is not active: {type(mod).__name__} computes plain F.linear")


def build_model(a, device: str, weight_cache: bool = False):
    """The bench's model (``a``: the parsed flags) on ``device`` with ``a.recipe`` applied and checked."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                         max_position_embeddings=a.seq, tie_word_embeddings=False,
                         use_cache=False)  # training: no KV cache (it also costs a recompile per layer)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if getattr(a, "path", "layers") == "trainer" and a.recipe in ("bf16", *OURS, *OURS_LORA):
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


# the flags trainer_worker reads beyond the model's, with main()'s defaults
TRAINER_DEFAULTS = dict(lr=1e-5, liger="off", data=None, compile_mode="default", no_cuda_graphs=False)


def trainer_worker(a) -> dict:
    """The user's path: stock ``Trainer`` (bf16, peers) or ``LowBitTrainer`` (ours) with the same
    ``TrainingArguments`` (torch_compile, bf16, fused AdamW, gradient accumulation); whatever compile
    mode or caching ``LowBitTrainer`` picks by itself is what it gets."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments
    from hf_lowbit.integrations.throughput import mfu, model_flops, peak_tflops

    for name, default in TRAINER_DEFAULTS.items():  # callers other than main() (benchmark_fsdp2) set fewer flags
        if not hasattr(a, name):
            setattr(a, name, default)
    model = build_model(a, a.device)
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.config.cache_size_limit = max(64, 2 * a.layers)
    gen = torch.Generator().manual_seed(0)
    total = a.warmup + a.steps
    ids = load_blocks(a) if a.data else torch.randint(0, a.vocab, (4 * a.batch, a.seq), generator=gen)
    data = [{"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)]} for i in range(total * a.batch * a.grad_accum)]
    times, graphs, losses, logged = {}, {}, [], {"train_mfu": [], "train_tokens_per_second": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (a.warmup, total):
                sync()
                times[state.global_step] = time.perf_counter()
                graphs[state.global_step] = counters["stats"]["unique_graphs"]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                for key, values in logged.items():  # LowBitTrainer's throughput logs, timed steps only
                    if key in logs and state.global_step > a.warmup:
                        values.append(logs[key])

    ours = a.recipe in (*OURS, *OURS_LORA)  # LoRA on a bf16 base and the peers: stock Trainer
    common = dict(output_dir=tempfile.mkdtemp(), report_to="none", per_device_train_batch_size=a.batch,
                  gradient_accumulation_steps=a.grad_accum, max_steps=total, learning_rate=a.lr,
                  optim="adamw_torch_fused", bf16=True, torch_compile=not a.no_compile, logging_steps=1,
                  save_strategy="no", dataloader_pin_memory=False, disable_tqdm=True, seed=0,
                  lr_scheduler_type="constant", use_cpu=not cuda, use_liger_kernel=a.liger == "on",
                  gradient_checkpointing=a.grad_checkpointing,
                  gradient_checkpointing_kwargs={"use_reentrant": False} if a.grad_checkpointing else None)
    if a.compile_mode != "default":
        common["torch_compile_mode"] = a.compile_mode
    if ours:
        lora = a.recipe in OURS_LORA  # LoRA r on every decoder linear, through LowBitTrainer's peft_config
        recipe_args = _LORA_ARGS[a.recipe] if lora else mixed_precision_args(a.recipe)
        args = LowBitTrainingArguments(**common, lowbit_min_features=a.min_features,
                                       lowbit_cuda_graphs=False if a.no_cuda_graphs else None,
                                       **recipe_args)
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear")
        trainer = LowBitTrainer(model, args=args, train_dataset=data, peft_config=peft_config)
        chosen = {"torch_compile_mode": args.torch_compile_mode, "weight_cache": trainer.lowbit_weight_cache,
                  "cuda_graphs": trainer.lowbit_cuda_graphs}
    else:
        trainer = Trainer(model, args=TrainingArguments(**common), train_dataset=data)
        chosen = {"torch_compile_mode": trainer.args.torch_compile_mode}
    trainer.add_callback(Clock())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    elapsed = times[total] - times[a.warmup]
    tokens = a.batch * a.seq * a.grad_accum * a.steps
    flops = model_flops(model)  # the swapped model (compiled copies share its modules)
    peak = peak_tflops(torch.device(a.device))
    chosen["liger"] = getattr(trainer.args, "liger_kernel_config", None) if a.liger == "on" else None
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"recipe": a.recipe, "path": "trainer", "liger": a.liger == "on", "tokens_per_s": tokens / elapsed,
            "step_ms": 1000 * elapsed / a.steps, "warmup_s": times[a.warmup] - t0,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
            "first_loss": losses[0] if losses else float("nan"), "last_loss": losses[-1] if losses else float("nan"),
            "mfu": mfu(flops, tokens, tokens * a.seq, elapsed, peak) if peak else None,  # as LowBitTrainer logs it
            "logged_mfu": mean(logged["train_mfu"]), "logged_tok_s": mean(logged["train_tokens_per_second"]),
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "chosen": chosen, "profile": None,
            "timed_recompiles": graphs[total] - graphs[a.warmup]}


def load_blocks(a):
    """``--data``: token blocks ``[n, seq]`` (int64, ``torch.save``d) to train on instead of random ids."""
    import torch

    blocks = torch.load(a.data)
    if blocks.dim() != 2 or blocks.shape[1] != a.seq or blocks.shape[0] < a.batch or int(blocks.max()) >= a.vocab:
        raise SystemExit(f"--data {a.data}: need >= {a.batch} blocks of {a.seq} ids below {a.vocab}, "
                         f"got shape {tuple(blocks.shape)}, max id {int(blocks.max())}")
    return blocks


def worker(a) -> dict:
    import torch
    from torch._dynamo.utils import counters

    if a.path == "trainer":
        return trainer_worker(a)
    cuda = a.device == "cuda"
    model = build_model(a, a.device, weight_cache=a.grad_accum > 1)  # as LowBitTrainer does by default
    mode = None if a.compile_mode == "default" else a.compile_mode
    if not a.no_compile:
        compile_layers(model, a.layers, mode=mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, fused=cuda)
    gen = torch.Generator(device=a.device).manual_seed(0)
    if a.data:  # real text: consecutive batches, all of them on the device, cycled when the run outlasts them
        blocks = load_blocks(a)
        batches = list(blocks[: len(blocks) // a.batch * a.batch].to(a.device).split(a.batch))
    else:
        batches = [torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device, generator=gen) for _ in range(4)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # CUDA graphs + gradient accumulation: .grad must exist outside the graphs (else the next replay
    # overwrites the buffer .grad was given); zeroed in place between steps
    keep_grads = mode == "reduce-overhead" and a.grad_accum > 1
    if keep_grads:
        for p in params:
            p.grad = torch.zeros_like(p)

    def step(i):
        for j in range(a.grad_accum):
            ids = batches[(i * a.grad_accum + j) % len(batches)]
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.autocast):
                loss = model(input_ids=ids, labels=ids).loss / a.grad_accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
        return loss * a.grad_accum

    t0 = time.perf_counter()
    losses = [step(i).item() for i in range(a.warmup)]
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    graphs_warm = counters["stats"]["unique_graphs"]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)] if cuda else []
    t0 = time.perf_counter()
    timed = []
    for i in range(a.steps):  # the batches after the warm-up's
        if cuda:
            events[i].record()
        timed.append(step(a.warmup + i))
    if cuda:
        events[-1].record()
    sync()
    elapsed = time.perf_counter() - t0
    step_times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(a.steps)) if cuda else []
    losses += [t.item() for t in timed]
    profile = None
    if a.profile and cuda:
        from benchmarks.driver import kernel_profile

        profile = kernel_profile(lambda: step(0))
    return {"recipe": a.recipe, "path": "layers", "tokens_per_s": a.batch * a.seq * a.grad_accum * a.steps / elapsed,
            "step_ms": 1000 * elapsed / a.steps, "warmup_s": warmup_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
            "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()), "profile": profile,
            "timed_recompiles": counters["stats"]["unique_graphs"] - graphs_warm,
            "step_ms_median": step_times[len(step_times) // 2] if step_times else None,
            "step_ms_range": [step_times[0], step_times[-1]] if step_times else None}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated, from {FULL_RECIPES + LORA_RECIPES}")
    for name, default in (("hidden", 4096), ("intermediate", 14336), ("heads", 32), ("kv_heads", 8),
                          ("vocab", 32000), ("layers", 8), ("batch", 8), ("seq", 2048), ("warmup", 3),
                          ("steps", 10), ("min_features", 64), ("lora_r", 16), ("grad_accum", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (constant)")
    p.add_argument("--data", default=None,
                   help="a torch.save'd int64 tensor [n, seq] of token blocks to train on (default: random ids)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    p.add_argument("--no_compile", action="store_true", help="run eagerly (smoke tests only)")
    p.add_argument("--no_cuda_graphs", action="store_true",
                   help="trainer path: LowBitTrainer(lowbit_cuda_graphs=False), to compare with its automatic choice")
    p.add_argument("--grad_checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    p.add_argument("--autocast", action="store_true",
                   help="forward under bf16 autocast, as Trainer(bf16=True) runs it (PEFT's float32 adapters compute in bf16)")
    p.add_argument("--path", choices=("layers", "trainer"), default="layers",
                   help="layers: a hand loop over the model with each decoder layer compiled; trainer: stock Trainer "
                        "(bf16, peers) vs LowBitTrainer (our recipes: int8, fp8, their variants, LoRA), same TrainingArguments, "
                        "whole-model compile")
    p.add_argument("--compile_mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                   help="torch.compile mode, for every recipe alike (trainer path: default lets LowBitTrainer choose)")
    p.add_argument("--liger", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="trainer path: use_liger_kernel=True for every recipe (on, or the bare flag), or each recipe "
                        "without and then with it (both); needs liger-kernel installed")
    p.add_argument("--json", default=None, help="write results here (rewritten after every recipe)")
    p.add_argument("--markdown", default=None)
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile two steps (CUDA): device time per kernel category and the top kernels")
    p.add_argument("--timeout", type=int, default=900, help="seconds per recipe process")
    p.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # worker mode
    a = p.parse_args()
    if a.liger != "off" and a.path != "trainer":
        raise SystemExit("--liger: the trainer path only (--path trainer): transformers applies Liger in Trainer.train()")
    if a.recipe:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmark_train.py needs a CUDA GPU (--device cpu only smoke-tests the script)")
    from benchmarks.driver import git_commit

    meta = {"commit": git_commit(), "gpu": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(sys.argv), "config": {k: getattr(a, k) for k in (
                "hidden", "intermediate", "heads", "kv_heads", "vocab", "layers", "batch", "seq", "warmup", "steps",
                "lora_r", "grad_checkpointing", "autocast", "grad_accum", "path", "compile_mode", "liger", "lr",
                "data")}}
    try:
        import torchao

        meta["torchao"] = torchao.__version__
    except ImportError:
        meta["torchao"] = None
    from benchmarks.driver import run_worker, write_results

    rows = []
    # the worker gets --device, every int flag and every switch that is on
    base_args = ["--device", a.device]
    for k, v in vars(a).items():
        if isinstance(v, bool):
            base_args += [f"--{k}"] if v else []
        elif isinstance(v, (int, float)) or (k in ("path", "compile_mode", "data") and v is not None):
            base_args += [f"--{k}", str(v)]
    recipes = a.recipes.split(",")
    for recipe in recipes:
        if recipe not in FULL_RECIPES + LORA_RECIPES:
            raise SystemExit(f"--recipes: unknown recipe {recipe!r}; choose from {', '.join(FULL_RECIPES + LORA_RECIPES)}")
    ligers = {"off": ("off",), "on": ("on",), "both": ("off", "on")}[a.liger]
    for recipe, liger in [(r, lg) for r in recipes for lg in ligers]:
        cmd = [sys.executable, os.path.abspath(__file__), *base_args, "--liger", liger, "--recipe", recipe]
        row = run_worker(cmd, {"recipe": recipe, "liger": liger == "on"}, a.timeout)
        rows.append(row)
        for r in rows:  # full fine-tunes vs bf16 (without Liger where run); LoRA rows vs the first LoRA row
            ref = "bf16" if r["recipe"] in FULL_RECIPES else next((x["recipe"] for x in rows if x["recipe"] in LORA_RECIPES), None)
            refs = [x for x in rows if x["recipe"] == ref and "error" not in x]
            base = next((x for x in refs if not x.get("liger")), refs[0] if refs else None)
            if base and "error" not in r:
                r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
                r["mem_vs_bf16"] = r["peak_mem_gib"] / base["peak_mem_gib"]
                r["reference"] = ref + (" + liger" if base.get("liger") else "")
            plain = next((x for x in rows if x["recipe"] == r["recipe"] and not x.get("liger") and "error" not in x), None)
            if r.get("liger") and plain and "error" not in r:
                r["vs_no_liger"] = r["tokens_per_s"] / plain["tokens_per_s"]
        print(json.dumps(row), flush=True)
        if a.json:
            os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)
    table = ["| recipe | tok/s | vs ref | MFU | peak GiB | mem vs ref | warm-up s | first loss | last loss | graphs | breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["recipe"] + (" + liger" if r.get("liger") else "")
        if "error" in r:
            table.append(f"| {label} | error: {r['error'].strip().splitlines()[-1][:80] if r['error'].strip() else '?'} ||||||||||")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "–"
        table.append(f"| {label} | {r['tokens_per_s']:.0f} | {r.get('vs_bf16', float('nan')):.2f}x | {mfu} | "
                     f"{r['peak_mem_gib']:.1f} | {r.get('mem_vs_bf16', float('nan')):.2f}x | {r['warmup_s']:.0f} | "
                     f"{r['first_loss']:.3f} | {r['last_loss']:.3f} | {r['compiled_graphs']} | {r['graph_breaks']} |")
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        cats = sorted({c for r in profiled for c in r["profile"]["categories_ms"]})
        table += ["", "Device ms per step by kernel category (torch.profiler, 2 steps):", "",
                  "| category | " + " | ".join(r["recipe"] for r in profiled) + " |", "|---|" + "---|" * len(profiled)]
        table += [f"| {c} | " + " | ".join(f"{r['profile']['categories_ms'].get(c, 0.0):.1f}" for r in profiled) + " |"
                  for c in cats]
        table.append("| **total** | " + " | ".join(f"{r['profile']['device_ms_per_step']:.1f}" for r in profiled) + " |")

    write_results({"meta": meta, "rows": rows}, table,
                  f"{meta['gpu']}, torch {meta['torch']}, torchao {meta['torchao']}, config {meta['config']}",
                  a.json, a.markdown)


if __name__ == "__main__":
    main()
