"""Gradient accumulation fused into the weight-gradient matmul (``hf_lowbit.mixed_precision.grad_accum``,
``hf_lowbit::scaled_mm_accumulate_``): the op against its reference, the kernel in Triton's interpreter and on CUDA,
the layer eager and compiled against autograd's own accumulation, the contract around ``.grad``, and the Trainer."""

from functools import partial

import pytest
import torch
from conftest import arithmetic_blocks, lowbit_args, snr_db, tiny_model

from hf_lowbit import (FusedGradAccumulation, LowBitTrainer, MixedPrecisionConfig, MixedPrecisionLinear,
                       enable_fused_grad_accumulation)
from hf_lowbit.kernels import scaled_mm_accumulate_
from hf_lowbit.kernels.accumulate import scaled_mm_accumulate_reference
from hf_lowbit.kernels.fp8 import FP8_DTYPE
from hf_lowbit.kernels.int8 import int8_mm_reference

FORMATS = ("int8", "fp8", "fp8_tensorwise")


def test_reference_adds_the_scaled_product_rounding_once():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (9, 40), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (7, 40), dtype=torch.int8, generator=g)
    sa, sb = torch.rand(9, generator=g) / 100, torch.rand(7, generator=g) / 100
    acc = torch.randn(9, 7, generator=g).to(torch.bfloat16)
    want = (acc.float() + int8_mm_reference(a, b).float() * sa[:, None] * sb[None, :]).to(torch.bfloat16)
    assert torch.equal(scaled_mm_accumulate_reference(acc, a, b, sa, sb), want)
    before = acc.clone()
    scaled_mm_accumulate_(acc, a, b, sa, sb)  # the op, in place
    assert torch.equal(acc, want) and not torch.equal(acc, before)
    fa, fb = (torch.randn(9, 40, generator=g) * 8).to(FP8_DTYPE), (torch.randn(7, 40, generator=g) * 8).to(FP8_DTYPE)
    acc32 = torch.zeros(9, 7)
    scaled_mm_accumulate_(acc32, fa, fb, sa, sb)
    torch.testing.assert_close(acc32, (fa.float() @ fb.float().T) * sa[:, None] * sb[None, :])


@pytest.mark.parametrize("bad, match", [
    (dict(acc=torch.zeros(3, 4, dtype=torch.int32)), "acc must be a floating"),
    (dict(acc=torch.zeros(4, 3)), r"acc must be a floating \[M=3, N=4\]"),
    (dict(b=torch.zeros(4, 5, dtype=torch.int8)), r"a \[M, K\] and b \[N, K\]"),
    (dict(b=torch.zeros(4, 8, dtype=FP8_DTYPE)), "must both be int8 or both float8"),
    (dict(sb=torch.ones(3)), "b_scale one per row of b"),
])
def test_bad_arguments_are_refused_in_one_line(bad, match):
    args = dict(acc=torch.zeros(3, 4), a=torch.zeros(3, 8, dtype=torch.int8), b=torch.zeros(4, 8, dtype=torch.int8),
                sa=torch.ones(3), sb=torch.ones(4))
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        scaled_mm_accumulate_(args["acc"], args["a"], args["b"], args["sa"], args["sb"])


def test_kernel_interpreted():
    from test_triton_int8 import run_interpreted

    assert "checked 12 accumulating matmuls" in run_interpreted("accumulate")


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(12))
def test_kernel_cuda(i):
    from _triton_checks import check_scaled_mm_accumulate, scaled_mm_accumulate_cases

    assert len(scaled_mm_accumulate_cases("cuda")) == 12
    assert check_scaled_mm_accumulate("cuda", [i]) == 2


