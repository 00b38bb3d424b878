"""Low-bit (INT8 / FP8) mixed-precision linear: each matmul vs a float reference, switches, extremes, compile."""

import pytest
import torch
import torch.nn.functional as F
from conftest import snr_db, tiny_model
from torch import nn

from hf_lowbit import MixedPrecisionConfig, LowBitLinear, LowBitTrainingArguments, prepare_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _grads(fn, x, w, b):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = fn(x, w, b)
    gy = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(1), device=y.device).to(y.dtype)
    y.backward(gy)
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_matmul_snr_vs_float(device, dtype, fmt):
    x = torch.randn(4, 64, 256, device=device, dtype=dtype)
    w = (torch.randn(384, 256, device=device) / 16).to(dtype)
    b = torch.randn(384, device=device, dtype=dtype)
    ref = _grads(lambda x, w, b: F.linear(x.double(), w.double(), b.double()), x, w, b)
    lin = LowBitLinear(256, 384, device=device, dtype=dtype, config=MixedPrecisionConfig(format=fmt))
    got = _grads(lambda x, w, b: torch.func.functional_call(lin, {"weight": w, "bias": b}, (x,)), x, w, b)
    for name, r, g in zip(("output", "grad_input", "grad_weight", "grad_bias"), ref, got):
        assert g.dtype == dtype, name
        assert snr_db(r, g) >= 20, f"{name}: {snr_db(r, g):.1f} dB"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("which", ["output", "grad_input", "grad_weight"])
def test_switching_a_matmul_off_makes_it_exact(which, fmt):
    x, w, b = torch.randn(32, 64), torch.randn(48, 64), torch.randn(48)
    only = MixedPrecisionConfig(format=fmt, **{k: k != which for k in ("output", "grad_input", "grad_weight")})
    lin = LowBitLinear(64, 48, config=only)
    ref = _grads(F.linear, x, w, b)
    got = _grads(lambda x, w, b: torch.func.functional_call(lin, {"weight": w, "bias": b}, (x,)), x, w, b)
    idx = {"output": 0, "grad_input": 1, "grad_weight": 2}[which]
    torch.testing.assert_close(got[idx], ref[idx], rtol=1e-5, atol=1e-5)
    others = [i for i in range(3) if i != idx]
    assert all(not torch.allclose(got[i], ref[i], rtol=1e-6, atol=1e-6) for i in others)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_nan_input_reaches_output(fmt):
    lin = LowBitLinear(32, 16, config=MixedPrecisionConfig(format=fmt))
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    y = lin(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_all_zero_rows_give_zero_not_nan(fmt):
    lin = LowBitLinear(32, 16, bias=False, config=MixedPrecisionConfig(format=fmt))
    x = torch.zeros(4, 32, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert (y == 0).all() and torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()


def test_frozen_weight_gets_no_grad_and_autocast_dtype():
    lin = LowBitLinear(64, 32)
    lin.weight.requires_grad_(False)
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    # the input is kept for backward only when a weight gradient will need it
    assert not any(t is x for t in y.grad_fn.saved_tensors)
    y.float().sum().backward()
    assert lin.weight.grad is None and x.grad.dtype == torch.float32 and lin.bias.grad.dtype == torch.float32
    lin.weight.requires_grad_(True)
    z = lin(x)
    assert any(t is x for t in z.grad_fn.saved_tensors)
    z.sum().backward()
    assert lin.weight.grad is not None


def test_from_linear_shares_parameters_and_state_dict():
    linear = nn.Linear(64, 32)
    new = LowBitLinear.from_linear(linear, MixedPrecisionConfig(format="fp8"))
    assert new.weight is linear.weight and new.bias is linear.bias
    assert list(new.state_dict()) == list(linear.state_dict())


def _swapped_tiny(recipe, **kw):
    model = tiny_model(**kw)
    args = LowBitTrainingArguments(output_dir="unused", lowbit_min_features=16, report_to="none", **{recipe: True})
    return prepare_model(model, args)


@pytest.mark.parametrize("recipe", ["int8_mixed_precision", "fp8_mixed_precision"])
def test_compile_fullgraph_no_graph_break(recipe):
    torch._dynamo.reset()
    model = _swapped_tiny(recipe)
    ids = torch.randint(0, 96, (2, 16))
    explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = model(input_ids=ids, labels=ids).loss
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-4, atol=1e-4)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bad_format_rejected():
    with pytest.raises(ValueError, match="format must be one of"):
        MixedPrecisionConfig(format="int4")
