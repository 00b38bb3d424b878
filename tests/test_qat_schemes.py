"""The GPU-serving QAT schemes: ``int4_tinygemm`` and ``fp8_rowwise``.

On CPU: the fake quantization against torchao's own quantize primitives and tensors (their converts refuse a
CPU: tinygemm's packing is a CUDA op, FP8's convert checks for an sm_89 GPU), against the tinygemm-format CPU
kernel, the shape/group/device rules and their one-line errors, and the FP8 export end to end (torchao's
hardware gate lifted at convert only: the fresh process that loads and generates runs torch's CPU
``_scaled_mm``). The convert -> export -> load -> generate path of both schemes on a GPU: the ``cuda`` tests.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ARITH_TOKENIZER, arithmetic_blocks, snr_db, tiny_config, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM

from hf_lowbit import LowBitTrainer, LowBitTrainingArguments
from hf_lowbit.kernels.fake_quant import fake_quant_fp8_rowwise, fake_quant_int4_tinygemm
from hf_lowbit.qat import QATConfig, QATLinear, convert_qat, prepare_qat, qat_linear
from hf_lowbit.trainer import check_qat_device

BF16 = torch.bfloat16
U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits: half an ulp is 2^-8 relative at worst)


def _groups_that_test_the_corners(n=64, k=512, g=64, seed=0):
    """Random rows of various scales and offsets, and groups that are constant, zero, or a tiny range at a
    large offset (where a scale is the clamp minimum or the float32 sum in the dequant could round)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3 + torch.randn(n, 1, generator=gen)
    w[0, :g] = 0
    w[1, :g] = 3.0
    w[2, :g] = -1e-3
    w[3, :g] = 100 + torch.arange(g) * 1e-2
    w[4, :g] = 1e-30
    return w