def _pair(fmt: str, device: str = "cpu", dtype=torch.bfloat16, **config):
    """Two layers with the same parameters: one whose weight gradient autograd accumulates, one fused."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 32).to(device, dtype)
    cfg = MixedPrecisionConfig(format=fmt, **config)
    plain = MixedPrecisionLinear.from_linear(base, cfg)
    copy = torch.nn.Linear(64, 32).to(device, dtype)
    copy.load_state_dict(base.state_dict())
    fused = torch.nn.Sequential(MixedPrecisionLinear.from_linear(copy, cfg))
    return plain, fused, enable_fused_grad_accumulation(fused)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_gradients_match_autograds_accumulation(fmt, compiled):
    plain, fused, handle = _pair(fmt)
    layer = fused[0]
    handed = []  # weight gradients autograd computes: none where the matmul accumulates them itself
    layer.weight.register_hook(handed.append)
    run = torch.compile(fused) if compiled else fused
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for step in range(2):  # zero_grad(set_to_none=True) between steps: the accumulation starts again from zeros
        handle.prepare()
        for x in xs:
            run(x).float().square().sum().backward()
            plain(x).float().square().sum().backward()
        assert layer.weight.grad is layer.grad_acc and all(g is None for g in handed)
        # one rounding (fused) against one per micro-batch plus autograd's add: bf16's rounding apart (float32
        # weights: test_float32_weights_accumulate_as_autograd_does)
        assert snr_db(plain.weight.grad, layer.weight.grad) > 40
        # the bias still through autograd (compiled: its sum rounded once, eager once a micro-batch)
        if compiled:
            assert snr_db(plain.bias.grad, layer.bias.grad) > 40
        else:
            torch.testing.assert_close(layer.bias.grad, plain.bias.grad)
        for p in (*plain.parameters(), *fused.parameters()):
            p.grad = None
    handle.close()


def test_float32_weights_accumulate_as_autograd_does():
    plain, fused, handle = _pair("int8", dtype=torch.float32)
    handle.prepare()
    for i in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
        fused(x).sum().backward()
        plain(x).sum().backward()
    torch.testing.assert_close(fused[0].weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_prepare_starts_from_zeros_copies_in_and_reallocates():
    _, fused, handle = _pair("int8")
    layer = fused[0]
    handle.prepare()
    assert layer.weight.grad is layer.grad_acc and not layer.grad_acc.any()
    layer.grad_acc.fill_(3.0)
    layer.weight.grad = None  # zero_grad()
    handle.prepare()
    assert not layer.grad_acc.any()
    own = torch.full_like(layer.weight, 2.0)
    layer.weight.grad = own  # something else set it: copied in, not lost
    handle.prepare()
    assert layer.weight.grad is layer.grad_acc and torch.equal(layer.grad_acc, own)
    fused.float()  # the weight changed dtype: a new accumulator of the new dtype
    layer.weight.grad = None
    handle.prepare()
    assert layer.grad_acc.dtype == torch.float32 and layer.weight.grad is layer.grad_acc


def test_a_backward_or_an_optimizer_step_without_prepare_raises():
    _, fused, handle = _pair("int8")
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    handle.prepare()
    fused(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    opt.step()  # attached: fine
    opt.zero_grad()  # set_to_none: the next backward's gradient would go nowhere
    with pytest.raises(RuntimeError, match=r"call FusedGradAccumulation.prepare\(\) before every micro-batch"):
        fused(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()  # eagerly, the backward itself refuses
    with pytest.raises(RuntimeError, match=r"call FusedGradAccumulation.prepare\(\) before every micro-batch.*close"):
        opt.step()  # (compiled, only this check can tell)
    handle.close()  # closed: autograd's own accumulation again, and no check
    fused[0].weight.grad = None
    fused(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    assert fused[0].weight.grad is not None and fused[0].grad_acc is None
    opt.step()


def test_a_dropped_handle_is_still_checked_and_a_second_handle_refused():
    _, fused, handle = _pair("int8")
    with pytest.raises(ValueError, match=r"1 linears \(first '0'\) are covered by another handle already"):
        enable_fused_grad_accumulation(fused)
    opt = torch.optim.SGD(fused.parameters(), lr=0.1)
    del handle  # the layer keeps its accumulator: the step check must not go with the handle
    with pytest.raises(RuntimeError, match="is not the accumulator"):
        opt.step()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_called_twice_in_one_forward_adds_both_products(compiled):
    plain, fused, handle = _pair("int8", dtype=torch.float32)
    run = torch.compile(fused) if compiled else fused
    handle.prepare()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    (run(x) + run(2 * x)).sum().backward()  # shared weights (a looped block): two weight-gradient products
    (plain(x) + plain(2 * x)).sum().backward()
    torch.testing.assert_close(fused[0].weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [dict(save_x_codes=True), dict(dual_grad_quant=True),
                                    dict(stochastic_rounding=True)], ids=["x_codes", "dual", "sr"])
def test_backward_variants_accumulate_too(config):
    """X's codes kept from the forward, dY's dual quantization (not used where dW is accumulated: the split path),
    stochastic rounding: each accumulates its weight gradient (SR draws other random numbers than the plain layer)."""
    plain, fused, handle = _pair("int8", **config)
    handle.prepare()
    for i in range(3):
        x = torch.randn(16, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
        fused(x).float().square().sum().backward()
        plain(x).float().square().sum().backward()
    assert fused[0].weight.grad is fused[0].grad_acc
    assert snr_db(plain.weight.grad, fused[0].weight.grad) > (30 if config.get("stochastic_rounding") else 40)


def test_gradient_checkpointing_accumulates_once():
    from torch.utils.checkpoint import checkpoint

    plain, fused, handle = _pair("int8", dtype=torch.float32)
    handle.prepare()
    for i in range(2):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i), requires_grad=True)
        checkpoint(fused, x, use_reentrant=False).sum().backward()  # the forward runs twice, the backward once
        plain(x).sum().backward()
    torch.testing.assert_close(fused[0].weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_covers_trainable_low_bit_weight_gradients_of_untied_weights_only():
    torch.manual_seed(0)
    shared = torch.nn.Linear(64, 64)
    model = torch.nn.Sequential(
        MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 64), MixedPrecisionConfig()),
        MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 64), MixedPrecisionConfig(grad_weight=False)),
        MixedPrecisionLinear.from_linear(shared, MixedPrecisionConfig()),
        MixedPrecisionLinear.from_linear(shared, MixedPrecisionConfig()),  # the same Parameter twice
        MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 64), MixedPrecisionConfig()),
    )
    model[4].weight.requires_grad_(False)
    handle = FusedGradAccumulation(model)
    assert handle.layers == [model[0]]
    assert "fused_grad_accum" in repr(model[0]) and "fused_grad_accum" not in repr(model[1])
    handle.close()


_args = partial(lowbit_args, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=3,
                learning_rate=1e-3, logging_steps=1, save_strategy="no", seed=0)


def test_trainer_with_it_on_trains_as_without(tmp_path, monkeypatch):
    from hf_lowbit.kernels import scaled_matmul_accumulate
    from hf_lowbit.mixed_precision import linear

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return scaled_matmul_accumulate(*args, **kwargs)

    monkeypatch.setattr(linear, "scaled_matmul_accumulate", counted)
    ds = arithmetic_blocks(24)
    runs = {}
    for fused in (None, True):  # the default (off), and on
        trainer = LowBitTrainer(tiny_model(), _args(tmp_path / str(fused), int8_mixed_precision=True,
                                                    lowbit_fused_grad_accum=fused), train_dataset=ds)
        trainer.train()
        assert trainer.lowbit_fused_grad_accum is bool(fused)
        runs[fused] = (trainer.state.log_history[-2]["loss"], [p.detach().float() for p in trainer.model.parameters()])
    swapped = [m for m in trainer.model.modules() if isinstance(m, MixedPrecisionLinear)]
    assert len(swapped) == 10  # 2 layers x 5 (k, v: too small)
    # train() closed its handle: the layers give their gradients to autograd again, no accumulator held
    assert trainer._lowbit_fused is None and all(m.grad_acc is None for m in swapped)
    assert len(calls) == 3 * 3 * 10  # steps x micro-batches x linears: every weight gradient went through it
    (loss_off, params_off), (loss_on, params_on) = runs[None], runs[True]
    assert abs(loss_on - loss_off) < 0.02 * abs(loss_off)
    assert min(snr_db(a, b) for a, b in zip(params_off, params_on)) > 30


def test_trainer_warns_where_it_fuses_nothing(tmp_path):
    from peft import LoraConfig

    from hf_lowbit.warnings import LowBitWarning

    ds = arithmetic_blocks(8)
    with pytest.warns(LowBitWarning, match="gradient_accumulation_steps=1: nothing accumulates"):
        LowBitTrainer(tiny_model(), _args(tmp_path / "ga1", int8_mixed_precision=True, lowbit_fused_grad_accum=True,
                                          gradient_accumulation_steps=1), train_dataset=ds)
    # LoRA over an INT8 base: the adapters train in bf16, the base's weight has no gradient
    trainer = LowBitTrainer(tiny_model(), _args(tmp_path / "lora", int8_mixed_precision=True, lora_base_quant="int8",
                                                lowbit_fused_grad_accum=True, max_steps=1), train_dataset=ds,
                            peft_config=LoraConfig(r=4, target_modules="all-linear"))
    with pytest.warns(LowBitWarning, match="no layer here has a trainable low-bit weight gradient"):
        trainer.train()


def test_trainer_refuses_it_without_a_low_bit_weight_gradient(tmp_path):
    with pytest.raises(ValueError, match="lowbit_fused_grad_accum=True adds the low-bit weight-gradient matmul"):
        _args(tmp_path, lowbit_fused_grad_accum=True)
    with pytest.raises(ValueError, match="lowbit_fused_grad_accum=True adds"):
        _args(tmp_path, int8_mixed_precision=True, lowbit_grad_weight=False, lowbit_fused_grad_accum=True)


@pytest.mark.parametrize("mode, world_size, refused", [("distributed", 1, False), ("distributed", 2, True),
                                                       ("not_distributed", 1, True), ("not_parallel", 1, False),
                                                       ("tpu", 1, True), ("sagemaker_model_parallel", 1, True)])
def test_trainer_refuses_it_where_another_wrapper_takes_the_gradients(tmp_path, monkeypatch, mode, world_size,
                                                                     refused):
    """Refused under DDP (more than one process), DataParallel (several GPUs in one process), XLA and SageMaker, whose
    hooks, replicas and wrappers take each gradient from autograd; not for one process launched by torchrun
    ("distributed", world size 1), around which accelerate wraps no DDP on GPUs."""
    from transformers.training_args import ParallelMode

    args = _args(tmp_path, int8_mixed_precision=True, lowbit_fused_grad_accum=True)
    monkeypatch.setattr(type(args), "parallel_mode", property(lambda self: ParallelMode(mode)))
    monkeypatch.setattr(type(args), "world_size", property(lambda self: world_size))
    build = partial(LowBitTrainer, tiny_model(), args, train_dataset=arithmetic_blocks(8))
    if refused:
        with pytest.raises(ValueError, match="lowbit_fused_grad_accum=True: not with DDP, FSDP, DeepSpeed or "
                                             "DataParallel"):
            build()
    else:
        assert build().lowbit_fused_grad_accum is True


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_compiled_backward_adds_into_the_accumulator_in_place_cuda(fmt):
    """On the GPU the compiled backward launches the accumulating kernel on the accumulator itself (a graph input
    AOTAutograd lets the backward mutate), with no copy of it in or out, and matches the eager fused layer."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    plain, fused, handle = _pair(fmt, device="cuda")
    eager = torch.nn.Sequential(MixedPrecisionLinear.from_linear(plain, plain.lowbit_config))  # the same Parameters
    eager_handle = enable_fused_grad_accumulation(eager)
    layer = fused[0]
    handed = []  # weight gradients autograd computes: none, the compiled backward adds them itself
    layer.weight.register_hook(handed.append)
    run = torch.compile(fused)
    xs = [torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
          for i in range(3)]
    handle.prepare()
    eager_handle.prepare()
    codes = []
    for x in xs:
        _, code = run_and_get_code(lambda: run(x).float().square().sum().backward())
        codes += code
        eager(x).float().square().sum().backward()
    backward = [c for c in codes if "_scaled_mm_accumulate_kernel" in c]
    assert backward, "the compiled backward does not launch the accumulating kernel"
    copies = [line for c in backward for line in c.splitlines() if ".copy_(" in line]
    assert not copies, f"the accumulator is copied instead of written in place: {copies[:4]}"
    assert layer.weight.grad is layer.grad_acc and handed and all(g is None for g in handed)
    # Inductor's fused quantization and the eager ops may round a code apart: as two runs of the recipe
    assert snr_db(eager[0].grad_acc, layer.grad_acc) > 30
    handle.close()
    eager_handle.close()
