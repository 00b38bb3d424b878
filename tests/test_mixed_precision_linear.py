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


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
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


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
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


def test_nan_anywhere_reaches_the_whole_output_tensorwise():
    """One scale per tensor: a NaN in X makes X's scale NaN, so every output is NaN (never silently finite)."""
    lin = LowBitLinear(32, 16, config=MixedPrecisionConfig(format="fp8_tensorwise"))
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    assert torch.isnan(lin(x)).all() and torch.isfinite(lin(x[[0, 2, 3]])).all()


def test_tensorwise_outlier_sets_the_whole_scale():
    """What tensorwise gives up: one large outlier in X sets the scale of all of X, flushing the other rows' small
    codes towards zero (e4m3 keeps 2^-9 of its largest value), where row-wise scaling confines it to its own row."""
    x, w = torch.randn(64, 128), torch.randn(96, 128) / 11
    x[0, 0] = 1e5
    ref = x[1:].double() @ w.double().T
    snr = {}
    for fmt in ("fp8", "fp8_tensorwise"):
        lin = LowBitLinear(128, 96, bias=False, config=MixedPrecisionConfig(format=fmt))
        snr[fmt] = snr_db(ref, torch.func.functional_call(lin, {"weight": w}, (x,))[1:])
    assert snr["fp8"] >= 25 and snr["fp8_tensorwise"] < snr["fp8"] - 5, snr  # 28.7 vs 17.9 dB (seed 0)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
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


@pytest.mark.parametrize("recipe", ["int8_mixed_precision", "fp8_mixed_precision", "fp8_tensorwise_mixed_precision"])
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


