"""hf_lowbit.qat.serving: torchao weights unwrapped to plain tensors (rebuilt in the graph) and generate's compile
config with the nn-module guards skipped. The same results as the tensor-subclass model, eagerly and compiled."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from hf_lowbit.qat import serving
from hf_lowbit.qat.serving import prepare_for_serving, unwrap_quantized_weights


def _int4_model():
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_

    model = tiny_model().to(torch.bfloat16).eval()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    return model


def test_unwrap_keeps_plain_parameters_and_rebuilds_the_same_weights():
    model = _int4_model()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    done = unwrap_quantized_weights(model)
    assert len(done) == 2 * 7 + 1 and set(done.values()) == {"IntxUnpackedToInt8Tensor"}  # lm_head too
    assert "lm_head" in done and "model.layers.1.mlp.down_proj" in done
    assert all(type(p) is nn.Parameter for p in model.parameters())  # what Dynamo and AOTAutograd see
    originals = [p for n, p in model.named_parameters() if ".parametrizations.weight.original" in n]
    assert len(originals) == 3 * len(done) and not any(p.requires_grad for p in originals)
    up = model.model.layers[0].mlp.up_proj
    assert type(up.weight).__name__ == "IntxUnpackedToInt8Tensor"  # read back: the quantized weight
    assert [p.dtype for p in up.parametrizations.weight.parameters()] == [torch.int8, torch.bfloat16, torch.int8]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    assert unwrap_quantized_weights(model) == {}  # already unwrapped: left as it is
    plain = tiny_model()
    assert unwrap_quantized_weights(plain) == {} and not any(hasattr(m, "parametrizations") for m in plain.modules())


def test_unwrapped_model_compiles_to_one_graph_with_the_same_output():
    model = _int4_model()
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        unwrap_quantized_weights(model)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(ids).logits, ref)
    torch._dynamo.reset()


def test_float8_weights_unwrap_and_compile(monkeypatch):
    """torchao's own unwrap_tensor_subclass does not compile for Float8Tensor (Dynamo cannot put the rebuild's
    act_quant_kwargs dataclass in the graph; on the H200, torch 2.11: "'Float8Tensor' object has no attribute
    'block_size'"); one allow_in_graph rebuild per weight does. Per-tensor scales: the row-wise FP8 matmul has no
    CPU kernel in every torch."""
    from torchao import quantization as tq
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a, **k: None)  # quantizing needs no GPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
    tq.quantize_(model, tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerTensor()))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        assert unwrap_quantized_weights(model) == {"0": "Float8Tensor"}
        assert [p.dtype for p in model.parameters()] == [torch.float8_e4m3fn, torch.float32]
        assert torch.equal(model(x), ref)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(model, backend="aot_eager", fullgraph=True)(x), ref)
    torch._dynamo.reset()


def test_serving_compile_config_is_reduce_overhead_with_the_guard_filter():
    config = serving.serving_compile_config()
    assert config.backend == "inductor" and config.mode is None  # torch.compile takes mode or options, not both
    assert config.options == {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                              "triton.cudagraphs": True}
    assert torch._inductor.list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}  # what it replaces
    assert serving.serving_compile_config("inductor", cudagraphs=False).options == {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    assert set(serving.serving_compile_config("aot_eager").options) == {"guard_filter_fn"}


def test_prepare_for_serving_generates_the_same_tokens_with_fewer_guards():
    """transformers' compiled generate (static cache; aot_eager on the CPU): the unwrapped, guard-filtered model
    decodes the tokens the tensor-subclass model decodes eagerly, and its decode step checks fewer guards than
    the subclass model's under transformers' default compile config."""
    from transformers import CompileConfig

    from benchmarks.serve_host_calls import compiled_guards

    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static"}
    guards = {}
    for lean in (False, True):
        model = _int4_model()
        with torch.no_grad():
            ref = model.generate(ids, disable_compile=True, **kw)
            config = prepare_for_serving(model, backend="aot_eager") if lean else CompileConfig(backend="aot_eager")
            config._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
            torch._dynamo.reset()
            out = model.generate(ids, compile_config=config, **kw)
        assert torch.equal(out, ref), lean
        entries = compiled_guards()
        assert len(entries) == 1  # the decode step
        guards[lean] = sum(entries[0].values())
    torch._dynamo.reset()
    assert guards[True] < guards[False] / 2, guards


def test_guard_filter_missing_in_an_old_torch_is_said(monkeypatch):
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
    model = _int4_model()
    with pytest.raises(RuntimeError, match="guard filtering needs torch >= 2.8"):
        prepare_for_serving(model)
    assert not any(hasattr(m, "parametrizations") for m in model.modules())  # the model left as it was
