"""use_liger_kernel=True beside the low-bit swaps (hf_lowbit.integrations.liger): which modules each owns for INT8/FP8 full
fine-tuning, QLoRA and LowBitSFTTrainer, the LM-head conflict named by its argument, and training steps with
Liger's kernels under Triton's CPU interpreter (a subprocess: tests/_liger_checks.py)."""

import json
import math
import os
import subprocess
import sys
from functools import partial

import pytest
from conftest import arithmetic_blocks, lowbit_args, tiny_model
from peft import LoraConfig, PeftModel
from torch import nn

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install 'hf_lowbit[liger]')")

from hf_lowbit import (LoraLinear, LowBitTrainer, MixedPrecisionLinear,  # noqa: E402
                       Nf4Linear, QATLinear)
from hf_lowbit.integrations.liger import apply_liger, liger_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _stock_llama_module():
    """Liger also rebinds names in ``modeling_llama`` (``LlamaRMSNorm``, ``LlamaMLP``, ``apply_rotary_pos_emb``;
    ``LlamaForCausalLM.forward`` when patching the class) for the whole process: put them back, so later tests
    build and run stock models (Liger's Triton kernels cannot run on a CPU outside the interpreter)."""
    from transformers.models.llama import modeling_llama

    saved, forward = dict(vars(modeling_llama)), modeling_llama.LlamaForCausalLM.forward
    yield
    for name, value in saved.items():
        if vars(modeling_llama).get(name) is not value:
            setattr(modeling_llama, name, value)
    modeling_llama.LlamaForCausalLM.forward = forward


_args = partial(lowbit_args, lowbit_min_features=16, use_liger_kernel=True)


def _liger_owns(model) -> set[str]:
    return {e.name for e in liger_report(model).entries}


LIGER_MODULES = {"model.norm", "lm_head"} | {f"model.layers.{i}.{m}" for i in range(2) for m in (
    "mlp", "self_attn", "input_layernorm", "post_attention_layernorm")}


