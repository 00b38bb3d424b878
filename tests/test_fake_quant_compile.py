"""Compiled fake quantization is the eager one bit for bit (issue 26), so QAT under torch.compile trains on the grid
that torchao's convert exports.

Inductor computes a fused bf16/fp16 pointwise chain in float32 and drops the roundings between its ops (and, on CPU,
folds a float32 -> bf16 -> float32 cast pair); before the fix a compiled fake quant differed from eager on 10-70% of
the values. These tests compile with Inductor on the CPU; the GPU (Triton) path is not tested here.
"""

import contextlib

import pytest
import torch
from conftest import tiny_model

from hf_lowbit.kernels.fake_quant import (fake_quant_fp8_rowwise, fake_quant_int4_tinygemm, fake_quant_per_group_sym,
                                          fake_quant_per_token_asym)
from hf_lowbit.qat import QATConfig, QATLinear, convert_qat, prepare_qat

BF16 = torch.bfloat16


def _bits(t):
    """The bit patterns of ``t`` (NaNs as one pattern), to compare floats exactly, signed zeros included."""
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, want, what=""):
    assert got.dtype == want.dtype, what
    bad = (_bits(got) != _bits(want)).sum().item()
    assert bad == 0, f"{what}: {bad} of {want.numel()} values differ"


def _patterns():
    """float32 bit patterns: random ones over the whole range and, for many upper halves (signs, exponents from
    subnormal to inf/NaN), lower halves at and around bf16's and fp16's rounding ties."""
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(-(2 ** 31), 2 ** 31, (1 << 18,), generator=gen, dtype=torch.int64)
    upper = torch.cat([torch.randint(0, 1 << 16, (1024,), generator=gen),
                       torch.tensor([0x0000, 0x0001, 0x007F, 0x0080, 0x3380, 0x3880, 0x387F, 0x477F, 0x4780, 0x7F7F,
                                     0x7F80, 0x7FC0, 0x3F80, 0x3F81])])
    upper = torch.cat([upper, upper | 0x8000])
    ties = [0x1000, 0x8000]  # fp16 (13 bits dropped) and bf16 (16 bits dropped) half-way points
    lower = torch.tensor(sorted({0, 1, 0xFFFF, *(t + d for t in ties for d in (-1, 0, 1)), 0x3000, 0x5000, 0x9000,
                                 0xB000, 0x7000, 0xF000}))
    grid = (upper[:, None] << 16 | lower[None, :]).reshape(-1)
    # fp16 subnormals: multiples of 2^-24 and the points half-way between them
    sub = (torch.arange(0, 2 ** 11, dtype=torch.float64) * 2.0 ** -25).float().view(torch.int32).to(torch.int64)
    allbits = torch.cat([rand, grid, sub, sub | (1 << 31), sub + 1, sub - 1])
    return ((allbits + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_rounding_helpers_are_the_cast_also_compiled(dtype):
    """``round_to_bf16(x)`` / ``round_to_fp16(x)`` == ``x.to(dtype).float()`` on ties, subnormals, overflow, inf and
    random patterns, eagerly and compiled (NaN: NaN). All 2^32 patterns were checked once, eager and compiled."""
    from hf_lowbit.kernels.fake_quant import round_to_bf16, round_to_fp16

    fn = {BF16: round_to_bf16, torch.float16: round_to_fp16}[dtype]
    x = _patterns()
    want = x.to(dtype).float()
    assert want.isnan().any() and want.isinf().any() and (want != x).any()
    _assert_same(fn(x), want, "eager")
    _assert_same(torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)(x), want, "compiled")


def _operands(dtype, seed=0):
    """A weight with rows of various scales and offsets and groups that are constant, zero, tiny, at a large offset,
    subnormal or huge; activations with an outlier row. float32 (each is also cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 256, generator=gen) * torch.rand(32, 1, generator=gen) * 3 + torch.randn(32, 1, generator=gen)
    w[0, :128] = 0
    w[1, :128] = 3.0
    w[2, :128] = -1e-3
    w[3, :128] = 100 + torch.arange(128) * 1e-2
    w[4] *= 1e-20 if dtype != torch.float16 else 1e-3
    w[5] *= 1e30 if dtype != torch.float16 else 1e3
    x = torch.randn(2, 8, 256, generator=gen) * 2 + 0.3
    x[0, 0, :64] = 1e3
    x[1, 1] = 0
    return w, x


def _fake_quants(w, x):
    wide = torch.cat([w, w[:, :744]], 1)  # in_features 1000: per channel (one group per row) at an odd width
    return {"per_token_asym": fake_quant_per_token_asym(x), "fp8_rowwise": fake_quant_fp8_rowwise(x),
            "per_group_sym g32": fake_quant_per_group_sym(w, 32), "int4_tinygemm g64": fake_quant_int4_tinygemm(w, 64),
            "per_group_sym per channel K=1000": fake_quant_per_group_sym(wide, wide.shape[1])}


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_float32_emulation_run_eagerly_is_the_native_arithmetic(dtype, monkeypatch):
    """The emulation compiled code runs (float32, each rounding on the bits), run eagerly, equals the native bf16 /
    fp16 arithmetic eager runs, on more inputs and group sizes than a compile could afford."""
    from hf_lowbit.kernels import fake_quant

    for seed in range(6):
        w32, x32 = _operands(dtype, seed)
        w, x = w32.to(dtype), x32.to(dtype)
        fns = {"per_token_asym": lambda: fake_quant_per_token_asym(x), "fp8_rowwise": lambda: fake_quant_fp8_rowwise(x),
               **{f"per_group_sym g{g}": lambda g=g: fake_quant_per_group_sym(w, g) for g in (32, 64, 128, 256)},
               **{f"int4_tinygemm g{g}": lambda g=g: fake_quant_int4_tinygemm(w, g) for g in (32, 64, 128, 256)}}
        native = {k: f() for k, f in fns.items()}
        with monkeypatch.context() as m:
            m.setattr(fake_quant, "_emulating", lambda: True)
            for k, f in fns.items():
                _assert_same(f(), native[k], f"{k} seed {seed}")


def _given_and_cast_in_graph(w, x, w32, x32, dtype):
    """Each fake quant on operands given in ``dtype`` and on operands cast to it in the graph (the QAT linear under
    autocast casts float32 weights and inputs to bf16 just before its fake quant)."""
    given = _fake_quants(w, x)
    cast = _fake_quants(w32.to(dtype), x32.to(dtype))
    return {**given, **{f"{k}, cast in graph": v for k, v in cast.items()}}


@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float16])
def test_compiled_fake_quant_is_eager_bit_for_bit(dtype):
    """Every fake quant compiled by Inductor (one graph per dtype: compiling costs seconds) equals its eager result,
    which is torchao's (tests/test_qat.py, tests/test_qat_schemes.py)."""
    w32, x32 = _operands(dtype)
    w, x = w32.to(dtype), x32.to(dtype)
    compiled = torch.compile(_given_and_cast_in_graph, backend="inductor", fullgraph=True, dynamic=False)
    got = compiled(w, x, w32, x32, dtype)
    want = _given_and_cast_in_graph(w, x, w32, x32, dtype)
    assert got.keys() == want.keys()
    for name in want:
        _assert_same(got[name], want[name], name)


def _layer_inputs(model, ids):
    """Each QAT layer's input in an eager forward of ``model`` (realistic activations for the layer tests)."""
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, n=n: inputs.__setitem__(n, args[0].detach().clone()))
             for n, m in model.named_modules() if isinstance(m, QATLinear)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return inputs


