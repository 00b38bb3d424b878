"""The low-bit FSDP2 all-gather's single-process parts (the 2-rank behaviour: tests/_fsdp2_lowbit_all_gather.py,
run by tests/test_distributed.py): argument validation, refusals naming the flag, and a wrapped layer used
without FSDP2 computing exactly what it did before, with a plain state dict."""

import copy
import io

import pytest
import torch
from conftest import lowbit_args

from hf_lowbit import MixedPrecisionConfig, MixedPrecisionLinear
from hf_lowbit.integrations.distributed import enable_lowbit_all_gather, prepare_lowbit_all_gather
from hf_lowbit.mixed_precision.fsdp_all_gather import LowBitAllGatherWeight

FLAG = "lowbit_fsdp_lowbit_all_gather"


_args = lowbit_args


def test_flag_is_validated(tmp_path):
    assert _args(tmp_path).lowbit_fsdp_lowbit_all_gather is False
    assert _args(tmp_path, int8_mixed_precision=True, lowbit_fsdp_lowbit_all_gather=True).lowbit_fsdp_lowbit_all_gather
    for kw in ({}, {"int8_mixed_precision": True, "lowbit_grad_input": False},
               {"fp8_mixed_precision": True, "lowbit_output": False},
               {"int8_mixed_precision": True, "torch_compile": True}):
        with pytest.raises(ValueError, match=FLAG):
            _args(tmp_path, lowbit_fsdp_lowbit_all_gather=True, **kw)
    with pytest.raises(TypeError, match=FLAG):
        _args(tmp_path, int8_mixed_precision=True, lowbit_fsdp_lowbit_all_gather="yes")


def test_refused_without_fsdp2(tmp_path):
    args = _args(tmp_path, int8_mixed_precision=True, lowbit_fsdp_lowbit_all_gather=True)
    model = torch.nn.Sequential(MixedPrecisionLinear(64, 64))
    with pytest.raises(ValueError, match=f"{FLAG}=True needs FSDP2"):
        prepare_lowbit_all_gather(args, model, None)
    with pytest.raises(ValueError, match=f"{FLAG}=True needs FSDP2"):
        prepare_lowbit_all_gather(args, model, type("Plugin", (), {"fsdp_version": 1})())
    assert prepare_lowbit_all_gather(_args(tmp_path, int8_mixed_precision=True), model, None) == []


