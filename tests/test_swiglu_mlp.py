"""A Llama-style MLP as one low-bit autograd function (``MixedPrecisionConfig.fused_swiglu``, ``LowBitSwiGLUMLP``):
bit for bit against the per-linear path with a once-rounded SwiGLU, with the weight cache, X's codes kept, fused
gradient accumulation and compiled; gradients against bf16; which MLPs it fuses and why not; PEFT over it; the
arguments."""

import copy

import pytest
import torch
from conftest import lowbit_args, snr_db, tiny_model
from torch import nn

from hf_lowbit import MixedPrecisionConfig, enable_fused_grad_accumulation
from hf_lowbit.kernels.swiglu import swiglu_backward_quant_reference, swiglu_quant_reference
from hf_lowbit.mixed_precision import LowBitSwiGLUMLP, convert_to_mixed_precision
from hf_lowbit.mixed_precision import swiglu as swiglu_mlp
from hf_lowbit.prepare import recipes_from_args
from hf_lowbit.swap import LinearFilter


class _SwiGLUOnce(torch.autograd.Function):
    """``silu(g) * u`` rounded once from float32, forward and backward: the fused MLP's definition of the SwiGLU
    values (hf_lowbit.kernels.swiglu's references), for the per-linear path to compute the same thing."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return swiglu_quant_reference(g, u, "int8")[0]

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        return swiglu_backward_quant_reference(dh.contiguous(), g, u, "int8")[:2]


def _per_linear(mlp: LowBitSwiGLUMLP, x: torch.Tensor) -> torch.Tensor:
    """The same MLP through its three low-bit linears, the SwiGLU rounded once."""
    return mlp.down_proj(_SwiGLUOnce.apply(mlp.gate_proj(x), mlp.up_proj(x)))


def _models(fmt: str, **config):
    """A tiny bf16 Llama converted with the fused MLP, and a copy of it (the same parameters' values)."""
    model = tiny_model(intermediate_size=96).to(torch.bfloat16)
    report = convert_to_mixed_precision(model, MixedPrecisionConfig(format=fmt, fused_swiglu=True, **config))
    return model, copy.deepcopy(model), report


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _equal_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n}: {(a[n] != b[n]).sum().item()} of {a[n].numel()} differ"


