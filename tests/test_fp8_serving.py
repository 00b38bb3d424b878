"""hf_lowbit.qat.fp8_serving: use_fp8_kernels swaps torchao's row-wise Float8Tensor linears for Fp8ServingLinear
(plain buffers, hf_lowbit::fp8_rowwise_linear); the swapped model computes what the torchao model computes."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

pytest.importorskip("torchao")

from hf_lowbit.qat.fp8_serving import Fp8ServingLinear, fp8_serving_problem, use_fp8_kernels  # noqa: E402

BF16 = torch.bfloat16


def _quantize(model, granularity="row", monkeypatch=None):
    """torchao's own convert (quantize_ with Float8DynamicActivationFloat8WeightConfig); on the CPU its sm_89 gate
    lifted (the quantization is device independent; the CPU matmul is torch's _scaled_mm)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_
    from torchao.quantization import quant_api

    if monkeypatch is not None:
        monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    g = PerRow() if granularity == "row" else PerTensor()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=g))
    return model


def test_use_fp8_kernels_swaps_row_wise_linears_and_keeps_the_logits(monkeypatch):
    model = _quantize(tiny_model().to(BF16).eval(), monkeypatch=monkeypatch)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    up = model.model.layers[0].mlp.up_proj.weight
    report = use_fp8_kernels(model, stack_siblings=False)  # one Fp8ServingLinear per linear (tests/test_siblings.py)
    assert len(report.swapped) == 2 * 7 + 1  # the lm_head too (quantize_ converts it: 96 x 64, multiples of 16)
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, Fp8ServingLinear) and (layer.out_features, layer.in_features) == (128, 64)
    assert layer.weight_codes.data_ptr() == up.qdata.data_ptr()  # the loaded bytes, not a copy
    assert torch.equal(layer.weight_scale, up.scale.reshape(-1))
    assert not any(type(t) not in (torch.Tensor, nn.Parameter) for t in model.state_dict().values())
    assert "fp8_kernels: 15 modules swapped, 1 left as they were" in str(report)  # the embedding: a lookup
    with torch.no_grad():
        out = model(ids).logits.float()
    # the same codes; per linear the float32 sums of one order or another, rounded to bf16, through 2 layers
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert not use_fp8_kernels(model).swapped  # nothing left to swap: no nn.Linear remains


def test_skips_say_why(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=True, dtype=BF16), nn.Linear(32, 48, bias=False, dtype=BF16),
                          nn.Linear(48, 16, dtype=BF16))
    _quantize(model[0], "row", monkeypatch)
    _quantize(model[1], "tensor", monkeypatch)
    report = use_fp8_kernels(model)
    reasons = {e.name: e.reason for e in report.skipped}
    assert [e.name for e in report.swapped] == ["0"] and isinstance(model[0], Fp8ServingLinear)
    assert model[0].bias is not None
    assert reasons["1"].startswith("tensor-wise scales") and type(model[1]) is nn.Linear
    assert reasons["2"] == "weight is Parameter, not a torchao Float8Tensor"
    assert "1 modules swapped, 2 left as they were" in str(report)
    assert fp8_serving_problem(nn.ReLU()).startswith("not an nn.Linear")
    with pytest.raises(ValueError, match="tensor-wise"):
        Fp8ServingLinear.from_linear(model[1])
    x = torch.randn(3, 64, dtype=BF16)
    assert model(x).shape == (3, 16)