# dual_grad_quant: dY's two quantizations from one op (hf_lowbit::quantize_dual), the same bits as the split path
def _dual_counted(monkeypatch, device="cpu", fmt="int8"):
    """Count the runs of ``hf_lowbit::quantize_dual``'s body (its plain-torch reference; on CUDA its Triton kernels,
    except for a tensorwise format, whose one scale needs none); compiled: when AOTAutograd traces into it (dynamo
    keeps the op opaque, so the count adds no graph break)."""
    import importlib

    from hf_lowbit.kernels import get_format

    name, fn = (("triton_quant", "quantize_dual_triton") if device == "cuda" and not get_format(fmt).tensorwise else
                ("quantize_dual", "quantize_dual_reference"))
    module = importlib.import_module(f"hf_lowbit.kernels.{name}")
    calls = []
    real = getattr(module, fn)
    monkeypatch.setattr(module, fn, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _dual_grads(fmt, dual, device="cpu", cache=False, compile=False, **config):
    torch.manual_seed(0)
    lin = LowBitLinear(64, 48, device=device, dtype=torch.bfloat16,
                       config=MixedPrecisionConfig(format=fmt, dual_grad_quant=dual, **config))
    with torch.no_grad():  # heterogeneous rows and columns, so a wrong per-row/per-column scale shows
        lin.weight.mul_(torch.logspace(-2, 1, 48, device=device, dtype=torch.bfloat16)[:, None])
        lin.weight[:, 5] *= 30
    lin.set_weight_cache(cache)
    f = torch.compile(lin, backend="inductor") if compile else lin
    x = torch.randn(3, 10, 64, device=device, dtype=torch.bfloat16) * torch.logspace(-1, 1, 10, device=device)[:, None]
    x = x.bfloat16().requires_grad_(True)
    y = f(x)
    y.backward(torch.randn(y.shape, device=device, generator=torch.Generator(device).manual_seed(1)).to(y.dtype)
               * torch.logspace(-2, 2, 48, device=device).bfloat16())
    return x.grad, lin.weight.grad, lin.bias.grad


def _assert_dual_equals_split(fmt, monkeypatch, device="cpu", **kw):
    calls = _dual_counted(monkeypatch, device, fmt)
    split = _dual_grads(fmt, False, device, **kw)
    assert not calls
    torch._dynamo.reset()
    dual = _dual_grads(fmt, True, device, **kw)
    assert calls  # the dual op ran (traced, when compiled)
    for name, a, b in zip(("dX", "dW", "db"), split, dual):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_dual_grad_quant_equals_split_path(fmt, cache, monkeypatch):
    _assert_dual_equals_split(fmt, monkeypatch, cache=cache)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_dual_grad_quant_compiled_equals_split_path_no_graph_break(fmt, monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _assert_dual_equals_split(fmt, monkeypatch, compile=True)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_dual_grad_quant_equals_split_path_cuda(fmt, cache, compile, monkeypatch):
    """On the GPU: quantize_dual's Triton kernels against Inductor's row quantization + quantize_t's kernels."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _assert_dual_equals_split(fmt, monkeypatch, "cuda", cache=cache, compile=compile)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("case", ["frozen_weight", "grad_weight_off", "grad_input_off"])
def test_dual_grad_quant_keeps_the_split_path_where_it_cannot_apply(case, monkeypatch):
    """Only one low-bit gradient matmul needs dY: no dual op, the same gradients as without the flag."""
    calls = _dual_counted(monkeypatch)
    config = {"grad_weight_off": {"grad_weight": False}, "grad_input_off": {"grad_input": False}}.get(case, {})
    grads = []
    for dual in (False, True):
        torch.manual_seed(0)
        lin = LowBitLinear(64, 48, config=MixedPrecisionConfig(format="int8", dual_grad_quant=dual, **config))
        lin.weight.requires_grad_(case != "frozen_weight")
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        lin(x).square().sum().backward()
        grads.append((x.grad, lin.weight.grad))
    assert not calls
    assert torch.equal(grads[0][0], grads[1][0])
    if case == "frozen_weight":
        assert grads[0][1] is None and grads[1][1] is None
    else:
        assert torch.equal(grads[0][1], grads[1][1])


def test_dual_grad_quant_refuses_stochastic_rounding():
    with pytest.raises(ValueError, match="dual_grad_quant=True with stochastic_rounding=True"):
        MixedPrecisionConfig(format="int8", dual_grad_quant=True, stochastic_rounding=True)
    assert "dual_grad_quant" in repr(LowBitLinear(64, 48, config=MixedPrecisionConfig(dual_grad_quant=True)))


# save_x_codes: X's weight-gradient codes made in the forward and kept instead of X (issue 25's memory target)
def _saved_by_layer(lin, x):
    """The tensors a forward saves for its backward (shape, dtype), in order."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lin(x)
    return saved


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_save_x_codes_same_gradients_and_keeps_codes_not_x(fmt, cache, dual):
    """The same dX, dW, db bits as keeping X (with the weight cache, with the dual dY op); the forward saves X's
    [K, M] codes (1 byte an element) and K float32 scales, and not X."""
    ref = _dual_grads(fmt, dual, cache=cache)
    got = _dual_grads(fmt, dual, cache=cache, save_x_codes=True)
    for name, a, b in zip(("dX", "dW", "db"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"
    code = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_tensorwise": torch.float8_e4m3fn}[fmt]
    for x_codes in (False, True):
        lin = LowBitLinear(64, 48, dtype=torch.bfloat16, config=MixedPrecisionConfig(format=fmt, save_x_codes=x_codes))
        saved = _saved_by_layer(lin, torch.randn(3, 10, 64, dtype=torch.bfloat16))
        assert (((3, 10, 64), torch.bfloat16) in saved) is not x_codes, saved
        assert (((64, 30), code) in saved and ((64,), torch.float32) in saved) is x_codes, saved


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_save_x_codes_compiled_same_gradients_no_graph_break(fmt):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref = _dual_grads(fmt, False, compile=True)
    torch._dynamo.reset()
    got = _dual_grads(fmt, False, compile=True, save_x_codes=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, a, b in zip(("dX", "dW", "db"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_save_x_codes_same_gradients_cuda(fmt, compile):
    torch._dynamo.reset()
    ref = _dual_grads(fmt, False, "cuda", compile=compile)
    torch._dynamo.reset()
    got = _dual_grads(fmt, False, "cuda", compile=compile, save_x_codes=True)
    for name, a, b in zip(("dX", "dW", "db"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.parametrize("case", ["frozen_weight", "grad_weight_off"])
def test_save_x_codes_keeps_x_where_it_cannot_apply(case):
    """No low-bit weight gradient to feed: nothing quantized in the forward for it (X kept only if dW needs it)."""
    config = {"grad_weight_off": {"grad_weight": False}}.get(case, {})
    lin = LowBitLinear(64, 48, dtype=torch.bfloat16, config=MixedPrecisionConfig(save_x_codes=True, **config))
    lin.weight.requires_grad_(case != "frozen_weight")
    saved = _saved_by_layer(lin, torch.randn(30, 64, dtype=torch.bfloat16, requires_grad=True))
    assert not any(dtype == torch.int8 and shape == (64, 30) for shape, dtype in saved), saved
    assert (((30, 64), torch.bfloat16) in saved) is (case == "grad_weight_off"), saved


def test_save_x_codes_refuses_stochastic_rounding():
    with pytest.raises(ValueError, match="save_x_codes=True with stochastic_rounding=True"):
        MixedPrecisionConfig(save_x_codes=True, stochastic_rounding=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_t_shared_op_is_quantize_t(fmt):
    """hf_lowbit::quantize_t_shared (the opaque op sibling layers' X goes through on CUDA): registered correctly
    (schema, fake tensors, no aliasing: torch.library.opcheck) and the bits of quantize_t."""
    from hf_lowbit.kernels import quantize_t, quantize_t_shared

    x = torch.randn(48, 80, dtype=torch.bfloat16)
    torch.library.opcheck(quantize_t_shared, (x, fmt))
    for a, b in zip(quantize_t_shared(x, fmt), quantize_t(x, fmt)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_siblings_share_x_codes_from_share_min_rows():
    """The default rule (issue 25, measured on the H200): siblings share X's column codes on CUDA from SHARE_MIN_ROWS
    rows (8x2048 tokens: faster and 3% less memory), not below (1x2048: the op's calls cost host time), never off
    CUDA (the plain-torch path there is CSE'd by Inductor itself). CUDA tensors faked, so it runs on a CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_lowbit.kernels import shares_codes
    from hf_lowbit.kernels.quantize_t import SHARE_MIN_ROWS

    assert 2048 < SHARE_MIN_ROWS <= 16384  # the two measured sizes
    with FakeTensorMode():
        assert shares_codes(torch.empty(SHARE_MIN_ROWS, 64, device="cuda"))
        assert shares_codes(torch.empty(16384, 4096, device="cuda"))
        assert not shares_codes(torch.empty(SHARE_MIN_ROWS - 1, 64, device="cuda"))
        assert not shares_codes(torch.empty(2048, 4096, device="cuda"))
    assert not shares_codes(torch.empty(16384, 8))


def _sibling_grads(fmt, device, compile, shares=None, monkeypatch=None):
    """q/k/v-like siblings (three linears on one input), summed: output and every gradient."""
    import hf_lowbit.kernels as K

    if shares is not None:
        monkeypatch.setattr(K, "shares_codes", lambda x: shares)
    torch.manual_seed(0)
    lins = nn.ModuleList(LowBitLinear(64, n, bias=False, device=device, dtype=torch.bfloat16,
                                      config=MixedPrecisionConfig(format=fmt)) for n in (64, 32, 32))

    def fn(x):
        return torch.cat([lin(x) for lin in lins], -1)

    x = torch.randn(3, 40, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = (torch.compile(fn) if compile else fn)(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator(device).manual_seed(1), device=device).to(y.dtype))
    return [y, x.grad] + [lin.weight.grad for lin in lins]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_siblings_share_x_codes_compiled_same_gradients(fmt, monkeypatch):
    """Compiled, siblings quantize their shared input once through the opaque op (forced here on the CPU, where it
    runs the reference) with the gradients of the compiled per-layer path, and no graph break. (Against eager, dX
    differs in rounding: Inductor adds the three siblings' input gradients in float32.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ref = _sibling_grads(fmt, "cpu", compile=True)
    torch._dynamo.reset()
    counters.clear()
    got = _sibling_grads(fmt, "cpu", compile=True, shares=True, monkeypatch=monkeypatch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, a, b in zip(("Y", "dX", "dWq", "dWk", "dWv"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_siblings_share_x_codes_cuda(fmt, monkeypatch):
    """On the GPU, where X's column codes go through hf_lowbit::quantize_t_shared: compiled siblings get the
    gradients of the per-layer quantize_t path bit for bit."""
    torch._dynamo.reset()
    ref = _sibling_grads(fmt, "cuda", compile=True, shares=False, monkeypatch=monkeypatch)
    torch._dynamo.reset()
    got = _sibling_grads(fmt, "cuda", compile=True, shares=True, monkeypatch=monkeypatch)
    for name, a, b in zip(("Y", "dX", "dWq", "dWk", "dWv"), ref, got):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


def _head_grads(model, ids, embed_grad: bool = True):
    """Logits, the LM head weight's gradient and the final hidden states' gradient of ``model``'s loss on ``ids``
    (``embed_grad=False``: the input embedding's output detached, so only the head writes a tied weight's gradient)."""
    hidden = {}
    hooks = [model.model.norm.register_forward_hook(lambda m, a, out: hidden.setdefault("h", out).retain_grad())]
    if not embed_grad:
        hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.detach()))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    for h in hooks:
        h.remove()
    return out.logits.detach(), model.lm_head.weight.grad.clone(), hidden["h"].grad


def _head_only_args(**kw):
    """Only the LM head swapped: every decoder linear excluded by a pattern that does not name the head."""
    return LowBitTrainingArguments(output_dir="unused", report_to="none", lowbit_min_features=16,
                                   lowbit_include_lm_head=True, lowbit_exclude_modules=["model.*"], **kw)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_lm_head_logits_and_gradients_vs_bf16(fmt, tied):
    """The swapped head in bf16 against the same head computing in float32: logits, its weight's gradient and the
    hidden states' gradient >= 20 dB. Tied: one Parameter shared with the input embedding, whose gradient is the
    head's and the embedding's (the embedding's share is far from negligible: the reference without it differs)."""
    from hf_lowbit.prepare import apply_recipes

    ref = tiny_model(tie_word_embeddings=tied)
    model = tiny_model(tie_word_embeddings=tied).to(torch.bfloat16)
    model, (report,) = apply_recipes(model, _head_only_args(**{f"{fmt}_mixed_precision": True}))
    assert [e.name for e in report.swapped] == ["lm_head"] and isinstance(model.lm_head, LowBitLinear)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids = torch.randint(0, 48, (4, 32), generator=torch.Generator().manual_seed(0))  # half the vocab: rows the embedding misses
    want, got = _head_grads(ref, ids), _head_grads(model, ids)
    for name, r, g in zip(("logits", "lm_head.weight.grad", "hidden.grad"), want, got):
        assert snr_db(r, g) >= 20, f"{fmt} {name}: {snr_db(r, g):.1f} dB"
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert sum(p is model.lm_head.weight for p in model.parameters()) == 1
        ref.zero_grad()
        head_only = _head_grads(ref, ids, embed_grad=False)[1]
        assert snr_db(want[1], head_only) < 10  # the embedding's gradient is a real part of the tied weight's
        assert snr_db(want[1][48:], got[1][48:]) >= 20 and snr_db(want[1][:48], got[1][:48]) >= 20


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_tied_lm_head_weight_cache_follows_the_shared_parameter(fmt):
    """With the weight cache, the tied head's codes follow the one Parameter: current after an optimizer step (the
    step hook), and after the embedding's row of it is changed in place (the version counter) before a forward."""
    from hf_lowbit.kernels import quantize_weight
    from hf_lowbit.prepare import apply_recipes

    model, _ = apply_recipes(tiny_model(tie_word_embeddings=True),
                             _head_only_args(lowbit_weight_cache=True, **{f"{fmt}_mixed_precision": True}))
    head, w = model.lm_head, model.model.embed_tokens.weight
    assert head.weight is w and head.weight_cache

    def current():
        return all(torch.equal(c, f) for c, f in zip((head._wq, head._wq_scale, head._wq_t), quantize_weight(fmt, w)))

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    before = head._wq.clone()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert current() and not torch.equal(before, head._wq)
    with torch.no_grad():
        w[3] *= 4  # through the embedding's name: the same Parameter
    assert not current()
    model(input_ids=ids)
    assert current()