@pytest.mark.parametrize("col_amax", [False, True], ids=["quantize_t_absmax", "kernel_absmax"])
@pytest.mark.parametrize("cache", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_fused_mlp_is_the_per_linear_path_bit_for_bit(fmt, cache, col_amax, monkeypatch):
    monkeypatch.setattr(swiglu_mlp, "COL_AMAX", col_amax)
    model, ref, report = _models(fmt, weight_cache=cache)
    mlps = [m for m in model.modules() if isinstance(m, LowBitSwiGLUMLP)]
    assert len(mlps) == model.config.num_hidden_layers
    assert sum(e.module_type == "LlamaMLP" and e.action == "swapped" for e in report.entries) == len(mlps)
    for m in ref.modules():  # the copy computes per linear, the SwiGLU rounded as the fused one rounds it
        if isinstance(m, LowBitSwiGLUMLP):
            m.forward = lambda x, m=m: _per_linear(m, x)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    for run in (model, ref):
        run(ids, labels=ids).loss.backward()
    _equal_bits(_grads(model), _grads(ref))
    assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_inputs_without_grad_frozen_weights_and_x_codes(fmt):
    model, _, _ = _models(fmt)
    mlp = next(m for m in model.modules() if isinstance(m, LowBitSwiGLUMLP))
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    # frozen gate and down (LoRA-style): only up's weight gradient and X's
    mlp.gate_proj.weight.requires_grad_(False)
    mlp.down_proj.weight.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    y = mlp(xg)
    y.float().square().sum().backward()
    want_x, want_up = xg.grad.clone(), mlp.up_proj.weight.grad.clone()
    assert mlp.gate_proj.weight.grad is None and mlp.down_proj.weight.grad is None
    mlp.up_proj.weight.grad = None
    xg.grad = None
    _per_linear(mlp, xg).float().square().sum().backward()
    assert torch.equal(xg.grad, want_x) and torch.equal(mlp.up_proj.weight.grad, want_up)
    # X's and h's column codes kept instead of X and h: the same bits
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.weight.requires_grad_(True)
        layer.weight.grad = None
    mlp(x).float().square().sum().backward()
    plain = _grads(mlp)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.weight.grad = None
        layer.lowbit_config = MixedPrecisionConfig(format=fmt, fused_swiglu=True, save_x_codes=True)
    mlp(x).float().square().sum().backward()
    _equal_bits(plain, _grads(mlp))
    # no gradient at all (evaluation): the forward's bits
    with torch.no_grad():
        assert torch.equal(mlp(x), y.detach())


def test_fused_gradient_accumulation_and_compiled():
    model, ref, _ = _models("int8")
    handle = enable_fused_grad_accumulation(model)
    handle_ref = enable_fused_grad_accumulation(ref)
    for m in ref.modules():
        if isinstance(m, LowBitSwiGLUMLP):
            m.forward = lambda x, m=m: _per_linear(m, x)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, model.config.vocab_size, (1, 16), generator=gen) for _ in range(3)]
    handle.prepare()
    handle_ref.prepare()
    for ids in batches:  # each weight's gradient added into its .grad by the matmuls, in both paths
        model(ids, labels=ids).loss.backward()
        ref(ids, labels=ids).loss.backward()
    mlp = next(m for m in model.modules() if isinstance(m, LowBitSwiGLUMLP))
    assert mlp.gate_proj.weight.grad is mlp.gate_proj.grad_acc
    _equal_bits(_grads(model), _grads(ref))
    handle.close()
    handle_ref.close()
    # compiled (fullgraph, one graph): the same gradients as eagerly, to Inductor's roundings of the plain torch
    model.zero_grad(set_to_none=True)
    eager = tiny_model(intermediate_size=96).to(torch.bfloat16)
    convert_to_mixed_precision(eager, MixedPrecisionConfig(format="int8", fused_swiglu=True))
    compiled = copy.deepcopy(eager)
    ids = batches[0]
    eager(ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled.model.layers[0].mlp.compile(fullgraph=True)  # in place: the parameters keep their names
    compiled(ids, labels=ids).loss.backward()
    assert counts["stats"]["unique_graphs"] >= 1 and not counts["graph_break"]
    got, want = _grads(compiled), _grads(eager)
    for n in want:
        assert snr_db(want[n].float(), got[n].float()) > 30, n


def test_gradients_against_bf16():
    """The recipe's gradients of a tiny Llama against bf16's, fused MLP: each above 20 dB (the numerics bar)."""
    base = tiny_model(intermediate_size=96).to(torch.bfloat16)
    ids = torch.randint(0, base.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(base)
    ref(ids, labels=ids).loss.backward()
    for fmt in ("int8", "fp8"):
        model = copy.deepcopy(base)
        convert_to_mixed_precision(model, MixedPrecisionConfig(format=fmt, fused_swiglu=True))
        model(ids, labels=ids).loss.backward()
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            if "mlp" in name:
                assert snr_db(p.grad, q.grad) > 20, (fmt, name, snr_db(p.grad, q.grad))


class _GeluMLP(nn.Module):
    """Llama's MLP code with another activation."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, nn.GELU()

    forward = type(tiny_model().model.layers[0].mlp).forward


class _OtherMLP(_GeluMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_what_is_fused_and_why_not(tmp_path):
    model = tiny_model(intermediate_size=96, num_hidden_layers=4)
    layers = model.model.layers
    layers[1].mlp = _GeluMLP(layers[1].mlp)
    layers[2].mlp = _OtherMLP(layers[2].mlp)
    layers[2].mlp.act_fn = nn.SiLU()
    report = convert_to_mixed_precision(model, MixedPrecisionConfig(format="int8", fused_swiglu=True),
                                        filter=LinearFilter(exclude=("model.layers.3.mlp.down_proj", "lm_head")))
    why = {e.name: e.reason for e in report.entries if e.module_type != "Linear" and "mlp" in e.name}
    assert why["model.layers.0.mlp"].startswith("LowBitSwiGLUMLP: INT8 projections")
    assert why["model.layers.1.mlp"] == "SwiGLU not fused: act_fn is GELU, not SiLU"
    assert why["model.layers.2.mlp"].startswith("SwiGLU not fused: its forward is not LlamaMLP's")
    assert why["model.layers.3.mlp"] == ("SwiGLU not fused: down_proj is a Linear, not a low-bit linear (excluded or "
                                         "skipped above)")
    assert isinstance(layers[0].mlp, LowBitSwiGLUMLP) and not isinstance(layers[3].mlp, LowBitSwiGLUMLP)
    assert "SwiGLU not fused: act_fn is GELU" in report.summary()
    # the state_dict is the model's own: it loads into stock transformers, and the fused model saves the same keys
    stock = tiny_model(intermediate_size=96, num_hidden_layers=4)
    assert set(model.state_dict()) == set(stock.state_dict())
    fused = tiny_model(intermediate_size=96)
    convert_to_mixed_precision(fused, MixedPrecisionConfig(format="fp8", fused_swiglu=True, weight_cache=True))
    fused.save_pretrained(tmp_path)
    back = type(stock).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), tiny_model(
        intermediate_size=96).state_dict().values()))
    assert "fused_from=LlamaMLP, format=fp8" in repr(fused)


def test_peft_lora_over_the_fused_mlp_falls_back_per_linear():
    peft = pytest.importorskip("peft")
    model, _, _ = _models("int8")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"]))
    loss = lora(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in lora.named_parameters() if "lora_" in n}
    assert grads and all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # (B starts at zero: A's are zero)
    mlp = next(m for m in lora.modules() if isinstance(m, LowBitSwiGLUMLP))
    assert not mlp._fusable_now() and type(mlp.down_proj).__name__ == "MixedPrecisionLinear"


def test_config_and_arguments_refuse_what_it_cannot_do(tmp_path):
    for bad in (dict(format="fp8_tensorwise"), dict(stochastic_rounding=True), dict(grad_weight=False)):
        with pytest.raises(ValueError, match="fused_swiglu=True needs a format scaled per row"):
            MixedPrecisionConfig(**{"format": "int8", **bad, "fused_swiglu": True})
    with pytest.raises(ValueError, match="lowbit_fused_swiglu=True computes each Llama-style MLP as one function of "
                                         "INT8/FP8 linears"):
        lowbit_args(tmp_path, lowbit_fused_swiglu=True)
    with pytest.raises(ValueError, match="lowbit_fused_swiglu=True computes each Llama-style MLP as one function: it "
                                         "needs lowbit_output and lowbit_grad_input and lowbit_grad_weight True"):
        lowbit_args(tmp_path, int8_mixed_precision=True, lowbit_fused_swiglu=True, lowbit_grad_input=False)
    with pytest.raises(ValueError, match="not fp8_tensorwise_mixed_precision"):
        lowbit_args(tmp_path, fp8_tensorwise_mixed_precision=True, lowbit_fused_swiglu=True)
    with pytest.raises(ValueError, match=r"Liger's SwiGLU patch would replace the fused MLP's forward; pass "
                                         r"liger_kernel_config=\{'swiglu': False\}"):
        lowbit_args(tmp_path, int8_mixed_precision=True, lowbit_fused_swiglu=True, use_liger_kernel=True)
    lowbit_args(tmp_path, int8_mixed_precision=True, lowbit_fused_swiglu=True, use_liger_kernel=True,
                liger_kernel_config={"swiglu": False})
    (_, config), = recipes_from_args(lowbit_args(tmp_path, fp8_mixed_precision=True, lowbit_fused_swiglu=True))
    assert config.fused_swiglu and config.format == "fp8"
    (_, config), = recipes_from_args(lowbit_args(tmp_path, fp8_mixed_precision=True))
    assert not config.fused_swiglu  # unset, off CUDA: the MLP per linear (the kernels are CUDA's)


def test_unset_levers_resolve_on_for_full_fine_tuning_on_cuda(tmp_path, monkeypatch):
    """lowbit_fused_swiglu and lowbit_fused_adamw unset (issue 25's two levers, on by default since the H200's whole
    steps gained with them): on for INT8/FP8 full fine-tuning on a CUDA device; off wherever they are unmeasured or
    cannot serve (CPU, LoRA and QLoRA, FSDP/DeepSpeed, tensorwise FP8, stochastic rounding, a bf16 matmul, Liger's
    SwiGLU, another optimizer) and as given when set. The device is patched: the resolution, not the kernels."""
    from hf_lowbit import LowBitTrainingArguments

    cuda = lambda **kw: lowbit_args(tmp_path, **kw)  # noqa: E731
    monkeypatch.setattr(LowBitTrainingArguments, "device", property(lambda self: torch.device("cuda")))
    for fmt in ("int8", "fp8"):
        args = cuda(**{f"{fmt}_mixed_precision": True})
        assert args.resolved_fused_swiglu() and args.resolved_fused_adamw(), fmt
        assert not args.resolved_fused_swiglu(adapters=True) and not args.resolved_fused_adamw(adapters=True)
    assert not cuda().resolved_fused_swiglu() and not cuda().resolved_fused_adamw()  # no recipe: stock
    for kw in (dict(fp8_tensorwise_mixed_precision=True), dict(int8_mixed_precision=True, lowbit_stochastic_rounding=True),
               dict(int8_mixed_precision=True, lowbit_grad_weight=False),
               dict(int8_mixed_precision=True, use_liger_kernel=True),
               dict(int8_mixed_precision=True, lora_base_quant="nf4"),
               dict(int8_mixed_precision=True, lowbit_fused_swiglu=False)):
        assert not cuda(**kw).resolved_fused_swiglu(), kw
    assert cuda(int8_mixed_precision=True, use_liger_kernel=True,
                liger_kernel_config={"swiglu": False}).resolved_fused_swiglu()
    for kw in (dict(optim="sgd"), dict(lora_base_quant="nf4"), dict(lowbit_fused_adamw=False)):
        assert not cuda(int8_mixed_precision=True, **kw).resolved_fused_adamw(), kw
    assert cuda(int8_mixed_precision=True, optim="adamw_torch").resolved_fused_adamw()
    assert cuda(fp8_tensorwise_mixed_precision=True).resolved_fused_adamw()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # an accelerate launch config's FSDP
    # both levers read the same test: a sharded launch turns each off (the fused MLP's is chosen before a Trainer exists)
    assert not cuda(int8_mixed_precision=True).resolved_fused_swiglu()
    assert not cuda(int8_mixed_precision=True).resolved_fused_adamw()
    (_, config), = recipes_from_args(cuda(fp8_mixed_precision=True))
    assert not config.fused_swiglu
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    (_, config), = recipes_from_args(cuda(fp8_mixed_precision=True))
    assert config.fused_swiglu
    (_, config), = recipes_from_args(cuda(fp8_mixed_precision=True), adapters=True)
    assert not config.fused_swiglu


@pytest.mark.cuda
@pytest.mark.parametrize("col_amax", [False, True], ids=["quantize_t_absmax", "kernel_absmax"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_fused_mlp_on_cuda_compiled_against_per_linear(fmt, col_amax, monkeypatch):
    """On the GPU (the Triton kernels, whose exp is not torch's): the fused MLP against the per-linear path, eager
    and compiled (fullgraph, no break), with the weight cache: every gradient within 20 dB of the eager per-linear
    path's (two low-bit paths whose codes differ where a SwiGLU value's rounding does: FP8's noise is ~-30 dB), the
    MLP's within 20 dB of bf16's; the backward kernel's column absmax on and off (COL_AMAX)."""
    monkeypatch.setattr(swiglu_mlp, "COL_AMAX", col_amax)
    base = tiny_model(intermediate_size=96).to("cuda", torch.bfloat16)
    ids = torch.randint(0, base.config.vocab_size, (2, 64), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(6))
    ref = copy.deepcopy(base)
    ref(ids, labels=ids).loss.backward()
    runs = {}
    for fused in (False, True):
        for compiled in (False, True):
            model = copy.deepcopy(base)
            convert_to_mixed_precision(model, MixedPrecisionConfig(format=fmt, fused_swiglu=fused, weight_cache=True))
            if compiled:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                for layer in model.model.layers:  # the MLPs (ours, or the per-linear composition)
                    layer.mlp.compile(fullgraph=True)
            model(ids, labels=ids).loss.backward()
            if compiled:
                assert not torch._dynamo.utils.counters["graph_break"]
            runs[fused, compiled] = _grads(model)
    for key, grads in runs.items():
        for n, g in grads.items():
            assert snr_db(runs[False, False][n].float(), g.float()) > 20, (key, n)
            if "mlp" in n:
                assert snr_db(ref.get_parameter(n).grad.float(), g.float()) > 20, (key, n)


def test_all_weights_frozen_checkpointing_and_instance_forward():
    """Review regressions: (1) every MLP weight frozen, X needing its gradient (LoRA on attention only): the
    backward's op without the column absmax returned one empty tensor twice, which torch refuses for a custom op's
    outputs; (2) fused gradient accumulation under non-reentrant checkpointing / save_on_cpu (saved-tensor hooks):
    the accumulator check compared the .grad of the *unpacked* weight; (3) an MLP whose forward is set on the instance
    is not fused (the instance attribute would be copied and bypass the fused function)."""
    model, _, _ = _models("int8")
    mlp = next(m for m in model.modules() if isinstance(m, LowBitSwiGLUMLP))
    for p in mlp.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    mlp(x).float().sum().backward()
    want = x.grad.clone()
    x.grad = None
    _per_linear(mlp, x).float().sum().backward()
    assert torch.equal(x.grad, want)
    for hooks in ("checkpoint", "save_on_cpu"):
        model, ref, _ = _models("int8")
        ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
        if hooks == "checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        handle, handle_ref = enable_fused_grad_accumulation(model), enable_fused_grad_accumulation(ref)
        handle.prepare()
        handle_ref.prepare()
        if hooks == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                loss = model(ids, labels=ids).loss
            loss.backward()
        else:
            model(ids, labels=ids).loss.backward()
        ref(ids, labels=ids).loss.backward()
        _equal_bits(_grads(model), _grads(ref))
        handle.close()
        handle_ref.close()
    model = tiny_model(intermediate_size=96)
    hooked = model.model.layers[0].mlp
    hooked.forward = hooked.forward
    report = convert_to_mixed_precision(model, MixedPrecisionConfig(format="int8", fused_swiglu=True))
    assert model.model.layers[0].mlp is hooked and isinstance(model.model.layers[1].mlp, LowBitSwiGLUMLP)
    assert any(e.name == "model.layers.0.mlp" and "overridden on the instance" in e.reason for e in report.entries)


def test_only_the_down_weight_and_changed_configs():
    """Only the down projection's weight needing a gradient (the SwiGLU's backward not run, g and u not kept); a
    projection whose config changed after the fusion: per linear, as the swap report's config said."""
    model, _, _ = _models("int8")
    mlp = next(m for m in model.modules() if isinstance(m, LowBitSwiGLUMLP))
    x = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(7))
    for layer in (mlp.gate_proj, mlp.up_proj):
        layer.weight.requires_grad_(False)
    mlp(x).float().square().sum().backward()
    want = mlp.down_proj.weight.grad.clone()
    mlp.down_proj.weight.grad = None
    _per_linear(mlp, x).float().square().sum().backward()
    assert torch.equal(mlp.down_proj.weight.grad, want)
    assert mlp._fusable_now()
    mlp.up_proj.lowbit_config = MixedPrecisionConfig(format="fp8")
    assert not mlp._fusable_now()
    with torch.no_grad():
        assert torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))