@pytest.mark.parametrize("scheme,dtype,autocast,group_size", [
    ("8da4w", BF16, False, 32), ("int4_weight_only", BF16, False, 32), ("int4_tinygemm", BF16, False, 32),
    ("fp8_rowwise", BF16, False, 32), ("8da4w", torch.float32, True, 32), ("fp8_rowwise", torch.float32, False, 32),
    ("8da4w", BF16, False, -1), ("int4_weight_only", torch.float32, True, -1)])
def test_compiled_qat_layers_forward_and_backward_are_eager_bit_for_bit(scheme, dtype, autocast, group_size):
    """In a tiny Llama prepared for QAT, every QAT linear compiled (Inductor, forward and backward) gives the eager
    layer's output and gradients bit for bit, on the activations the model feeds it. Per layer: the rest of a
    compiled bf16 model drops bf16 roundings of its own (norms, attention), which is not the fake quant's business.
    Also the converted model (CPU-convertible schemes) computes what the fake-quantized one did: logits equal, and
    each converted layer's output equals the compiled QAT layer's. ``group_size`` -1: per channel."""
    model = tiny_model(intermediate_size=64, num_key_value_heads=4).to(dtype)  # every linear 64 -> 64: one compile
    config = QATConfig(scheme, group_size)
    prepare_qat(model, config)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = _layer_inputs(model, ids)
    assert len(inputs) == 14
    step = torch.compile(lambda layer, t: layer(t), backend="inductor", fullgraph=True, dynamic=False)
    ctx = torch.autocast("cpu", BF16) if autocast else contextlib.nullcontext()
    compiled_out = {}
    for name, x in inputs.items():
        layer = model.get_submodule(name)
        results = []
        for fn in (lambda t: layer(t), lambda t: step(layer, t)):
            t = x.clone().requires_grad_()
            layer.weight.grad = None
            with ctx:
                y = fn(t)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype))
            results.append((y.detach(), t.grad, layer.weight.grad))
        (y, dx, dw), (yc, dxc, dwc) = results
        _assert_same(yc, y, f"{name} output")
        _assert_same(dxc, dx, f"{name} input grad")
        _assert_same(dwc, dw, f"{name} weight grad")
        compiled_out[name] = yc
    if config.spec.convert_on_cuda or config.spec.min_capability:
        return  # GPU schemes convert on the GPU only (tests/test_qat_schemes.py's cuda tests)
    with torch.no_grad():
        fake = model(ids).logits
        convert_qat(model, config)
        _assert_same(model(ids).logits, fake, "converted logits")
        for name, x in inputs.items() if not autocast else ():
            _assert_same(model.get_submodule(name)(x), compiled_out[name], f"{name} converted")