@pytest.mark.parametrize("problem", ["grad_input", "cache", "tied"])
def test_layers_that_cannot_take_it_are_refused(problem):
    cfg = MixedPrecisionConfig(grad_input=problem != "grad_input")
    a, b = MixedPrecisionLinear(64, 64, config=cfg), MixedPrecisionLinear(64, 64, config=cfg)
    if problem == "cache":
        a.set_weight_cache(True)
    if problem == "tied":
        b.weight = a.weight
    with pytest.raises(ValueError, match=FLAG):
        enable_lowbit_all_gather(torch.nn.Sequential(a, b))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_wrapped_layer_without_fsdp_is_unchanged(fmt):
    """Outside FSDP2 (before sharding, or evaluation) the wrapper is the weight: same output and gradients
    bit for bit, optimizer updates land on it, and state dicts / torch.save hold plain tensors."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 128), MixedPrecisionConfig(fmt)))
    wrapped = copy.deepcopy(plain)
    assert enable_lowbit_all_gather(wrapped) == ["0"]
    w = wrapped[0].weight
    assert isinstance(w, torch.nn.Parameter) and isinstance(w, LowBitAllGatherWeight)
    assert w.data_ptr() == w._tensor.data_ptr() != 0  # accelerate maps optimizer parameters by data_ptr()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    x = torch.randn(3, 5, 64)
    for _ in range(2):
        ys = []
        for m, opt in zip((plain, wrapped), opts):
            y = m(x)
            y.square().mean().backward()
            ys.append((y, [p.grad.clone() for p in m.parameters()]))
            opt.step()
            opt.zero_grad()
        assert torch.equal(ys[0][0], ys[1][0]) and all(torch.equal(a, b) for a, b in zip(ys[0][1], ys[1][1]))
    assert isinstance(wrapped[0].weight, LowBitAllGatherWeight)
    sd = wrapped.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor and torch.equal(sd["0.weight"], plain.state_dict()["0.weight"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True)["0.weight"], sd["0.weight"])  # refuses leaked subclasses
    fresh = copy.deepcopy(wrapped)
    with torch.no_grad():
        fresh[0].weight.zero_()
    fresh.load_state_dict(plain.state_dict())
    assert isinstance(fresh[0].weight, LowBitAllGatherWeight) and torch.equal(fresh(x), plain(x))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_upcast_through_param_data_keeps_the_wrapper_consistent(fmt):
    """accelerate's FSDP2 prepare upcasts trainable low-precision parameters with ``param.data =
    param.data.to(torch.float32)`` (mixed_precision != "no", e.g. a bf16 checkpoint under fsdp2.yaml). The
    wrapper must then hold the float32 tensor (not only report float32 while its held tensor stays bf16: the
    master weights would silently stay bf16), and compute as the plain layer upcast the same way."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 128, dtype=torch.bfloat16),
                                                                MixedPrecisionConfig(fmt)))
    wrapped = copy.deepcopy(plain)
    enable_lowbit_all_gather(wrapped)
    for m in (plain, wrapped):
        for p in m.parameters():
            p.data = p.data.to(torch.float32)
    w = wrapped[0].weight
    assert isinstance(w, LowBitAllGatherWeight) and w.dtype == w._tensor.dtype == torch.float32
    assert w.data_ptr() == w._tensor.data_ptr()
    x = torch.randn(3, 64)
    ys = []
    for m in (plain, wrapped):
        y = m(x)
        y.square().mean().backward()
        ys.append((y, m[0].weight.grad))
    assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[0][1], ys[1][1])
    assert ys[1][1].dtype == torch.float32


def test_single_rank_fsdp2_falls_back_to_the_plain_gather():
    """One rank: FSDP2 all-gathers nothing and reads only the first all-gather input (torch 2.13's world-size-1
    path), so codes + scales cannot reach the layer; the weight goes through as it is (before: a ValueError
    unpacking the gathered outputs on the first forward). Same outputs and gradients as without the flag."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        res = []
        for flag in (False, True):
            torch.manual_seed(0)
            m = torch.nn.Sequential(MixedPrecisionLinear(64, 128), torch.nn.GELU(), MixedPrecisionLinear(128, 32))
            if flag:
                enable_lowbit_all_gather(m)
            for layer in (m[0], m[2]):
                fully_shard(layer, mp_policy=mp)
            fully_shard(m, mp_policy=mp)
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
            y = m(x)
            y.float().square().mean().backward()
            res.append((y, [p.grad.full_tensor() for p in m.parameters()]))
        assert torch.equal(res[0][0], res[1][0]) and all(torch.equal(a, b) for a, b in zip(res[0][1], res[1][1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_included_takes_it_unless_tied(tmp_path, tied):
    """lowbit_include_lm_head: an untied INT8 head all-gathers its codes like any layer; a tied one shares its weight
    with the input embedding (which looks rows up in the high-precision weight), so it is refused, naming the flag."""
    from conftest import tiny_model

    from hf_lowbit.prepare import apply_recipes

    args = _args(tmp_path, int8_mixed_precision=True, lowbit_include_lm_head=True, lowbit_min_features=16)
    model, _ = apply_recipes(tiny_model(tie_word_embeddings=tied), args)
    assert isinstance(model.lm_head, MixedPrecisionLinear)
    if tied:
        with pytest.raises(ValueError, match=f"{FLAG}: lm_head shares its weight with another module"):
            enable_lowbit_all_gather(model)
    else:
        assert "lm_head" in enable_lowbit_all_gather(model)
        assert isinstance(model.lm_head.weight, LowBitAllGatherWeight)
