"""The weight cache of LowBitLinear: the same bits as quantizing per call, and never stale."""

import pytest
import torch
from torch import nn

from hf_lowbit import LowBitLinear, MixedPrecisionConfig
from hf_lowbit.mixed_precision import refresh_weight_caches, set_weight_cache
from hf_lowbit.kernels import quantize_operand, quantize_weight, quantize_weight_t

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layer(fmt, device="cpu", dtype=torch.bfloat16, cache=True):
    torch.manual_seed(0)
    lin = LowBitLinear(64, 48, device=device, dtype=dtype, config=MixedPrecisionConfig(format=fmt))
    with torch.no_grad():  # heterogeneous rows and columns, so a wrong per-row/per-column scale shows
        lin.weight.mul_(torch.logspace(-2, 1, 48, device=device, dtype=dtype)[:, None])
        lin.weight[:, 5] *= 30
    lin.set_weight_cache(cache)
    return lin


def _run(lin, x):
    x = x.detach().clone().requires_grad_(True)
    y = lin(x)
    y.backward(torch.linspace(-1, 1, y.numel(), device=x.device).reshape(y.shape).to(y.dtype))
    grads = (x.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
    lin.zero_grad(set_to_none=True)
    return (y.detach(), *grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_quantize_weight_equals_per_call_quantization(fmt, device):
    w = torch.randn(48, 64, device=device, dtype=torch.bfloat16) * torch.logspace(-2, 1, 48, device=device)[:, None].bfloat16()
    q, s, qt = quantize_weight(fmt, w)
    rq, rs = quantize_operand(fmt, w.cpu(), 1)  # the plain-torch reference (on CUDA: the Triton kernels)
    rqt, rst = quantize_weight_t(fmt, w.cpu())  # the backward's re-encoding, from scratch and from the scales
    assert torch.equal(rst, rs) and torch.equal(quantize_weight_t(fmt, w.cpu(), rs)[0].float(), rqt.float())
    for name, got, ref in (("q", q, rq), ("scale", s, rs), ("q_t", qt, rqt), ("q_t is q transposed", qt.cpu(), rq.T)):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        got, ref = got.cpu().float(), ref.float()  # values (the FP8 kernel may write +0 where torch writes -0)
        assert torch.equal(got, ref), f"{name}: {(got != ref).sum().item()} of {got.numel()} differ"
    assert qt.is_contiguous() and q.is_contiguous()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_cached_layer_is_bit_identical_to_uncached(fmt):
    x = torch.randn(3, 10, 64, dtype=torch.bfloat16)
    got = _run(_layer(fmt, cache=True), x)
    ref = _run(_layer(fmt, cache=False), x)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("fmt", ["int8", "fp8_tensorwise"])
@pytest.mark.parametrize("how", ["optimizer", "fused_optimizer", "in_place", "load_state_dict", "to_dtype"])
def test_cache_is_never_stale(how, fmt):
    """After any change of the weight the next forward (eager or through refresh_weight_caches, as a
    compiled run does) and its backward compute with the new weight: output and gradients equal to a fresh
    layer holding the same weight."""
    lin = _layer(fmt)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    before = lin(x).detach()
    if how in ("optimizer", "fused_optimizer"):  # fused: no version-counter bump, the hook must not rely on it
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=how == "fused_optimizer")
        lin(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fresh = _layer(fmt, cache=False)
        fresh.load_state_dict(lin.state_dict())
        assert torch.equal(lin._wq, quantize_operand(fmt, lin.weight.detach(), 1)[0])  # refreshed by the hook
    elif how == "in_place":
        with torch.no_grad():
            lin.weight.mul_(-2)
    elif how == "load_state_dict":
        state = {k: v.clone() for k, v in lin.state_dict().items()}
        state["weight"] = torch.randn_like(state["weight"])
        lin.load_state_dict(state)
        assert lin._cache_key == lin._weight_key()
    else:
        lin = lin.to(torch.float32)
        x = x.float()
    fresh = _layer(fmt, dtype=lin.weight.dtype, cache=False)
    fresh.load_state_dict(lin.state_dict())
    got, ref = _run(lin, x), _run(fresh, x)  # the backward reads the cache too (scales, transposed codes)
    assert not torch.equal(got[0].to(before.dtype), before)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        assert torch.equal(g, r), name


def test_refresh_weight_caches_counts_only_stale_layers():
    model = nn.Sequential(_layer("int8"), nn.ReLU(), LowBitLinear(48, 16, dtype=torch.bfloat16))
    assert set_weight_cache(model, True) == 2
    assert refresh_weight_caches(model) == 0
    with torch.no_grad():
        model[0].weight.add_(1)
    assert refresh_weight_caches(model) == 1
    set_weight_cache(model, False)
    assert model[0]._wq is None and model[0]._cache_key is None


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_compiled_cached_layer_no_graph_break_and_follows_optimizer(fmt):
    """Compiled, the cached layer computes what the compiled per-call layer computes, step after step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lin = _layer(fmt, dtype=torch.float32)
    ref = _layer(fmt, dtype=torch.float32, cache=False)
    compiled, compiled_ref = torch.compile(lin), torch.compile(ref)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randn(8, 64)
    for _ in range(3):  # each step changes the weight; the compiled forward must see the new one
        y, y_ref = compiled(x), compiled_ref(x)
        assert torch.equal(y, y_ref)
        y.square().mean().backward()
        y_ref.square().mean().backward()
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_trainer_with_gradient_accumulation_caches_and_matches_uncached(tmp_path, optim, fmt):
    """LowBitTrainer turns the cache on by itself with gradient accumulation; training is unchanged by it
    (the same losses as with the cache off, bit for bit on a CPU), also with a fused optimizer, INT8 and FP8."""
    from conftest import arithmetic_blocks, tiny_model

    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments

    losses = {}
    for cache in (None, False):
        args = LowBitTrainingArguments(output_dir=str(tmp_path / str(cache)), max_steps=6, per_device_train_batch_size=4,
                                       gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1,
                                       save_strategy="no", report_to="none", seed=0, lowbit_min_features=16,
                                       disable_tqdm=True, optim=optim, use_cpu=True, lowbit_weight_cache=cache,
                                       **{f"{fmt}_mixed_precision": True})
        trainer = LowBitTrainer(tiny_model(vocab_size=96), args=args, train_dataset=arithmetic_blocks(48))
        assert trainer.lowbit_weight_cache is (cache is None)
        trainer.train()
        if cache is None:
            assert all(m.weight_cache for m in trainer.model.modules() if isinstance(m, LowBitLinear))
        losses[cache] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[None]) == 6 and losses[None] == losses[False]


def test_small_micro_batch_warning_only_without_accumulation():
    from hf_lowbit import check_training_setup

    def found(grad_accum):
        return [m for m in check_training_setup(recipes=["int8_mixed_precision"], device="cpu", compiled=True,
                                                packed=True, optimizer="adamw_torch", tokens_per_step=2048,
                                                grad_accum=grad_accum, emit=False) if "tokens per micro-batch" in m]

    assert len(found(1)) == 1 and "gradient_accumulation_steps" in found(1)[0]
    assert found(8) == []


def test_cuda_graphs_chosen_only_where_measured(monkeypatch):
    """LowBitTrainer's automatic CUDA graphs: INT8/FP8 compute (full fine-tuning, LoRA, QLoRA), compiled without a
    mode, one CUDA device, nothing sharded (by the arguments or an accelerate launch's environment); never for a
    QLoRA base computing in bf16, never over an explicit choice."""
    for var in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(var, raising=False)
    from types import SimpleNamespace

    from hf_lowbit.trainer import _use_cuda_graphs

    def args(**kw):
        base = dict(lowbit_cuda_graphs=None, lowbit_recipes=["int8_mixed_precision"], lora_base_quant=None,
                    torch_compile=True, torch_compile_mode=None, fsdp=[], deepspeed=None, device=torch.device("cuda"))
        base.update(kw)
        return SimpleNamespace(**base)

    assert _use_cuda_graphs(args())
    assert _use_cuda_graphs(args(), adapters=True)  # LoRA / QLoRA with INT8 compute
    assert _use_cuda_graphs(args(lora_base_quant="nf4"), adapters=True)
    assert not _use_cuda_graphs(args(lora_base_quant="nf4", lowbit_recipes=[]), adapters=True)  # bf16 compute
    assert not _use_cuda_graphs(args(lowbit_recipes=[]))
    assert not _use_cuda_graphs(args(torch_compile=False))
    assert not _use_cuda_graphs(args(torch_compile_mode="max-autotune"))
    assert not _use_cuda_graphs(args(fsdp=["full_shard"]))
    assert not _use_cuda_graphs(args(deepspeed="ds_config.json"))
    for var in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.setenv(var, "true")
        assert not _use_cuda_graphs(args()), var
        monkeypatch.delenv(var)
    assert not _use_cuda_graphs(args(device=torch.device("cpu")))
    assert _use_cuda_graphs(args(lowbit_cuda_graphs=True, device=torch.device("cpu")))
    assert not _use_cuda_graphs(args(lowbit_cuda_graphs=False))


@pytest.mark.parametrize("cast", ["to_bf16", "to_fp32", "bf16_again"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_tensorwise"])
def test_cache_survives_module_dtype_casts(fmt, cast):
    """``Module.to(dtype)`` / ``.bfloat16()`` also cast floating-point buffers: the FP8 codes and the float32
    scales of the cache. The refresh must not write into such cast buffers (FP8: codes held as floats, refused
    by the matmul; INT8: scales rounded to bf16) but reallocate them, also when the cast left the weight itself
    as it was (its version, storage and dtype unchanged): same results as an uncached layer."""
    src, dst = {"to_bf16": (torch.float32, torch.bfloat16), "to_fp32": (torch.bfloat16, torch.float32),
                "bf16_again": (torch.bfloat16, torch.bfloat16)}[cast]  # again: the weight unchanged, buffers cast
    lin = _layer(fmt, dtype=src)
    x = torch.randn(3, 5, 64, dtype=src)
    _run(lin, x)
    lin = lin.to(dst) if cast == "to_fp32" else lin.bfloat16()
    fresh = _layer(fmt, dtype=dst, cache=False)
    fresh.load_state_dict(lin.state_dict())
    got, ref = _run(lin, x.to(dst)), _run(fresh, x.to(dst))
    code = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    assert (lin._wq.dtype, lin._wq_scale.dtype, lin._wq_t.dtype) == (code, torch.float32, code)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        assert torch.equal(g, r), name


def test_trainer_fused_adamw_swaps_the_optimizer_and_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    """lowbit_fused_adamw: LowBitTrainer's AdamW becomes LowBitAdamW with the same groups and options, with a low-bit
    recipe or none, with accumulation or without; on a CPU (no Triton kernel) every parameter takes torch's step, so
    training is the same bit for bit; refused in one line with another optimizer and with FSDP or DeepSpeed. The
    kernel's own path is tests/test_triton_int8.py's (interpreter, CUDA)."""
    import transformers
    from conftest import arithmetic_blocks, tiny_model

    from hf_lowbit import LowBitAdamW, LowBitTrainer, LowBitTrainingArguments

    def make(out, **kw):
        base = dict(output_dir=str(tmp_path / out), max_steps=4, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                    report_to="none", seed=0, lowbit_min_features=16, disable_tqdm=True, use_cpu=True,
                    optim="adamw_torch_fused", int8_mixed_precision=True)
        return LowBitTrainingArguments(**{**base, **kw})

    losses = {}
    for fused in (True, None):
        trainer = LowBitTrainer(tiny_model(vocab_size=96), args=make(str(fused), lowbit_fused_adamw=fused),
                                train_dataset=arithmetic_blocks(48))
        trainer.train()
        assert isinstance(trainer.optimizer.optimizer, LowBitAdamW) is bool(fused)  # inside accelerate's wrapper
        losses[fused] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[True]) == 4 and losses[True] == losses[None]
    for kw in (dict(int8_mixed_precision=False), dict(gradient_accumulation_steps=1),
               dict(lowbit_weight_cache=False)):  # no recipe, no cache: the kernel for the large parameters alone
        trainer = LowBitTrainer(tiny_model(vocab_size=96), args=make("any", lowbit_fused_adamw=True, **kw),
                                train_dataset=arithmetic_blocks(48))
        assert trainer.lowbit_fused_adamw and isinstance(trainer.create_optimizer(), LowBitAdamW), kw
    user_optimizer = torch.optim.AdamW(tiny_model(vocab_size=96).parameters())
    kept = LowBitTrainer(tiny_model(vocab_size=96), args=make("given", lowbit_fused_adamw=True),
                         train_dataset=arithmetic_blocks(48), optimizers=(user_optimizer, None))
    assert kept.create_optimizer() is user_optimizer  # one passed in is left as it is
    for kw, match in ((dict(optim="sgd"), "optim must be 'adamw_torch' or 'adamw_torch_fused'"),
                      (dict(lowbit_fused_adamw=1), "must be True, False or None")):
        with pytest.raises((ValueError, TypeError), match=match):
            make("bad", **{"lowbit_fused_adamw": True, **kw})
    made = transformers.Trainer.create_accelerator_and_postprocess

    def as_if_sharded(self):  # what accelerate's FSDP plugin makes the Trainer say
        made(self)
        self.is_fsdp_enabled = True

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", as_if_sharded)
    with pytest.raises(ValueError, match="lowbit_fused_adamw=True: not with FSDP or DeepSpeed"):
        LowBitTrainer(tiny_model(vocab_size=96), args=make("fsdp", lowbit_fused_adamw=True),
                      train_dataset=arithmetic_blocks(48))


def test_a_copied_cached_layer_is_refreshed_after_optimizer_steps():
    """copy.deepcopy (or unpickling) of a cached layer: the copy is in the registry the post-step hook refreshes, so
    its cache follows its own weight after an optimizer step with no forward in between (a compiled loop's forward
    does not refresh), and the original's is left as it was."""
    import copy

    from hf_lowbit.mixed_precision import linear as L

    original = _layer("int8")
    twin = copy.deepcopy(original)
    assert twin in L._CACHED_LAYERS and original in L._CACHED_LAYERS
    before = original._wq.clone()
    twin.weight.grad = torch.randn_like(twin.weight)
    torch.optim.AdamW(twin.parameters(), lr=0.1).step()
    q, s, qt = quantize_weight("int8", twin.weight.detach())
    assert not torch.equal(q, before)  # the step moved the codes
    assert torch.equal(twin._wq, q) and torch.equal(twin._wq_scale, s) and torch.equal(twin._wq_t, qt)
    assert torch.equal(original._wq, before)