@pytest.mark.parametrize("stack", [False, True])
def test_swapped_model_compiles_to_one_graph(monkeypatch, stack):
    """One graph, one op per served linear: 7 a layer, or 4 with q/k/v and gate/up stacked (hf_lowbit.qat.siblings);
    the LM head."""
    model = _quantize(tiny_model().to(BF16).eval(), monkeypatch=monkeypatch)
    use_fp8_kernels(model, stack_siblings=stack)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(ids)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        ops = [n for g in explained.graphs for n in g.graph.nodes if "fp8_rowwise_linear" in str(n.target)]
        assert len(ops) == 2 * (4 if stack else 7) + 1
        torch._dynamo.reset()
        assert torch.equal(torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits, ref)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_use_fp8_kernels_on_a_llama_8b_layer_cuda():
    """One Llama-8B-shaped layer and LM head quantized by torchao on the GPU, swapped; transformers' compiled
    generate (static cache) runs the swapped model without graph breaks.

    What "the same codes" guarantees, asserted as such:

    * prefill (24 rows > 16: every linear runs ``torch._scaled_mm`` as the export does, on torchao's codes): the
      logits bit for bit torchao's;
    * decode (M = 1: our GEMV, float32 sums, against torchao's fast-accumulating ``_scaled_mm``): each swapped
      linear, on the input the swapped model gives it, within what the two accumulations allow of the exact
      (float64) product of the same codes (ours <= torchao's + 1e-3, and < 4e-3: check_fp8_gemv_vs_scaled_mm);
    * decode logits: as near the unquantized bf16 model's as torchao's (``rel(ours) <= 1.25 * rel(torchao) +
      1e-3``; not the same top token: a random model's top logits are closer than FP8's noise).

    Session 12 held the logits to 1e-2 of torchao's and got 5.5e-2. Only the first linear of a chain sees the same
    input in both models: the outputs differ by bf16 roundings of differently accumulated sums (~2^-8 relative on
    some elements), and the next activation quantization turns that into whole e4m3 steps (2^-4..2^-3 relative)
    for the elements that sit within it of a rounding boundary, about 2^-8 / 2^-4 = 1/16 of them: ~sqrt(1/16) *
    2^-4 / sqrt(3) ≈ 1.8e-2 relative per quantized linear, through the 4 in series (qkv -> o -> gate/up -> down
    -> LM head) ~4-5e-2, the FP8 quantization error itself (the distance to the bf16 model) being of that order.
    On the CPU (tests above: both float32 sums) the roundings rarely differ and 1e-2 holds."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_lowbit.kernels.fp8_gemv import quantize_fp8_rows

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=BF16).cuda().eval()
    ids = torch.randint(0, 128256, (1, 24), device="cuda")  # 24 rows > 16: the prefill runs _scaled_mm, not the GEMV
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        bf16_decode = model(ids[:, :1]).logits.float()
    _quantize(model)
    with torch.no_grad():
        ref_prefill = model(ids).logits.float()
        ref_decode = model(ids[:, :1]).logits.float()
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = use_fp8_kernels(model, stack_siblings=False)  # per linear against torchao's (stacked: test_siblings.py)
    assert len(report.swapped) == 7 + 1
    inputs = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: inputs.__setitem__(n, args[0].detach())) for n in originals]
    with torch.no_grad():
        prefill = model(ids).logits.float()
        assert torch.equal(prefill, ref_prefill), rel(prefill, ref_prefill)
        decode = model(ids[:, :1]).logits.float()
        for h in hooks:
            h.remove()
        for n, orig in originals.items():  # each linear at M = 1 on the same input: ours vs torchao's
            mod, x = model.get_submodule(n), inputs[n].reshape(-1, orig.in_features)
            q, sx = quantize_fp8_rows(x)
            exact = (q.double() @ mod.weight_codes.double().T) * sx.double()[:, None] * mod.weight_scale.double()
            ours, theirs = mod(x).double(), orig(x).double()
            r_ours, r_ao = rel(ours, exact), rel(theirs, exact)
            assert r_ours < 4e-3 and r_ours <= r_ao + 1e-3, (n, r_ours, r_ao)
    r_ours, r_ao = rel(decode, bf16_decode), rel(ref_decode, bf16_decode)
    assert r_ours <= 1.25 * r_ao + 1e-3, (r_ours, r_ao, rel(decode, ref_decode))
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static"}
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kw)
        torch._dynamo.reset()
        compiled = model.generate(ids, **kw)
    assert compiled.shape == eager.shape
    torch._dynamo.reset()
