"""hf_lowbit.qat.siblings: q/k/v and gate/up served as one stacked linear (issue 26). Each sibling's output is its
columns of the stacked product; a parent that does not call its siblings on one input (cross-attention, q alone,
threads) makes the group serve each from its own rows; the stacked serving modules hold the same codes; a compiled
model keeps one graph with one call per group and nothing stashed between calls."""

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

from hf_lowbit.qat.siblings import SiblingGroup, SiblingLinear, fuse_siblings
from hf_lowbit.swap import SwapEntry, SwapReport

BF16 = torch.bfloat16
QKV = ("q_proj", "k_proj", "v_proj")


class _Attn(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, n, bias=bias) for n in (6, 2, 2))
        with torch.no_grad():  # small integers: every float32 sum exact, in any order
            for m in (self.q_proj, self.k_proj, self.v_proj):
                m.weight.copy_(torch.randint(-3, 4, m.weight.shape))
                if bias:
                    m.bias.copy_(torch.randint(-3, 4, m.bias.shape))


class _Stacked(nn.Linear):
    """A stacked plain linear with the serving classes' ``forward_rows``, counting both kinds of call."""

    calls = rows_calls = 0
    counting = True  # off in compiled tests: a counter changing every call is a guard failing every call

    def forward(self, x):
        if self.counting:
            self.calls += 1
        return super().forward(x)

    def forward_rows(self, x, start, end):
        if self.counting:
            self.rows_calls += 1
        return F.linear(x, self.weight[start:end], None if self.bias is None else self.bias[start:end])