@pytest.mark.parametrize("recipe", ["int8_mixed_precision", "fp8_mixed_precision"])
def test_full_finetune_recipe_owns_the_linears_liger_the_rest(tmp_path, recipe):
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, **{recipe: True}), train_dataset=arithmetic_blocks(8))
    model = trainer.model
    layer = model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP" and layer.input_layernorm._get_name() == "LigerRMSNorm"
    assert model.model.norm._get_name() == "LigerRMSNorm"
    projections = [getattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")] + [
        getattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert all(isinstance(p, MixedPrecisionLinear) for p in projections)  # Liger's MLP forward calls ours
    assert model.forward.__func__.__module__.startswith("liger_kernel")  # fused linear cross-entropy
    assert type(model.lm_head) is nn.Linear  # ... reads lm_head.weight: the head stays in the compute dtype

    report = trainer.lowbit_reports[-1]
    assert [r.recipe for r in trainer.lowbit_reports] == [recipe, "liger"]
    assert {e.name for e in report.entries} == LIGER_MODULES
    text = report.summary()
    assert text.startswith("[hf_lowbit] liger: 10 modules patched")
    assert "LigerSwiGLUMLP: Liger's fused SiLU-and-multiply between its own projections (MixedPrecisionLinear)" in text

    # Trainer.train() applies Liger again with the same config: nothing changes
    apply_liger(model, trainer.args.liger_kernel_config)
    assert _liger_owns(model) == LIGER_MODULES and isinstance(layer.mlp.down_proj, MixedPrecisionLinear)


def test_a_model_built_after_a_class_level_patch_is_swapped_too(tmp_path):
    """``apply_liger_kernel_to_llama()`` before loading builds ``LigerSwiGLUMLP`` with its own ``nn.Linear``s:
    the mixin's swap comes after, so they become low-bit all the same."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama()
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, use_liger_kernel=False, int8_mixed_precision=True),
                            train_dataset=arithmetic_blocks(8))
    mlp = trainer.model.model.layers[0].mlp
    assert type(mlp).__name__ == "LigerSwiGLUMLP" and isinstance(mlp.gate_proj, MixedPrecisionLinear)
    assert sum(isinstance(m, MixedPrecisionLinear) for m in trainer.model.modules()) == 14


def test_without_the_flag_liger_is_not_applied(tmp_path):
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, use_liger_kernel=False, int8_mixed_precision=True),
                            train_dataset=arithmetic_blocks(8))
    assert [r.recipe for r in trainer.lowbit_reports] == ["int8_mixed_precision"]
    assert _liger_owns(trainer.model) == set()


def test_qlora_bases_and_adapters_under_liger(tmp_path):
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, lora_base_quant="nf4", int8_mixed_precision=True),
                            train_dataset=arithmetic_blocks(8), peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert isinstance(trainer.model, PeftModel)
    base = trainer.model.get_base_model()
    mlp = base.model.layers[1].mlp
    assert mlp._get_name() == "LigerSwiGLUMLP"
    assert isinstance(mlp.up_proj, LoraLinear) and isinstance(mlp.up_proj.base_layer, Nf4Linear)
    assert type(base.lm_head) is nn.Linear and not base.lm_head.weight.requires_grad  # frozen, bf16, Liger's FLCE
    assert base.forward.__func__.__module__.startswith("liger_kernel")
    assert _liger_owns(trainer.model) == LIGER_MODULES
    assert "(LoraLinear)" in trainer.lowbit_reports[-1].summary()


def test_sft_trainer_keeps_its_fused_head_liger_takes_the_layers(tmp_path):
    pytest.importorskip("trl")
    from test_trl import TOKENIZER, _chat

    from hf_lowbit import LowBitSFTConfig, LowBitSFTTrainer

    args = LowBitSFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_length=32,
                           lowbit_min_features=16, int8_mixed_precision=True, use_liger_kernel=True)
    with pytest.warns(FutureWarning, match="use_liger_kernel"):  # trl 1.16 deprecates the flag, still applies it
        trainer = LowBitSFTTrainer(model=tiny_model(vocab_size=len(TOKENIZER)), args=args, train_dataset=_chat(8),
                                   processing_class=TOKENIZER)
    assert trainer.args.liger_kernel_config["fused_linear_cross_entropy"] is False  # trl's own fused LM head instead
    layer = trainer.model.model.layers[0]
    assert layer.mlp._get_name() == "LigerSwiGLUMLP" and isinstance(layer.mlp.gate_proj, MixedPrecisionLinear)
    assert not trainer.model.forward.__func__.__module__.startswith("liger_kernel")
    assert _liger_owns(trainer.model) == LIGER_MODULES - {"lm_head"}


def test_a_head_liger_would_bypass_is_refused_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"qat_include_lm_head=True with use_liger_kernel=True.*"
                                         r"liger_kernel_config=\{'fused_linear_cross_entropy': False\}"):
        _args(tmp_path, qat_scheme="8da4w", qat_group_size=32, qat_include_lm_head=True)
    # without the fused cross-entropy Liger leaves the head alone: the fake-quantized head trains as asked
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, qat_scheme="8da4w", qat_group_size=32, qat_include_lm_head=True,
                                                liger_kernel_config={"fused_linear_cross_entropy": False}),
                            train_dataset=arithmetic_blocks(8))
    assert isinstance(trainer.model.lm_head, QATLinear)
    assert _liger_owns(trainer.model) == LIGER_MODULES - {"lm_head"}
    # the same for the INT8/FP8 head (lowbit_include_lm_head)
    with pytest.raises(ValueError, match=r"lowbit_include_lm_head=True with use_liger_kernel=True.*"
                                         r"liger_kernel_config=\{'fused_linear_cross_entropy': False\}"):
        _args(tmp_path, int8_mixed_precision=True, lowbit_include_lm_head=True)
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path, int8_mixed_precision=True, lowbit_include_lm_head=True,
                                                liger_kernel_config={"fused_linear_cross_entropy": False}),
                            train_dataset=arithmetic_blocks(8))
    assert isinstance(trainer.model.lm_head, MixedPrecisionLinear)
    assert _liger_owns(trainer.model) == LIGER_MODULES - {"lm_head"}
    with pytest.raises(ValueError, match="LoRA adapter on the LM head.*fused_linear_cross_entropy"):
        LowBitTrainer(tiny_model(), _args(tmp_path, int8_mixed_precision=True), train_dataset=arithmetic_blocks(8),
                      peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))


def test_training_steps_run_liger_kernels_over_lowbit_linears(tmp_path):
    """INT8 with Liger (SwiGLU, RoPE, fused cross-entropy) gives the losses INT8 without Liger gives, with every
    low-bit linear called and the LM head's module never (the fused kernel reads its weight); QLoRA trains."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_liger_checks.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    plain, liger, qlora = result["int8"], result["int8_liger"], result["qlora_liger"]
    steps, layers = 2, 2  # one micro-batch per step
    assert plain["calls"] == {"lowbit": 14 * steps, "lm_head": steps, "swiglu": 0}
    assert liger["calls"] == {"lowbit": 14 * steps, "lm_head": 0, "swiglu": layers * steps}
    assert liger["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert qlora["calls"]["lowbit"] == 14 * steps and qlora["calls"]["lm_head"] == 0
    assert all(math.isfinite(x) for x in qlora["losses"]) and qlora["lora_b_trained"] and all(qlora["lora_b_trained"])


def test_liger_with_compiled_low_bit_recipes_warns_with_the_measurement(tmp_path):
    """Measured on the H200: Liger breaks the compiled graph and costs the INT8 speedup; the user is told."""
    from hf_lowbit.warnings import LowBitWarning

    with pytest.warns(LowBitWarning, match="torch_compile=True.*0.85x bf16 instead of 1.07x"):
        LowBitTrainer(tiny_model(), _args(tmp_path, int8_mixed_precision=True, torch_compile=True),
                      train_dataset=arithmetic_blocks(8))
    import warnings

    with warnings.catch_warnings(record=True) as seen:  # without compile: no such warning
        warnings.simplefilter("always")
        LowBitTrainer(tiny_model(), _args(tmp_path, int8_mixed_precision=True), train_dataset=arithmetic_blocks(8))
    assert not [w for w in seen if "use_liger_kernel=True with torch_compile" in str(w.message)]
