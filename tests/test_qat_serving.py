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


def test_deferred_stop_check_is_allowed_on_cuda_inside_the_block_only():
    """transformers' own rule (MPS only) outside the block; inside it CUDA counts as MPS, and upstream's other
    conditions (an assistant model, a returned cache that cannot roll back) still refuse."""
    from transformers.cache_utils import DynamicCache
    from transformers.generation.utils import DeferredStopCheck

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with serving.deferred_stop_check():
        installed = DeferredStopCheck.__dict__["is_supported"]
        assert DeferredStopCheck.is_supported(cuda, None, False, False)
        assert not DeferredStopCheck.is_supported(cpu, None, False, False)  # no events on the CPU
        assert not DeferredStopCheck.is_supported(cuda, None, False, True)  # an assistant: upstream's refusal
        cache = DynamicCache()
        assert DeferredStopCheck.is_supported(cuda, cache, True, False) == cache.is_croppable
        with serving.deferred_stop_check():  # nested: still on, the patch not stacked
            assert DeferredStopCheck.__dict__["is_supported"] is installed
        assert DeferredStopCheck.is_supported(cuda, None, False, False)
        copy = _serving_file_copy()  # a serving script's copy of the file shares the one installed flag
        assert copy._cuda_flag() is serving._cuda_flag()
        assert DeferredStopCheck.__dict__["is_supported"] is installed
    assert not DeferredStopCheck.is_supported(cuda, None, False, False)


def _serving_file_copy():
    import importlib.util

    spec = importlib.util.spec_from_file_location("copied_serving", serving.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_copy_of_the_file_defers_through_the_same_flag():
    from transformers.generation.utils import DeferredStopCheck

    copy = _serving_file_copy()
    with copy.deferred_stop_check():
        assert serving._cuda_flag().get()
        assert DeferredStopCheck.is_supported(torch.device("cuda"), None, False, False)
    assert not serving._cuda_flag().get()


def test_defer_stop_check_wraps_this_models_generate_only():
    """``defer_stop_check(model)``: the flag is on while this model generates (seen from its forward), off for
    another model of the same class; the same tokens; a second call wraps nothing more."""
    seen = []
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    model, other = tiny_model().eval(), tiny_model().eval()
    for m in (model, other):
        m.register_forward_hook(lambda *_: seen.append(serving._cuda_flag().get()))
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        assert serving.defer_stop_check(model) is model
        wrapped = model.generate
        assert serving.defer_stop_check(model).generate is wrapped
        seen.clear()
        assert torch.equal(model.generate(ids, **kw), ref)
        assert seen and all(seen)
        seen.clear()
        other.generate(ids, **kw)
        assert seen and not any(seen)
    assert not serving._cuda_flag().get()
    assert "generate" not in vars(other) and type(model).generate is type(other).generate


def test_a_deferred_models_copies_threads_and_pickles_defer_themselves():
    """``defer_stop_check``'s wrapper follows the model: a deep copy generates with its own weights (deferred), the
    model pickles and the loaded one defers too, and ``generate`` run in a thread (the streaming pattern) sets the
    flag there."""
    import copy
    import pickle
    import threading

    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(5))
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    model = serving.defer_stop_check(tiny_model().eval())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        calls = {"model": [], "clone": []}
        model.register_forward_hook(lambda *_: calls["model"].append(serving._cuda_flag().get()))
        clone.register_forward_hook(lambda *_: calls["clone"].append(serving._cuda_flag().get()))
        with torch.no_grad():
            clone.generate(ids, **kw)
        assert calls["model"] == [] and calls["clone"] and all(calls["clone"])
        model._forward_hooks.clear()
    seen = []
    model.register_forward_hook(lambda *_: seen.append(serving._cuda_flag().get()))
    thread = threading.Thread(target=lambda: model.generate(ids, **kw))
    thread.start()
    thread.join()
    assert seen and all(seen) and not serving._cuda_flag().get()


def test_prepare_for_serving_defers_where_transformers_can_and_says_where_not(monkeypatch):
    from transformers.generation import utils as generation

    from hf_lowbit.qat import has_deferred_stop_check  # public: a serving script can ask before it relies on it

    assert has_deferred_stop_check()  # transformers 5.17 (CI's and the device's) has it
    with_it = tiny_model()
    prepare_for_serving(with_it, backend="aot_eager")  # the default: deferred where transformers can
    assert getattr(vars(with_it).get("generate"), "_hf_lowbit_deferred", False)
    off = tiny_model()
    prepare_for_serving(off, backend="aot_eager", defer_stop=False)
    assert "generate" not in vars(off)
    monkeypatch.delattr(generation, "DeferredStopCheck")
    assert not has_deferred_stop_check()
    model = tiny_model()
    with pytest.raises(RuntimeError, match="transformers .* has no DeferredStopCheck.*serve without defer_stop_check"):
        prepare_for_serving(model, backend="aot_eager", defer_stop=True)
    assert "generate" not in vars(model)
    with pytest.warns(UserWarning, match="has no DeferredStopCheck, so generate waits for the GPU after every token"):
        prepare_for_serving(model, backend="aot_eager")  # the default: served without it, and said
    assert "generate" not in vars(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events: DeferredStopCheck runs on a GPU only")
@pytest.mark.parametrize("compiled", [False, True])
def test_deferred_stop_check_decodes_the_same_tokens_cuda(compiled, monkeypatch):
    """On CUDA the deferred check really runs (counted) and gives generate's tokens: stopped by length, and by an
    EOS met mid-way (the token decoded past it undone), at batch 1 and 2, eagerly and through the compiled path
    (static cache, CUDA graphs)."""
    from transformers.generation import utils as generation

    made = []
    init = generation.DeferredStopCheck.__init__
    monkeypatch.setattr(generation.DeferredStopCheck, "__init__",
                        lambda self, *a, **k: (made.append(1), init(self, *a, **k))[1])
    model = tiny_model().to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(4)).cuda()
    kw = {"do_sample": False, "pad_token_id": 0}
    if compiled:
        kw |= {"cache_implementation": "static", "compile_config": serving.serving_compile_config()}
    else:
        kw["disable_compile"] = True
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, min_new_tokens=12, **kw)
        eos = int(ref[0, 6 + 4])  # the first row's fifth new token: that row stops there
        for rows in (ids[:1], ids):
            for extra in ({"max_new_tokens": 12, "min_new_tokens": 12}, {"max_new_tokens": 12, "eos_token_id": eos}):
                want = model.generate(rows, **kw, **extra)
                assert not made
                with serving.deferred_stop_check():
                    got = model.generate(rows, **kw, **extra)
                assert made, "the deferred check did not run"
                made.clear()
                assert torch.equal(got, want), (rows.shape, extra)
    torch._dynamo.reset()
