"""The swap walker and its report."""

import torch
from conftest import tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from hf_lowbit import LowBitLinear, LinearFilter, LowBitTrainingArguments, prepare_model, swap_linears
from hf_lowbit.prepare import apply_recipes


def _args(**kw):
    return LowBitTrainingArguments(output_dir="unused", int8_mixed_precision=True, report_to="none", **kw)


def _by_name(report):
    return {e.name: e for e in report.entries}


def test_report_for_excluded_tiny_and_non_linear_layers():
    model = tiny_model(intermediate_size=32)  # MLP: 64 -> 32 -> 64; q/o 64x64; k/v 32x64
    model, (report,) = apply_recipes(model, _args(lowbit_min_features=48, lowbit_exclude_modules=["lm_head", "*.o_proj"]))
    e = _by_name(report)
    assert e["model.layers.0.self_attn.q_proj"].action == "swapped"
    assert isinstance(model.model.layers[0].self_attn.q_proj, LowBitLinear)
    assert "too small" in e["model.layers.0.self_attn.k_proj"].reason
    assert "too small" in e["model.layers.1.mlp.down_proj"].reason
    assert e["model.layers.1.self_attn.o_proj"].reason == "excluded by pattern '*.o_proj'"
    assert e["lm_head"].reason == "excluded by pattern 'lm_head'"
    assert "lookup" in e["model.embed_tokens"].reason
    assert type(model.model.layers[1].self_attn.o_proj) is nn.Linear
    assert len(report.swapped) == 2  # q_proj of each layer
    summary = report.summary()
    assert "model.layers.*.self_attn.q_proj (x2)" in summary and "2 modules swapped" in summary


def test_output_embedding_excluded_whatever_its_name():
    model = tiny_model()
    model.out_head = model.lm_head  # give the LM head a second, unmatched name
    _, (report,) = apply_recipes(model, _args(lowbit_min_features=16, lowbit_exclude_modules=["nothing"]))
    assert "output embedding" in _by_name(report)["lm_head"].reason
    assert type(model.lm_head) is nn.Linear


def test_gpt2_conv1d_reported_not_swapped():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=64))
    _, (report,) = apply_recipes(model, _args(lowbit_min_features=16))
    e = _by_name(report)
    assert e["transformer.h.0.attn.c_attn"].module_type == "Conv1D"
    assert "not an nn.Linear" in e["transformer.h.0.attn.c_attn"].reason
    assert not report.swapped


def test_prepare_twice_is_harmless_and_state_dict_keys_unchanged(capsys):
    model = tiny_model()
    keys = list(model.state_dict())
    weight = model.model.layers[0].mlp.up_proj.weight
    args = _args(lowbit_min_features=16)
    prepare_model(model, args)
    assert "[hf_lowbit] int8_mixed_precision: 14 modules swapped" in capsys.readouterr().out
    assert model.model.layers[0].mlp.up_proj.weight is weight
    _, (again,) = apply_recipes(model, args)
    assert not again.swapped and all(e.reason == "already INT8 matmuls" for e in again.entries if "proj" in e.name)
    assert list(model.state_dict()) == keys


def test_walker_with_custom_factory_and_glob():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)))
    report = swap_linears(model, lambda name, lin: nn.Identity(), recipe="test", target="identity",
                          filter=LinearFilter(exclude=("2.*",)))
    assert isinstance(model[0], nn.Identity) and isinstance(model[2][0], nn.Linear)
    assert [e.action for e in report.entries] == ["swapped", "skipped"]


def test_each_replaced_linear_is_let_go_before_the_next_is_made():
    """A recipe whose module holds new bytes (a QLoRA base's codes) must not peak at the old model plus every
    replacement: the walker keeps no replaced linear alive once the next one is made."""
    import gc
    import weakref

    model = tiny_model(num_hidden_layers=2)
    gc.collect()
    replaced, alive_at_each_make = [], []

    def make(name, linear):
        alive_at_each_make.append(sum(r() is not None for r in replaced))
        replaced.append(weakref.ref(linear))
        return nn.Identity()

    report = swap_linears(model, make, recipe="test", target="identity", filter=LinearFilter(min_features=1))
    assert len(report.swapped) == 14 and alive_at_each_make == [0] * 14
    assert all(r() is None for r in replaced)


def test_recipe_off_leaves_model_alone():
    model = tiny_model()
    prepared = prepare_model(model, LowBitTrainingArguments(output_dir="unused", report_to="none"))
    assert prepared is model
    assert not any(isinstance(m, LowBitLinear) for m in model.modules())


def test_fp8_skips_layers_its_kernel_cannot_take():
    model = tiny_model(intermediate_size=120)  # 120 is not a multiple of 16
    _, (report,) = apply_recipes(model, LowBitTrainingArguments(output_dir="unused", fp8_mixed_precision=True,
                                                                report_to="none", lowbit_min_features=16))
    e = _by_name(report)
    assert report.recipe == "fp8_mixed_precision"
    assert e["model.layers.0.self_attn.q_proj"].reason == "FP8 matmuls"
    assert e["model.layers.0.mlp.up_proj"].reason == "shape not supported: in and out features must be multiples of 16"


def test_lm_head_swapped_only_with_lowbit_include_lm_head():
    """The head is "excluded" by default (the default pattern), swapped with the flag, which wins over a pattern that
    names it (as QAT's include_lm_head: the default list names it); other patterns still apply."""
    _, (without,) = apply_recipes(tiny_model(), _args(lowbit_min_features=16))
    assert _by_name(without)["lm_head"].reason == "excluded by pattern 'lm_head'"
    model, (report,) = apply_recipes(tiny_model(), _args(lowbit_min_features=16, lowbit_include_lm_head=True,
                                                         lowbit_exclude_modules=["lm_head", "*.o_proj"]))
    e = _by_name(report)
    assert e["lm_head"].action == "swapped" and e["lm_head"].reason == "INT8 matmuls"
    assert isinstance(model.lm_head, LowBitLinear) and model.lm_head.lowbit_config.include_lm_head
    assert e["model.layers.0.self_attn.o_proj"].reason == "excluded by pattern '*.o_proj'"
    assert "lm_head [Linear 96x64]: INT8 matmuls" in report.summary()


def test_lm_head_vocab_not_a_multiple_of_16_is_skipped_by_fp8_and_reported():
    """FP8's alignment applies to the head as to any linear: a vocab of 100 is skipped with the reason; INT8 takes it."""
    heads = {}
    for recipe in ("fp8_mixed_precision", "int8_mixed_precision"):
        args = LowBitTrainingArguments(output_dir="unused", report_to="none", lowbit_min_features=16,
                                       lowbit_include_lm_head=True, **{recipe: True})
        _, (report,) = apply_recipes(tiny_model(vocab_size=100), args)
        heads[recipe] = _by_name(report)["lm_head"]
    assert heads["fp8_mixed_precision"].action == "skipped"
    assert heads["fp8_mixed_precision"].reason == "shape not supported: in and out features must be multiples of 16"
    assert (heads["int8_mixed_precision"].action, heads["int8_mixed_precision"].reason) == ("swapped", "INT8 matmuls")