def _stack_linears(mods):
    out = _Stacked(mods[0].in_features, sum(m.out_features for m in mods), bias=mods[0].bias is not None)
    with torch.no_grad():
        out.weight.copy_(torch.cat([m.weight for m in mods]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([m.bias for m in mods]))
    return out


def _fuse(parent, report=None):
    return fuse_siblings(parent, nn.Linear, _stack_linears, lambda mods: None, report)


def _ints(*shape):
    return torch.randint(-3, 4, shape).float()


def test_each_sibling_gets_its_columns_in_any_order():
    torch.manual_seed(0)
    attn = _Attn(bias=True)
    ref = {n: getattr(attn, n) for n in QKV}
    x = _ints(2, 3, 8)
    want = {n: m(x) for n, m in ref.items()}
    assert _fuse(attn) == ["q_proj+k_proj+v_proj"]
    group = attn.siblings_q_proj_k_proj_v_proj
    assert isinstance(group, SiblingGroup) and all(isinstance(getattr(attn, n), SiblingLinear) for n in ref)
    assert {n for n, _ in attn.named_modules()} == {"", *QKV, "siblings_q_proj_k_proj_v_proj",
                                                    "siblings_q_proj_k_proj_v_proj.linear"}
    assert set(attn.state_dict()) == {"siblings_q_proj_k_proj_v_proj.linear.weight",
                                      "siblings_q_proj_k_proj_v_proj.linear.bias"}  # the weight once
    stacked = group.linear
    # the model's order: one stacked call, each sibling its columns, the stash empty after the last
    outs = {n: getattr(attn, n)(x) for n in QKV}
    assert stacked.calls == 1 and group._stash is None and group.shared
    for n in ref:
        assert torch.equal(outs[n], want[n]) and outs[n].shape == (2, 3, ref[n].out_features)
    outs = {n: getattr(attn, n)(x) for n in ("v_proj", "q_proj", "k_proj")}  # another order: still one call
    assert stacked.calls == 2 and stacked.rows_calls == 0 and all(torch.equal(outs[n], want[n]) for n in ref)
    assert "columns 8:10 of q_proj+k_proj+v_proj" in repr(attn.v_proj)


@pytest.mark.parametrize("pattern", ["cross", "q_alone", "equal_not_same"])
def test_a_parent_that_does_not_share_its_input_gets_each_siblings_own_rows(pattern):
    """Cross-attention (k/v read another tensor), q alone (a decode step against cached keys), an equal tensor that
    is not the same one: the first new input while a product is unclaimed stops the stacking; every output is its
    own input's, and from then on each sibling multiplies its own rows only."""
    torch.manual_seed(0)
    attn = _Attn(bias=True)
    ref = {n: getattr(attn, n) for n in QKV}
    _fuse(attn)
    group, stacked = attn.siblings_q_proj_k_proj_v_proj, attn.siblings_q_proj_k_proj_v_proj.linear
    h, enc = _ints(1, 3, 8), _ints(1, 5, 8)
    if pattern == "cross":
        calls = [("q_proj", h), ("k_proj", enc), ("v_proj", enc)] * 2
    elif pattern == "q_alone":
        calls = [("q_proj", h), ("q_proj", _ints(1, 1, 8)), ("q_proj", _ints(1, 1, 8)), ("k_proj", h)]
    else:
        calls = [("q_proj", h), ("k_proj", h.clone()), ("v_proj", h)]
    for name, x in calls:
        assert torch.equal(getattr(attn, name)(x), ref[name](x)), (name, pattern)
    assert not group.shared and group._stash is None and "not stacking" in repr(group)
    assert stacked.calls == 1 and stacked.rows_calls == len(calls) - 1  # one stacked product too many, at most


def test_threads_each_get_their_own_inputs_columns():
    """One model from several threads: a sibling never slices a product of another thread's input (the stash is
    read once and replaced whole; a foreign input stops the stacking)."""
    torch.manual_seed(0)
    attn = _Attn()
    ref = {n: getattr(attn, n) for n in QKV}
    _fuse(attn)
    wrong = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(300):
            x = torch.randint(-3, 4, (2, 8), generator=g).float()
            for n in QKV:
                if not torch.equal(getattr(attn, n)(x), ref[n](x)):
                    wrong.append(n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_problems_leave_a_group_alone_and_the_report_says_why():
    attn = _Attn()
    report = SwapReport("r", [SwapEntry(n, "Linear", (2, 8), "swapped", "X") for n in QKV])
    assert fuse_siblings(attn, nn.Linear, _stack_linears, lambda mods: "no reason at all", report) == []
    assert all(type(getattr(attn, n)) is nn.Linear for n in QKV)
    assert report.entries[0].reason == "X (not stacked with its siblings: no reason at all)"
    attn.v_proj = attn.k_proj  # one module under two names: never stacked
    assert fuse_siblings(attn, nn.Linear, _stack_linears, lambda mods: None) == []
    # a sibling shared by two parents keeps its own weight (stacking would copy it into each)
    a, b = _Attn(), _Attn()
    b.k_proj = a.k_proj
    model = nn.ModuleDict({"a": a, "b": b})
    report = SwapReport("r", [SwapEntry(f"{p}.{n}", "Linear", (2, 8), "swapped", "X") for p in "ab" for n in QKV])
    assert fuse_siblings(model, nn.Linear, _stack_linears, lambda mods: None, report) == []
    assert report.entries[1].reason == "X (not stacked with its siblings: a sibling is held in several places (a " \
                                       "shared module keeps its own weight))"
    # not all siblings of the kind: the ones that are say so
    c = _Attn()
    c.v_proj = nn.Identity()
    report = SwapReport("r", [SwapEntry(n, "Linear", (2, 8), "swapped", "X") for n in QKV])
    assert fuse_siblings(c, nn.Linear, _stack_linears, lambda mods: None, report) == []
    assert report.entries[0].reason == "X (not stacked with its siblings: its siblings are not all Linear " \
                                       "(v_proj: Identity))"
    assert report.entries[2].reason == "X"  # the Identity's entry (were it one) is left alone
    report = SwapReport("r", [SwapEntry("k_proj", "Linear", (2, 8), "swapped", "X")])
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(4, 3), nn.Linear(4, 5)
    assert fuse_siblings(mlp, nn.Linear, _stack_linears, lambda mods: None, report) == ["gate_proj+up_proj"]
    assert report.entries[0].reason == "X"  # an entry of no fused module is left as it was


def test_each_replaced_sibling_is_freed_before_the_next_group_is_stacked():
    """Stacking copies a group's weights: the old ones must go before the next copy, or a stacked 8B model peaks at
    its siblings' bytes twice (the FP8 serving run of session 34: 11.1 GiB against the peer's 7.1)."""
    import gc
    import weakref

    model = tiny_model(num_hidden_layers=3)
    gc.collect()  # nothing but the walk may hold a replaced sibling
    replaced, alive_at_each_concat = [], []

    def concat(mods):
        alive_at_each_concat.append(sum(r() is not None for r in replaced))
        replaced.extend(weakref.ref(m) for m in mods)
        return _stack_linears(mods)

    assert len(fuse_siblings(model, nn.Linear, concat, lambda mods: None)) == 6
    assert alive_at_each_concat == [0] * 6
    assert all(r() is None for r in replaced)


def _graphs_of(f):
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(f, backend=backend, fullgraph=True), graphs


def _linears(graph):
    return [n for n in graph.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]


def test_compiled_keeps_one_graph_one_call_per_group_and_nothing_stashed():
    torch.manual_seed(0)
    attn = _Attn()
    _fuse(attn)
    group = attn.siblings_q_proj_k_proj_v_proj
    group.linear.counting = False

    def f(x):
        return attn.q_proj(x).sum(-1) + attn.k_proj(x).sum(-1) * attn.v_proj(x).sum(-1)

    x = _ints(4, 8)
    want = f(x)
    compiled, graphs = _graphs_of(f)
    for _ in range(3):
        assert torch.equal(compiled(x), want) and group._stash is None
    assert torch.equal(compiled(x + 1), f(x + 1))
    assert len(graphs) == 1 and len(_linears(graphs[0])) == 1  # no recompile: the stash empty at start and end
    torch._dynamo.reset()


def test_compiled_cross_attention_stops_stacking_once():
    torch.manual_seed(0)
    attn = _Attn()
    ref = {n: getattr(attn, n) for n in QKV}
    _fuse(attn)
    attn.siblings_q_proj_k_proj_v_proj.linear.counting = False

    def f(h, enc):
        return attn.q_proj(h).sum(-1).sum(-1) + attn.k_proj(enc).sum(-1).sum(-1) * attn.v_proj(enc).sum(-1).sum(-1)

    def plain(h, enc):
        q, k, v = ref["q_proj"](h), ref["k_proj"](enc), ref["v_proj"](enc)
        return q.sum(-1).sum(-1) + k.sum(-1).sum(-1) * v.sum(-1).sum(-1)

    compiled, graphs = _graphs_of(f)
    for i in range(4):
        h, enc = _ints(1, 3, 8), _ints(1, 5, 8)
        assert torch.equal(compiled(h, enc), plain(h, enc)), i
    assert not attn.siblings_q_proj_k_proj_v_proj.shared
    assert len(graphs) == 2 and len(_linears(graphs[-1])) == 3  # recompiled once, then each its own rows
    torch._dynamo.reset()


# ---- the serving modules: FP8 (torchao's row-wise Float8Tensor, swapped) and int4 (tinygemm's tile layout) ----

def _fp8_model(monkeypatch):
    pytest.importorskip("torchao")
    from test_fp8_serving import _quantize

    return _quantize(tiny_model().to(BF16).eval(), monkeypatch=monkeypatch)


def test_fp8_stacked_model_keeps_the_logits_and_the_codes(monkeypatch):
    from hf_lowbit.qat.fp8_serving import Fp8ServingLinear, use_fp8_kernels

    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    plain = _fp8_model(monkeypatch)
    use_fp8_kernels(plain, stack_siblings=False)
    stacked = _fp8_model(monkeypatch)
    report = use_fp8_kernels(stacked, stack_siblings=True)
    with torch.no_grad():
        ref, out = plain(ids).logits.float(), stacked(ids).logits.float()
    attn, mlp = stacked.model.layers[0].self_attn, stacked.model.layers[0].mlp
    qkv, gate_up = attn.siblings_q_proj_k_proj_v_proj.linear, mlp.siblings_gate_proj_up_proj.linear
    assert isinstance(qkv, Fp8ServingLinear) and isinstance(attn.k_proj, SiblingLinear)
    p_attn = plain.model.layers[0].self_attn
    assert torch.equal(qkv.weight_codes.view(torch.uint8), torch.cat(
        [getattr(p_attn, n).weight_codes for n in ("q_proj", "k_proj", "v_proj")]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([getattr(p_attn, n).weight_scale for n in ("q_proj", "k_proj",
                                                                                               "v_proj")]))
    assert (qkv.out_features, gate_up.out_features) == (attn.q_proj.out_features + 2 * attn.k_proj.out_features, 256)
    reasons = {e.name: e.reason for e in report.swapped}
    assert reasons["model.layers.1.self_attn.k_proj"] == "Fp8ServingLinear, stacked with q_proj+v_proj (one GEMV)"
    assert reasons["model.layers.1.self_attn.o_proj"] == "Fp8ServingLinear"
    assert sum(", stacked with" in r for r in reasons.values()) == 2 * 5
    # the same codes and scales; each row's float32 sum may run in another order, then one bf16 rounding
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert attn.siblings_q_proj_k_proj_v_proj._stash is None


def test_fp8_stack_problems():
    from hf_lowbit.qat.fp8_serving import Fp8ServingLinear, stack_problem

    codes = lambda n, k: torch.randn(n, k).to(torch.float8_e4m3fn)  # noqa: E731
    a = Fp8ServingLinear(codes(16, 32), torch.rand(16))
    b = Fp8ServingLinear(codes(8, 32), torch.rand(8), torch.randn(8, dtype=BF16))
    c = Fp8ServingLinear(codes(8, 16), torch.rand(8))
    assert stack_problem([a, b]) == "some have a bias, some not"
    assert stack_problem([a, c]) == "in_features differs (32, 16)"
    with pytest.raises(ValueError, match="Fp8ServingLinear.concat: in_features differ"):
        Fp8ServingLinear.concat([a, c])
    e = Fp8ServingLinear(codes(8, 32), torch.rand(8))
    d = Fp8ServingLinear.concat([a, e])
    assert (d.out_features, d.in_features) == (24, 32)
    x = torch.randn(3, 32, dtype=BF16)
    assert torch.equal(d.forward_rows(x, 16, 24), e(x)) and torch.equal(d.forward_rows(x, 0, 16), a(x))


def _tile(N, K=256, gs=32, seed=0, bias=None):
    pytest.importorskip("torchao")
    from _triton_checks import tile_operands

    from hf_lowbit.qat.int4_serving import Int4ServingLinear

    p, s, z, qdata, sz = tile_operands(N, K, gs, "cpu", seed)
    return Int4ServingLinear(qdata, sz, gs, K, N, bias), (p, s, z)


def test_int4_stacked_tiles_hold_each_rows_codes_scales_and_zeros():
    from hf_lowbit.kernels.int4 import int4_dequantize, int4_tile_dequantize
    from hf_lowbit.qat.int4_serving import Int4ServingLinear, stack_problem

    (a, ra), (b, rb), (c, rc) = _tile(24, seed=0), _tile(8, seed=1), _tile(16, seed=2)
    stacked = Int4ServingLinear.concat([a, b, c])
    assert (stacked.out_features, stacked.in_features, stacked.group_size) == (48, 256, 32)
    want = torch.cat([int4_dequantize(*r, 32) for r in (ra, rb, rc)])
    assert torch.equal(int4_tile_dequantize(stacked.qdata, stacked.scale_and_zero, 32, (48, 256)), want)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(stacked.forward_rows(x, 24, 32), b(x)) and torch.equal(stacked.forward_rows(x, 32, 48), c(x))
    with pytest.raises(ValueError, match="not whole 8-row tiles"):
        stacked.forward_rows(x, 4, 12)
    out, parts = stacked(x), torch.cat([m(x) for m in (a, b, c)], dim=-1)
    assert ((out.float() - parts.float()).norm() / parts.float().norm()).item() < 1e-2
    padded, _ = _tile(20, seed=3)
    assert stack_problem([a, padded]) == "out_features 20 padded in the tile layout (not a multiple of 8)"
    assert stack_problem([a, _tile(8, gs=64)[0]]) == "group_size differs (32, 64)"
    assert stack_problem([a, _tile(8, K=128)[0]]) == "in_features differs (256, 128)"
    d = _tile(8, seed=4)[0]  # the same K packed with other inner k tiles (torchao's inner_k_tiles): 4 x 2, not 2 x 4
    other = Int4ServingLinear(d.qdata.reshape(1, 4, 32, 2), d.scale_and_zero, 32, 256, 8)
    assert stack_problem([a, other]) == "tile layouts differ (qdata tiles [(2, 32, 4), (4, 32, 2)])"
    with_bias, _ = _tile(8, bias=torch.randn(8).bfloat16())
    assert stack_problem([a, with_bias]) == "some have a bias, some not"


def test_fp8_stacked_model_generates_through_transformers_compiled_path(monkeypatch):
    """generate with a static cache and the serving compile config (aot_eager on the CPU), as benchmark_serve's
    compiled_fp8k_stacked mode runs it: the eager tokens, one compiled decode step, nothing stashed after."""
    from benchmarks.serve_host_calls import compiled_guards
    from hf_lowbit.qat import prepare_for_serving
    from hf_lowbit.qat.fp8_serving import use_fp8_kernels

    model = _fp8_model(monkeypatch)
    use_fp8_kernels(model)  # stacked by default
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0,
          "cache_implementation": "static"}
    with torch.no_grad():
        ref = model.generate(ids, disable_compile=True, **kw)
        config = prepare_for_serving(model, backend="aot_eager")
        config._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
        torch._dynamo.reset()
        out = model.generate(ids, compile_config=config, **kw)
        again = model.generate(ids, compile_config=config, **kw)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert len(compiled_guards()) == 1  # one decode step, not recompiled by the stash
    assert all(m._stash is None and m.shared for m in model.modules() if isinstance(m, SiblingGroup))
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_stacked_serving_on_a_llama_8b_layer_cuda(scheme):
    """One Llama-8B-shaped layer quantized by torchao on the GPU, served by our kernels unstacked and stacked: the
    same logits within the float32 reordering of each row's sums, at decode (GEMV: 1 and 8 rows) and prefill; then
    with every group switched to each sibling's own rows (``forward_rows``: FP8 views of the stacked weight, int4 a
    view of the codes and a copy of the scales), as a parent that calls ``q_proj`` alone makes it."""
    import copy

    pytest.importorskip("torchao")
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig, PerRow,
                                      quantize_)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_lowbit.qat.fp8_serving import use_fp8_kernels
    from hf_lowbit.qat.int4_serving import use_int4_kernels

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=BF16).eval()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()) if scheme == "fp8"
              else Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
    stacked = copy.deepcopy(model)
    use = use_fp8_kernels if scheme == "fp8" else use_int4_kernels
    use(model, stack_siblings=False)
    report = use(stacked, stack_siblings=True)
    assert sum(", stacked with" in e.reason for e in report.swapped) == 5
    for shape in ((1, 1), (8, 1), (1, 64)):
        ids = torch.randint(0, 32000, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.no_grad():
            ref, out = model(ids).logits.float(), stacked(ids).logits.float()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2, shape
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9, shape
    layer = stacked.model.layers[0]
    hidden = torch.randn(2, 1, 4096, device="cuda", dtype=BF16)
    with torch.no_grad():
        layer.self_attn.q_proj(hidden[0])
        layer.self_attn.q_proj(hidden[1])  # a new input while k and v have not taken theirs: the attention group
        layer.mlp.gate_proj(hidden[0])  # stops stacking; the MLP's likewise
        layer.mlp.gate_proj(hidden[1])
    groups = [m for m in stacked.modules() if isinstance(m, SiblingGroup)]
    assert len(groups) == 2 and not any(g.shared for g in groups) and all(g._stash is None for g in groups)
    for shape in ((1, 1), (8, 1), (1, 64)):
        ids = torch.randint(0, 32000, shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        with torch.no_grad():
            ref, out = model(ids).logits.float(), stacked(ids).logits.float()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-2, ("own rows", shape)
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9, ("own rows", shape)