def _tinygemm_reference(w: torch.Tensor, g: int):
    """torchao's qparams and codes for the tile-packed int4 tensor, and the kernel's dequantization
    ``(q - 8) * scale + zero`` rounded once to bf16 (float64 is exact for these operands)."""
    from torchao.quantization.quant_primitives import (MappingType, _choose_qparams_affine_tinygemm,
                                                       _quantize_affine_tinygemm)

    wb = w.to(BF16)
    scale, zero = _choose_qparams_affine_tinygemm(wb, MappingType.ASYMMETRIC, (1, g), torch.int32, 0, 15,
                                                  scale_dtype=BF16, zero_point_dtype=BF16)
    q = _quantize_affine_tinygemm(wb, [1, g], scale, zero, torch.int32, 0, 15)
    n = w.shape[0]
    deq = ((q.double().reshape(n, -1, g) - 8) * scale.double().reshape(n, -1, 1)
           + zero.double().reshape(n, -1, 1)).reshape(w.shape).to(BF16)
    return q, scale.reshape(n, -1), zero.reshape(n, -1), deq


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_int4_tinygemm_fake_quant_is_torchaos_codes_dequantized_as_the_kernel_does(dtype):
    from torchao.quantization.quant_primitives import _dequantize_affine_tinygemm
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    w = _groups_that_test_the_corners().to(dtype)
    q, scale, zero, deq = _tinygemm_reference(w, 64)
    ours = fake_quant_int4_tinygemm(w, 64)
    assert ours.dtype == BF16 and torch.equal(ours, deq)
    ref32 = _dequantize_affine_tinygemm(q, [1, 64], scale.reshape(-1, 1), zero.reshape(-1, 1), torch.int32, 0, 15,
                                        output_dtype=torch.float32)
    assert torch.equal(ours, ref32.to(BF16))
    # torchao's bf16 reference rounds the product and the sum apiece: not the kernel's single FMA rounding
    ref16 = _dequantize_affine_tinygemm(q, [1, 64], scale.reshape(-1, 1), zero.reshape(-1, 1), torch.int32, 0, 15,
                                        output_dtype=BF16)
    assert (ref16 != ours).sum() > 100
    # torch's CPU kernel for the same format (codes 0..15, bf16 [scale, zero] pairs) dequantizes the same codes
    # to weights that round to ours (it keeps them in float32; the CUDA kernel's FMA rounds them to bf16 before
    # its bf16 tensor-core matmul, where the identity gives back exactly ours: the cuda test below)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
    sz = pack_tinygemm_scales_and_zeros(scale, zero, BF16)
    recovered = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(w.shape[1], dtype=BF16), packed, 64, sz).T
    assert torch.equal(recovered, ours)
    # at most 16 levels per group; each weight within about half a step of its level (the codes are computed
    # in bf16, whose rounding of (w - min)/scale, up to 15, moves a code by up to 1/32: 0.6 steps, not 0.5)
    assert all(len(grp.unique()) <= 16 for grp in ours.reshape(-1, 64))
    wb = w.to(BF16).float()
    assert ((ours.float() - wb).abs() <= scale.float().repeat_interleave(64, 1) * 0.6 + 2 * U * wb.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_int4_tinygemm_qat_linear_computes_what_the_int4pack_kernel_computes(dtype):
    """bf16 activations times the kernel's bf16 weights, output cast back: within the roundings of torch's
    tinygemm-format CPU kernel (which multiplies by the same weights unrounded, in float32)."""
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    w = _groups_that_test_the_corners(48, 256, 32, seed=1)
    x = (torch.randn(3, 5, 256) * 2).to(dtype)
    q, scale, zero, deq = _tinygemm_reference(w, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
    sz = pack_tinygemm_scales_and_zeros(scale, zero, BF16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, 256).to(BF16), packed, 32, sz)
    with torch.no_grad():
        ours = qat_linear(x, w.to(dtype), None, QATConfig("int4_tinygemm", 32))
    assert ours.dtype == dtype and ours.shape == (3, 5, 48)
    ours = ours.reshape(-1, 48).float()
    magnitude = x.reshape(-1, 256).to(BF16).float().abs() @ deq.float().abs().T
    # two bf16 output roundings, the weights' bf16 rounding (ours) and float32 sums
    bound = 2 * U * kernel.float().abs() + (U + 256 * 2.0 ** -23) * magnitude
    assert ((ours - kernel.float()).abs() <= bound).all()
    assert snr_db(F.linear(x.float(), w.float()).reshape(-1, 48), ours) > 10  # a quantization of the product


@pytest.fixture
def torchao_fp8(monkeypatch):
    """torchao's own FP8 row-wise quantization: the weight convert of ``Float8DynamicActivationFloat8WeightConfig(
    granularity=PerRow())`` (quant_api's function, its sm_89 gate lifted: the quantization is device independent,
    the gate is about the matmul) and the activation quantization its ``Float8Tensor`` applies in ``F.linear``."""
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    config = QATConfig("fp8_rowwise").base_config()

    def weight(w):
        return quant_api._float8_dynamic_activation_float8_weight_quantize_tensor(w, config)

    def act(x, w_fp8):
        return _choose_quant_func_and_quantize_tensor(x, w_fp8.act_quant_kwargs)

    return weight, act


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fp8_rowwise_fake_quant_equals_torchaos_float8_tensor(dtype, torchao_fp8):
    to_weight, to_act = torchao_fp8
    w = torch.randn(64, 256) * torch.rand(64, 1) * 10
    w[5] *= 1e-20
    wt = to_weight(w.to(BF16))  # PerRow weights are bf16 only: the scheme casts them (weight_dtype)
    assert type(wt).__name__ == "Float8Tensor"
    assert torch.equal(fake_quant_fp8_rowwise(w.to(BF16)), wt.dequantize())
    x = (torch.randn(4, 7, 256) * 3).to(dtype)
    x[0, 0, :128] = 1e4  # a row dominated by outliers: its small entries flush to zero in e4m3
    assert torch.equal(fake_quant_fp8_rowwise(x), to_act(x, wt).dequantize())
    # e4m3 keeps 3 mantissa bits: within half a step of 2^-3 relative, or of the smallest subnormal
    wb = w.to(BF16).float()
    fq, tiny = fake_quant_fp8_rowwise(w.to(BF16)).float(), wb.abs().amax(-1, keepdim=True) / 448 * 2.0 ** -9
    assert ((fq - wb).abs() <= 2.0 ** -4 * wb.abs() + tiny + 2 * U * wb.abs()).all()
    # the one departure from torchao: an all-zero row is zeros, not 0/0 = NaN
    z = torch.zeros(2, 32, dtype=dtype)
    z[1] = 1
    assert torch.isnan(to_act(z, wt).dequantize()[0]).all()
    assert torch.equal(fake_quant_fp8_rowwise(z), z)


def test_fp8_rowwise_qat_linear_within_rounding_of_the_scaled_mm_it_converts_to(torchao_fp8):
    """The converted linear (torch._scaled_mm on the codes, scales applied to float32 sums; CPU has the op
    too) and the QAT linear (bf16 dequantized operands, bf16 matmul) both lie within their roundings of the
    exact product of the same codes and scales."""
    to_weight, to_act = torchao_fp8
    w = (torch.randn(48, 256) * torch.rand(48, 1)).to(BF16)
    x = (torch.randn(3, 5, 256) * 2).to(BF16)
    wt = to_weight(w)
    xt = to_act(x, wt)
    with torch.no_grad():
        converted = F.linear(x, wt).float().reshape(-1, 48)  # Float8Tensor quantizes x itself
        ours = qat_linear(x, w, None, QATConfig("fp8_rowwise")).float().reshape(-1, 48)
    xs = (xt.qdata.double() * xt.scale.double()).reshape(-1, 256)
    ws = wt.qdata.double() * wt.scale.double()
    exact, magnitude = xs @ ws.T, xs.abs() @ ws.abs().T
    assert ((converted - exact).abs() <= U * exact.abs() + 256 * 2.0 ** -23 * magnitude).all()
    assert ((ours - exact).abs() <= U * exact.abs() + (2 * U + 256 * 2.0 ** -23) * magnitude).all()
    assert snr_db(exact, ours) > 35 and snr_db(exact, converted) > 35


@pytest.mark.parametrize("scheme", ["int4_tinygemm", "fp8_rowwise"])
def test_gpu_scheme_qat_linear_compiles_without_graph_break_and_trains(scheme):
    """fullgraph: no graph break (the scheme is a constant to dynamo); straight-through gradients in the input's
    dtype; with fp32 operands the tinygemm scheme multiplies in bf16 and hands back float32, as its kernel."""
    layer = QATLinear.from_linear(nn.Linear(64, 32), QATConfig(scheme, 32))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 64, requires_grad=True)
    y = compiled(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(y, layer(x))


@pytest.mark.parametrize("scheme", ["int4_tinygemm", "int4_weight_only"])
def test_prepared_model_trains_the_plain_model_at_its_fake_quantized_weights(scheme):
    """Issue 26 (QAT ended worse than PTQ on the H200): a whole prepared Llama, the LM head quantized too, under bf16
    autocast as ``eval_qat.py`` trains it. Every parameter after ``prepare_qat`` is the object it was (so the
    optimizer built on the prepared model updates the weights it exports), and one backward gives every parameter
    (norms and embeddings too) the gradient of the plain model whose linears hold the fake-quantized weights: the
    straight-through estimator, unmasked (tinygemm's min-max grid clamps nothing; the symmetric grid clamps only a
    positive absmax, code 7.5 -> 7, and ``_QATLinearFn`` passes its gradient too). After an AdamW step the
    fake-quantized weights have moved."""
    base = tiny_model(hidden_size=64, intermediate_size=128)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    before = {n: p for n, p in base.named_parameters()}
    qat = prepare_qat(base, QATConfig(scheme, 32), include_lm_head=True)
    assert qat.swapped and any(n == "lm_head" for n, _ in base.named_modules() if isinstance(_, QATLinear))
    assert all(p is before[n] for n, p in base.named_parameters()) and len(dict(base.named_parameters())) == len(before)
    layers = {n: m for n, m in base.named_modules() if isinstance(m, QATLinear)}
    plain = AutoModelForCausalLM.from_config(base.config)
    plain.load_state_dict(base.state_dict())
    fq = QATConfig(scheme, 32).spec.fake_quant_weight
    with torch.no_grad():
        for n, m in layers.items():
            plain.get_submodule(n).weight.copy_(fq(m.weight.to(torch.bfloat16), 32).float())
    ids = torch.randint(0, base.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (base, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    theirs = dict(plain.named_parameters())
    for n, p in base.named_parameters():
        torch.testing.assert_close(p.grad, theirs[n].grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    q0 = {n: fq(m.weight.detach().to(torch.bfloat16), 32) for n, m in layers.items()}
    torch.optim.AdamW(base.parameters(), lr=1e-3).step()
    for n, m in layers.items():
        assert not torch.equal(fq(m.weight.detach().to(torch.bfloat16), 32), q0[n]), n


def test_gpu_scheme_shape_and_group_rules():
    with pytest.raises(ValueError, match="group_size=48 with scheme 'int4_tinygemm'.*32, 64, 128, 256"):
        QATConfig("int4_tinygemm", 48)
    with pytest.raises(ValueError, match=r"qat_group_size=512 with qat_scheme='int4_tinygemm'.*choose one"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="int4_tinygemm", qat_group_size=512)
    # per channel (-1): the IntxUnpacked schemes only; tinygemm refuses it in one line naming the argument and the
    # alternatives; fp8_rowwise is per row anyway and takes it
    for make, name in ((lambda: QATConfig("int4_tinygemm", -1), "QATConfig.group_size=-1 .per channel. with scheme "),
                       (lambda: LowBitTrainingArguments(output_dir="x", qat_scheme="int4_tinygemm", qat_group_size=-1),
                        "LowBitTrainingArguments.qat_group_size=-1 .per channel. with qat_scheme=")):
        with pytest.raises(ValueError, match=f"{name}'int4_tinygemm': .*no per-channel int4.*32, 64, 128, 256.*"
                                             "choose one of them, or scheme 8da4w or int4_weight_only") as e:
            make()
        assert "\n" not in str(e.value)
    assert QATConfig("fp8_rowwise", -1).per_channel and QATConfig("fp8_rowwise", 256).granularity == "per channel"
    # FP8 row-wise: no groups, so any group size; features must be multiples of 16 (torchao's convert silently
    # leaves other layers in bf16, so the swap leaves them too, and says so)
    model = tiny_model(intermediate_size=120)
    report = prepare_qat(model, QATConfig("fp8_rowwise", group_size=7))
    skipped = {e.name: e.reason for e in report.skipped}
    assert "multiples of 16" in skipped["model.layers.0.mlp.down_proj"]
    assert "multiples of 16" in skipped["model.layers.0.mlp.up_proj"]  # out_features 120
    assert isinstance(model.model.layers[0].self_attn.q_proj, QATLinear) and len(report.swapped) == 8
    with pytest.raises(ValueError, match="(?s)fp8_rowwise.*its kernel needs in and out features that are multiples of 16"):
        LowBitTrainer(tiny_model(hidden_size=72, num_attention_heads=4, num_key_value_heads=2, intermediate_size=120),
                      LowBitTrainingArguments(output_dir="/tmp/unused", qat_scheme="fp8_rowwise", use_cpu=True,
                                              report_to="none"))


@pytest.mark.parametrize("scheme", ["int4_tinygemm", "fp8_rowwise"])
def test_gpu_scheme_configs_survive_config_json(scheme):
    """What save_quantized writes into config.json reads back as the same torchao config (the packing format, the
    qparams algorithm and the row granularity are enums torchao serializes by name)."""
    from transformers import TorchAoConfig

    config = QATConfig(scheme, 64).base_config()
    text = json.dumps(TorchAoConfig(quant_type=config, modules_to_not_convert=["lm_head"]).to_dict())
    back = TorchAoConfig.from_dict(json.loads(text)).quant_type
    assert type(back) is type(config) and back == config


def test_gpu_scheme_convert_without_a_gpu_is_one_line_and_leaves_the_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for scheme in ("int4_tinygemm", "fp8_rowwise"):
        model = tiny_model()
        prepare_qat(model, QATConfig(scheme, 32))
        with pytest.raises(RuntimeError, match=f"qat_scheme='{scheme}' cannot be converted here: .*sm_8") as e:
            convert_qat(model, QATConfig(scheme, 32))
        assert "\n" not in str(e.value)
        assert isinstance(model.model.layers[0].mlp.up_proj, QATLinear)  # nothing was converted


_AUTOTUNE_SETTINGS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions",
                      "force_fuse_int_mm_with_mul")


@pytest.mark.parametrize("scheme", ["int4_tinygemm", "fp8_rowwise"])
def test_gpu_scheme_convert_leaves_inductor_settings_alone(scheme, monkeypatch):
    """Issue 26: torchao's int4 and FP8 transforms turn on coordinate-descent autotuning of every Triton kernel the
    process compiles afterwards (``set_inductor_config=True``, their default); eval_qat.py's PTQ baseline then made
    the QAT fine-tune's compile autotune every kernel (365 s for 300 steps on the H200, bf16 8 s). convert_qat turns
    it off. On the CPU: the GPU gates lifted, tinygemm's CUDA packing replaced by the identity."""
    import torch._inductor.config as inductor_config
    import torchao.quantization.quant_api as quant_api

    import hf_lowbit.qat.linear as qat

    monkeypatch.setattr(qat, "cuda_capability_problem", lambda scheme, device=None: None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setitem(qat.QAT_SCHEMES, "int4_tinygemm",
                        dataclasses.replace(qat.QAT_SCHEMES["int4_tinygemm"], convert_on_cuda=False))
    monkeypatch.setattr(quant_api, "_int4_weight_only_quantize_tensor", lambda weight, config: weight)
    model = tiny_model()
    prepare_qat(model, QATConfig(scheme, 32))
    with inductor_config.patch({k: False for k in _AUTOTUNE_SETTINGS}):  # restored on exit whatever happens
        convert_qat(model, QATConfig(scheme, 32))
        assert {k: getattr(inductor_config, k) for k in _AUTOTUNE_SETTINGS} == {k: False for k in _AUTOTUNE_SETTINGS}
    assert not isinstance(model.model.layers[0].mlp.up_proj, QATLinear)  # it did convert


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                optim="adamw_torch", use_cpu=True, qat_group_size=32)
    base.update(kw)
    return LowBitTrainingArguments(**base)


def test_fp8_refused_at_trainer_construction_below_sm89(monkeypatch, tmp_path):
    """The refusal is about a CUDA device without FP8 tensor cores (capability monkeypatched here); CPU
    training with fake quant is fine (the export test below trains on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cap = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])
    args = _args(tmp_path, qat_scheme="fp8_rowwise")
    monkeypatch.setattr(LowBitTrainingArguments, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError) as e:
        LowBitTrainer(tiny_model(vocab_size=len(ARITH_TOKENIZER)), args, train_dataset=arithmetic_blocks(8))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("LowBitTrainingArguments.qat_scheme='fp8_rowwise': ")
    assert "sm_89+" in msg and "sm_80" in msg and "qat_scheme='int4_tinygemm'" in msg and "'8da4w'" in msg
    cap["value"] = (7, 5)  # no GPU scheme fits a Turing GPU: only the ExecuTorch/CPU ones are offered
    with pytest.raises(ValueError, match=r"sm_75; use '8da4w' / 'int4_weight_only' for ExecuTorch/CPU$"):
        check_qat_device(_args(tmp_path, qat_scheme="int4_tinygemm"), torch.device("cuda", 0), "Args")
    cap["value"] = (9, 0)
    check_qat_device(args, torch.device("cuda", 0), "Args")  # an H100/H200 runs it
    check_qat_device(_args(tmp_path, qat_scheme="8da4w"), torch.device("cuda", 0), "Args")


def test_gpu_scheme_trains_on_cpu_and_says_where_to_export(monkeypatch, tmp_path, capsys):
    """No GPU: LowBitTrainer warns at construction that the export needs one; the CLI trains, saves the plain
    checkpoint and skips the export with the reason, instead of failing after training."""
    from hf_lowbit import LowBitWarning
    from hf_lowbit.cli.sft import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(LowBitWarning, match="qat_scheme='fp8_rowwise' trains here .* save_quantized cannot convert"):
        LowBitTrainer(tiny_model(vocab_size=len(ARITH_TOKENIZER)), _args(tmp_path, qat_scheme="fp8_rowwise"),
                      train_dataset=arithmetic_blocks(8))
    metrics = main(["--output_dir", str(tmp_path / "cli"), "--max_steps", "2", "--eval_strategy", "no",
                    "--qat_scheme", "int4_tinygemm", "--qat_group_size", "32", "--arithmetic_train_records", "300",
                    "--arithmetic_eval_records", "4", "--disable_tqdm", "True"])
    out = capsys.readouterr().out
    assert "[hf_lowbit] int4_tinygemm export skipped: its kernels need an NVIDIA GPU" in out
    assert metrics["quantized_dir"] is None and not (tmp_path / "cli" / "quantized").exists()
    assert (tmp_path / "cli" / "model.safetensors").exists()  # the trained model, exportable where the GPU is


_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
path, ids_file, out_file, device = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(path, device_map=device)
assert "hf_lowbit" not in sys.modules
ids = torch.load(ids_file).to(device)
with torch.no_grad():
    logits = model(ids).logits
out = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
torch.save({"logits": logits.cpu(), "weight_type": type(model.model.layers[0].mlp.up_proj.weight).__name__,
            "generated": out.shape[1]}, out_file)
"""


def _load_in_fresh_process(path, ids, tmp_path, device="cpu"):
    torch.save(ids.cpu(), tmp_path / "ids.pt")
    # without hf_lowbit on the path, but with whatever else PYTHONPATH adds (the device's wheels: torchao)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and not os.path.isdir(os.path.join(p, "hf_lowbit"))]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **({"PYTHONPATH": os.pathsep.join(paths)} if paths else {})}
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
                           device], capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


def test_fp8_rowwise_train_export_load_generate_on_cpu(tmp_path, monkeypatch):
    """LowBitTrainer trains with FP8 fake quant on the CPU; the export is torchao's own convert with its
    sm_89 gate lifted (ours and torchao's); a fresh process with only transformers + torchao loads
    ``Float8Tensor`` weights and computes the converted model's logits exactly (torch's CPU ``_scaled_mm``)."""
    import torchao.quantization.quant_api as quant_api

    import hf_lowbit.qat.linear as qat  # where convert_qat looks it up

    trainer = LowBitTrainer(tiny_model(vocab_size=len(ARITH_TOKENIZER)), _args(tmp_path / "run", qat_scheme="fp8_rowwise"),
                            train_dataset=arithmetic_blocks(32), processing_class=ARITH_TOKENIZER)
    trainer.train()
    ids = torch.randint(0, len(ARITH_TOKENIZER), (2, 12))
    with torch.no_grad():
        fake = trainer.model(ids).logits
    monkeypatch.setattr(qat, "cuda_capability_problem", lambda scheme, device=None: None)
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    files = trainer.save_quantized(str(tmp_path / "q"))
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(files)
    model = trainer.model
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Float8Tensor"
    assert type(model.lm_head.weight).__name__ == "Parameter"
    with torch.no_grad():
        converted = model(ids).logits
    assert snr_db(converted, fake) > 25  # bf16-rounded dequantized operands vs scales on float32 sums
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_type"]["default"]["_type"] == "Float8DynamicActivationFloat8WeightConfig"
    card = (tmp_path / "q" / "README.md").read_text()
    assert "fp8_rowwise" in card and "sm_89+" in card and "one scale per weight row" in card
    assert "## Serving" in card and "use_fp8_kernels(model)" in card
    assert 'from_pretrained("q", device_map="cuda")' in card
    got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path)
    assert got["weight_type"] == "Float8Tensor" and got["generated"] == 9
    assert torch.equal(got["logits"], converted)


def test_model_card_serving_figures_are_the_records():
    """The Serving section each GPU scheme's model card carries quotes the H200 records under docs/results (the
    ratios as the serving benchmark computes them, to two decimals); the ExecuTorch schemes carry none."""
    from hf_lowbit.qat import get_scheme

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def phase(file, checkpoint, mode):
        with open(os.path.join(root, "docs", "results", file)) as f:
            row = next(r for r in json.load(f)["rows"] if r["checkpoint"] == checkpoint)
        return row, row[mode]

    # batch 1, prefill and size from the run with torchao's PTQ peer beside ours (25083fc), batch 8 and the
    # earlier batch-1 figure from 88b0f63's
    row, p = phase("serve_int4k_l32_defer_ptq_h200.json", "qat_int4_tinygemm", "compiled_int4k_mma")
    _, peer = phase("serve_int4k_l32_defer_ptq_h200.json", "ptq_int4_tinygemm", "compiled_lean")
    _, before = phase("serve_int4k_l32_defer_h200.json", "qat_int4_tinygemm", "compiled_int4k_mma")
    int4 = get_scheme("int4_tinygemm").serving
    for value, context in ((p["decode_vs_bf16_b1_deferred"], "batch 1 **{}x**"),
                           (before["decode_vs_bf16_b1_deferred"], "({}x in an earlier run"),
                           (peer["decode_vs_bf16_b1_deferred"], "tinygemm path {}x in the same run"),
                           (before["decode_vs_bf16_b8_deferred"], "{}x at batch 8"),
                           (p["prefill_vs_bf16"], "tokens {}x"), (row["size_vs_bf16"], "{}x its size")):
        assert context.format(f"{value:.2f}") in " ".join(int4.split()), (value, context)
    # FP8: two runs (226593a's; 06f72c1's with torchao's FP8 PTQ on its own path beside ours), the lower figure first
    row, p = phase("serve_fp8k_l32_h200.json", "qat_fp8_rowwise", "compiled_fp8k_stacked")
    _, again = phase("serve_fp8k_l32_defer_ptq_h200.json", "qat_fp8_rowwise", "compiled_fp8k_stacked")
    _, peer = phase("serve_fp8k_l32_defer_ptq_h200.json", "ptq_fp8_rowwise", "compiled_lean")
    fp8 = " ".join(get_scheme("fp8_rowwise").serving.split())
    for context, *values in (("batch 1 **{}-{}x**", again["decode_vs_bf16_b1"], p["decode_vs_bf16_b1"]),
                             ("tokens {}-{}x", again["prefill_vs_bf16"], p["prefill_vs_bf16"]),
                             ("own path: {}x and {}x in the same run", peer["decode_vs_bf16_b1"], peer["prefill_vs_bf16"]),
                             ("{}x its size", row["size_vs_bf16"])):
        assert context.format(*(f"{v:.2f}" for v in values)) in fp8, (values, context)
    assert 'decode="triton_mma"' in int4 and "{name}" in int4
    assert get_scheme("8da4w").serving == get_scheme("int4_weight_only").serving == ""


# ---------------------------------------------------------------------------------------------- on the GPU
def _bf16_model(device="cpu", seed=0):
    """A tiny bf16 Llama (features multiples of 16 and of the group size 32), built in bf16: ``.to(bfloat16)`` would
    also round RoPE's float32 ``inv_freq`` buffer, which a loaded checkpoint recomputes, and the logits compared
    across the export would differ for that alone."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(ARITH_TOKENIZER)), dtype=BF16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    return model.to(device)


@pytest.mark.cuda
def test_int4_tinygemm_convert_export_load_generate_cuda(tmp_path):
    """torchao's tile-packed int4 convert stores exactly the fake-quantized weights (read back through the
    kernel with an identity input); the export loads with plain from_pretrained(device_map='cuda')."""
    from hf_lowbit import save_quantized

    model = _bf16_model("cuda")
    config = QATConfig("int4_tinygemm", 32)
    prepare_qat(model, config)
    fake_w = fake_quant_int4_tinygemm(model.model.layers[0].mlp.up_proj.weight.detach(), 32)
    ids = torch.randint(0, len(ARITH_TOKENIZER), (2, 12), device="cuda")
    with torch.no_grad():
        fake = model(ids).logits
    save_quantized(model, str(tmp_path / "q"), config, tokenizer=ARITH_TOKENIZER)
    layer = model.model.layers[0].mlp.up_proj
    assert type(layer.weight).__name__ == "Int4TilePackedTo4dTensor"
    with torch.no_grad():
        eye = torch.eye(layer.in_features, device="cuda", dtype=BF16)
        assert torch.equal(layer(eye).T, fake_w)
        converted = model(ids).logits
    assert snr_db(fake.float(), converted.float()) > 30  # same weights; summation order only
    got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path, device="cuda")
    assert got["weight_type"] == "Int4TilePackedTo4dTensor" and got["generated"] == 9
    assert torch.equal(got["logits"], converted.cpu())


@pytest.mark.cuda
def test_fp8_rowwise_convert_export_load_generate_cuda(tmp_path):
    from hf_lowbit import save_quantized

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    model = _bf16_model("cuda")
    config = QATConfig("fp8_rowwise")
    prepare_qat(model, config)
    fake_w = fake_quant_fp8_rowwise(model.model.layers[0].mlp.up_proj.weight.detach())
    ids = torch.randint(0, len(ARITH_TOKENIZER), (2, 12), device="cuda")
    with torch.no_grad():
        fake = model(ids).logits
    save_quantized(model, str(tmp_path / "q"), config, tokenizer=ARITH_TOKENIZER)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert type(weight).__name__ == "Float8Tensor" and torch.equal(weight.dequantize(), fake_w)
    with torch.no_grad():
        converted = model(ids).logits
    assert snr_db(fake.float(), converted.float()) > 25  # 31.6 dB for this model on the CPU (gates lifted)
    got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path, device="cuda")
    assert got["weight_type"] == "Float8Tensor" and got["generated"] == 9
    assert torch.equal(got["logits"], converted.cpu())


@pytest.mark.cuda
def test_int4_tinygemm_converts_a_cpu_copy_on_the_gpu_cuda():
    """The distributed export converts an unsharded CPU copy: tinygemm packs on the GPU, the layer goes back."""
    model = _bf16_model()
    config = QATConfig("int4_tinygemm", 32)
    prepare_qat(model, config)
    fake_w = fake_quant_int4_tinygemm(model.model.layers[0].mlp.up_proj.weight.detach(), 32)
    convert_qat(model, config)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.weight.device.type == "cpu" and type(layer.weight).__name__ == "Int4TilePackedTo4dTensor"
    layer.to("cuda")
    with torch.no_grad():
        assert torch.equal(layer(torch.eye(layer.in_features, device="cuda", dtype=BF16)).T, fake_w.cuda())
