"""QLoRA: NF4/INT8 frozen bases, memory-lean NF4, PEFT LoraLinear, INT8 compute on the base."""

import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import lowbit_args, saved_bytes, snr_db, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from safetensors.torch import load_file, save_file
from torch import nn

from hf_lowbit import (Int8Linear, LinearFilter, LoraLinear, LowBitTrainer, MixedPrecisionConfig,
                       Nf4Linear, QuantizedBaseConfig, load_quantized_model, prepare_model, quantize_base)
from hf_lowbit.kernels.nf4 import dequantize_nf4, quantize_nf4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INT8 = MixedPrecisionConfig("int8", grad_weight=False)


# ---- NF4 format ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype", [((256, 512), torch.bfloat16), ((128, 256), torch.float32)])
def test_nf4_agrees_with_torchao(shape, dtype):
    from torchao.quantization import to_nf4

    w = torch.randn(shape, dtype=dtype) * 0.02
    w[5] *= 40  # outlier rows: blocks with very different scales
    ours, ref = quantize_nf4(w, chunk_numel=4096), to_nf4(w)  # small chunks: the chunk loop runs many times
    assert torch.equal(ours.codes.view(-1), ref.quantized_data)
    assert torch.equal(ours.scales.view(-1), ref.quantized_scalers)
    assert torch.equal(ours.scale_factor, ref.quantization_factor)
    assert torch.equal(ours.scale_mean, ref.scaler_mean.reshape(1))
    assert torch.equal(dequantize_nf4(ours), ref.get_original_weight())


def test_nf4_round_trip_error_and_zero_blocks():
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    w[3, 64:128] = 0  # an all-zero block: code 7 (exactly 0); torchao would divide 0/0 here
    data = quantize_nf4(w)
    back = dequantize_nf4(data)
    assert back.dtype == torch.bfloat16 and back.shape == w.shape
    assert torch.equal(back[3, 64:128], torch.zeros(64, dtype=torch.bfloat16))
    assert (data.codes[3, 32:64] == 0x77).all()
    assert 18 < snr_db(w.float(), back.float()) < 25  # 4-bit NormalFloat on Gaussian weights: ~20 dB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_thresholds_reproduce_torchao_nearest_search_exhaustively(dtype):
    from hf_lowbit.kernels.nf4 import _nearest_reference, nf4_levels, nf4_thresholds

    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every) & (every.abs() <= 1)]  # all values x / absmax can take
    expected = _nearest_reference(every, nf4_levels(dtype, "cpu"))
    assert torch.equal(torch.bucketize(every, nf4_thresholds(dtype), right=True), expected)


@pytest.mark.parametrize("bad,match", [(torch.randn(64), "2-D"), (torch.randn(4, 96), "multiple of the NF4 block"),
                                       (torch.randint(0, 9, (4, 64)), "floating-point")])
def test_nf4_bad_inputs(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_nf4(bad)
    with pytest.raises(ValueError, match="multiple of the NF4 block"):
        Nf4Linear(96, 8)


_RSS_SCRIPT = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("nf4", sys.argv[1])  # the module alone: no transformers import
nf4 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nf4)

def status(key):  # kB, from /proc/self/status
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))

w = torch.empty(8192, 4096, dtype=torch.bfloat16)
for r in range(0, 8192, 256):  # filled a slice at a time: no large temporary
    w[r:r + 256].normal_()
nf4.nf4_thresholds(w.dtype)
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
out = nf4.quantize_nf4(w, chunk_numel=1 << 18)
print((status("VmHWM") - before) * 1024 / (w.numel() * 2))
"""


def test_nf4_quantizer_peak_memory_on_cpu():
    """Regression test of the memory-lean quantizer: peak RSS growth beyond the bf16 input, in units of the
    input, in a fresh process: 0.25x packed output + scales + one chunk (0.5x measured; torchao's to_nf4 2.2x)."""
    proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, os.path.join(ROOT, "hf_lowbit", "kernels", "nf4.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    extra = float(proc.stdout.strip().splitlines()[-1])
    assert 0.25 <= extra < 0.6, f"quantize_nf4 used {extra:.2f}x the input beyond it"


# ---- frozen quantized bases ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", [Nf4Linear, Int8Linear])
def test_quantized_linear_forward_state_dict_and_to(cls, tmp_path):
    lin = nn.Linear(128, 64, bias=True).bfloat16()
    q = cls.from_linear(lin)
    assert not any(p.requires_grad for p in q.parameters())
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    assert torch.equal(q(x), (x.reshape(-1, 128) @ q.dequantize().T + q.bias).reshape(3, 5, 64))
    assert snr_db(lin.weight.float(), q.dequantize().float()) > (18 if cls is Nf4Linear else 38)
    path = str(tmp_path / "q.safetensors")
    save_file(q.state_dict(), path)
    fresh = cls(128, 64, bias=True, device="meta")
    fresh.load_state_dict(load_file(path), assign=True)
    assert torch.equal(fresh(x), q(x))
    assert fresh.to("cpu").qweight.device.type == "cpu"


def test_nf4_int8_compute_matches_reference_and_cache():
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False).bfloat16()
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    outs = {}
    for name, (fmt, cache) in {"nf4": ("nf4", False), "nf4_cache": ("nf4", True), "int8": ("int8", False)}.items():
        q = QuantizedBaseConfig(fmt, compute=INT8, int8_cache=cache).make(lin)
        ref = F.linear(x.float(), q.dequantize(torch.float32))
        outs[name] = q(x)
        assert snr_db(ref, outs[name].float()) > 30
    assert torch.equal(outs["nf4"], outs["nf4_cache"])  # the cache holds exactly what is computed per call


def test_lora_grads_through_int8_compute_match_bf16_compute():
    """Same NF4 base; INT8 compute vs compute-dtype: LoRA parameter and input gradients (SNR)."""
    grads = {}
    for compute in (None, INT8):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).bfloat16()
        quantize_base(m, QuantizedBaseConfig("nf4", compute=compute), LinearFilter(exclude=()))
        pm = get_peft_model(m, LoraConfig(r=8, target_modules=["0", "2"], init_lora_weights="gaussian"))
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                nn.init.normal_(p, std=0.02)
        x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
        pm(x).float().square().mean().backward()
        grads[compute] = {n: p.grad.float() for n, p in pm.named_parameters() if p.requires_grad} | {"x": x.grad.float()}
    assert len(grads[None]) == 5
    for name, ref in grads[None].items():
        assert snr_db(ref, grads[INT8][name]) > 20, name


def test_no_graph_break_under_compile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    quantize_base(m, QuantizedBaseConfig("nf4", compute=INT8), LinearFilter(exclude=()))
    pm = get_peft_model(m, LoraConfig(r=4, target_modules=["0"]))
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(pm, fullgraph=True)(x).float().sum().backward()
    assert x.grad is not None and not counters["graph_break"]


@pytest.mark.parametrize("quant,cache", [("nf4", True), ("int8", False)])
def test_compiled_decoder_layers_trace_whole_with_frozen_inputs(tmp_path, quant, cache):
    """Each decoder layer compiles to one graph (the first layer, whose input needs no grad, to a second).
    Regression: with exactly two stored tensors (INT8 base, NF4 INT8 cache) Dynamo bound the base's
    autograd.Function arguments one off when no input needed grad, skipped the whole layer frame and ran
    it eagerly in ~10 small graphs (0 graph breaks counted)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    args = _args(tmp_path, lora_base_quant=quant, lora_base_int8_cache=cache)
    pm = prepare_model(tiny_model().bfloat16(), args, LoraConfig(r=4, target_modules="all-linear"))
    for layer in pm.base_model.model.model.layers:
        layer.compile(backend="eager", fullgraph=True)  # a Dynamo matter
    ids = torch.randint(0, 96, (2, 16))
    pm(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


@pytest.mark.parametrize("quant,compute", [("nf4", None), ("nf4", INT8), ("int8", INT8)])
def test_compiled_qlora_layer_saves_no_more_than_bf16_lora(quant, compute):
    """Saved for backward by a compiled LoRA layer: over a quantized base, x once in bf16, the rank-r activation
    and bf16 copies of the adapters; no float32 copy of x (PEFT's float32 adapters, 2x the bytes), no dequantized
    or INT8 weight; less than PEFT's LoRA over a bf16 nn.Linear."""
    m_tokens, k, n, r = 384, 256, 512, 8
    x = torch.randn(m_tokens, k, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    for name in ("bf16", "ours"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(k, n, bias=False)).bfloat16()
        if name == "ours":
            quantize_base(m, QuantizedBaseConfig(quant, compute=compute), LinearFilter(exclude=()))
        pm = get_peft_model(m, LoraConfig(r=r, target_modules=["0"]))
        # Inductor's partitioner decides what is saved; eager kernels keep the test fast
        f = torch.compile(pm, backend="aot_eager_decomp_partition", fullgraph=True)
        f(x).float().sum().backward()
        out, saved[name] = saved_bytes(lambda: f(x), free=pm.parameters())
        out.float().sum().backward()
    assert saved["ours"] < saved["bf16"]
    assert saved["ours"] <= x.numel() * 2 + (m_tokens + k + n) * r * 2 + 4096, saved  # + small scales


def test_lora_linear_forward_vs_peft(monkeypatch):
    """Under autocast LoraLinear's unfused forward is PEFT's bit for bit; without it the branch computes in the
    input's dtype (bf16) where PEFT casts x to its float32 adapters: the same up to bf16 rounding."""
    monkeypatch.setattr(LoraLinear, "fuse_into_base", False)
    m = nn.Sequential(nn.Linear(128, 64)).bfloat16()
    quantize_base(m, QuantizedBaseConfig("int8", compute=INT8), LinearFilter(exclude=()))
    pm = get_peft_model(m, LoraConfig(r=4, target_modules=["0"], init_lora_weights="gaussian"))
    layer = pm.base_model.model[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32  # PEFT's autocast_adapter_dtype
    nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16)
    for autocast in (True, False):
        results = []
        for forward in (layer.forward, lambda x: PeftLoraLinear.forward(layer, x)):
            xi = x.clone().requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = forward(xi)
            y.float().square().sum().backward()
            results.append([y, xi.grad] + [p.grad.clone() for p in layer.parameters() if p.requires_grad])
            layer.zero_grad()
        assert [r.dtype for r in results[0]] == [r.dtype for r in results[1]]
        for ours, peft in zip(*results):
            assert torch.equal(ours, peft) if autocast else snr_db(peft.float(), ours.float()) > 40


@pytest.mark.parametrize("quant,dropout,bias", [("nf4", 0.0, False), ("int8", 0.0, True), ("nf4", 0.1, False)])
def test_lora_fused_into_int8_base_matches_unfused(monkeypatch, quant, dropout, bias):
    """One adapter over an INT8-compute base: the up-projection added in the base matmul's epilogue (and dH·A in
    the input gradient's, without dropout) against the unfused layer. The fused form rounds the sum once where
    the unfused rounds the base output, the LoRA output and their sum, so outputs agree to bf16 rounding: 99% of
    elements within one bf16 spacing of each other's magnitude and high SNR; gradients (x, A, B, bias) the same
    matmuls in another order (SNR > 40 dB). Dropout: the same mask on both sides (one seed). The bias is frozen
    with its base and added in the compute dtype on both sides."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 192, bias=bias)).bfloat16()
    quantize_base(m, QuantizedBaseConfig(quant, compute=INT8), LinearFilter(exclude=()))
    pm = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["0"],
                                      init_lora_weights="gaussian"))
    layer = pm.base_model.model[0]
    nn.init.normal_(layer.lora_B["default"].weight, std=0.05)
    x = torch.randn(3, 40, 128, dtype=torch.bfloat16)
    results, calls = {}, []
    monkeypatch.setattr(type(layer.base_layer), "forward_with_lora", lambda self, *a: _record(calls, self, *a))
    for fused in (False, True):
        monkeypatch.setattr(LoraLinear, "fuse_into_base", fused)
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(xi)
        y.float().square().sum().backward()
        results[fused] = [y, xi.grad] + [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        layer.zero_grad()
    assert calls == [dropout == 0.0], calls  # the fused path ran once (no dropout: xd is None)
    (y0, *g0), (y1, *g1) = results[False], results[True]
    assert y1.dtype == y0.dtype and y1.shape == y0.shape
    close = (y1.float() - y0.float()).abs() <= torch.finfo(torch.bfloat16).eps * y0.float().abs() * 2 + 1e-3
    assert close.float().mean() > 0.99 and snr_db(y0.float(), y1.float()) > 40
    assert len(g0) == len(g1) == 3  # x, A, B (the base and its bias are frozen)
    for a, b in zip(g0, g1):
        assert a.dtype == b.dtype and snr_db(a.float(), b.float()) > 40


@pytest.mark.parametrize("case", ["two_adapters", "disabled", "bf16_forward", "backward_hook", "rank_128",
                                  "lora_bias_adapter"])
def test_lora_stays_unfused_where_the_fusion_does_not_apply(monkeypatch, case):
    """The fused path is not taken (and the layer still computes PEFT's result) with several active adapters,
    disabled adapters, a base without an INT8 forward, a backward hook on the base (the fused path never calls
    the base module), a rank above FUSED_LORA_MAX_RANK, and an adapter added later with lora_bias (which
    ``add_adapter`` lets past ``__init__``'s refusal: PEFT's forward adds its bias)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(128, 96)).bfloat16()
    compute = MixedPrecisionConfig("int8", output=False, grad_weight=False) if case == "bf16_forward" else INT8
    quantize_base(m, QuantizedBaseConfig("int8", compute=compute), LinearFilter(exclude=()))
    pm = get_peft_model(m, LoraConfig(r=128 if case == "rank_128" else 8, target_modules=["0"],
                                      init_lora_weights="gaussian"))
    layer = pm.base_model.model[0]
    if case == "two_adapters":
        pm.add_adapter("second", LoraConfig(r=4, target_modules=["0"], init_lora_weights="gaussian"))
        pm.base_model.set_adapter(["default", "second"])
    if case == "lora_bias_adapter":
        pm.add_adapter("biased", LoraConfig(r=4, target_modules=["0"], lora_bias=True, init_lora_weights=False))
        pm.set_adapter("biased")
        nn.init.normal_(layer.lora_B["biased"].bias, std=1.0)
    fired = []
    if case == "backward_hook":
        layer.base_layer.register_full_backward_hook(lambda *a: fired.append(1))
    calls = []
    monkeypatch.setattr(type(layer.base_layer), "forward_with_lora", lambda self, *a: _record(calls, self, *a))
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        if case == "disabled":
            with pm.disable_adapter():
                y = pm(x)
        else:
            y = pm(x)
    y.float().sum().backward()
    assert calls == [], case
    if case == "backward_hook":
        assert fired == [1]
    if case == "lora_bias_adapter":  # the bias reaches the output: PEFT's forward, not ours without it
        with torch.autocast("cpu", torch.bfloat16):
            ref = PeftLoraLinear.forward(layer, x)
        assert torch.equal(y, ref)


def _record(calls, self, x, xd, *rest):
    from hf_lowbit.qlora.base import QuantizedBaseLinear

    calls.append(xd is None)
    return QuantizedBaseLinear.forward_with_lora(self, x, xd, *rest)


# ---- PEFT ---------------------------------------------------------------------------------------

_args = partial(lowbit_args, lowbit_min_features=16, lora_base_quant="nf4", int8_mixed_precision=True)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_peft_round_trip_merge_and_multiple_adapters(tmp_path, quant):
    args = _args(tmp_path, lora_base_quant=quant)
    pm = prepare_model(tiny_model().bfloat16(), args, LoraConfig(r=4, target_modules="all-linear"))
    layer = pm.base_model.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, LoraLinear) and isinstance(layer.base_layer, (Nf4Linear, Int8Linear))
    assert all(isinstance(m, LoraLinear) for n, m in pm.named_modules() if n.endswith("_proj"))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 96, (2, 16))
    for _ in range(3):
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    pm.eval()
    with torch.no_grad():
        ref = pm(input_ids=ids).logits
    pm.save_pretrained(str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]

    # a freshly quantized model, plain PEFT calls
    fresh = tiny_model().bfloat16()
    quantize_base(fresh, QuantizedBaseConfig(quant, compute=INT8), LinearFilter(min_features=16))
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    # a second adapter, switched to and back
    loaded.load_adapter(str(tmp_path / "adapter"), adapter_name="second")
    loaded.add_adapter("zero", LoraConfig(r=2, target_modules=["q_proj"]))
    loaded.set_adapter("zero")
    with torch.no_grad():
        with loaded.disable_adapter():
            no_lora = loaded(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, no_lora)  # B starts at zero
        loaded.set_adapter("second")
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    loaded.delete_adapter("zero")

    # merge_and_unload: plain bf16 linears holding dequantize(W) + ΔW
    layer = loaded.base_model.model.model.layers[0].mlp.down_proj
    expected = (layer.base_layer.dequantize().float() + layer.get_delta_weight("second").float()).bfloat16()
    loaded.set_adapter("second")
    merged = loaded.merge_and_unload(adapter_names=["second"])
    down = merged.model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and down.weight.dtype == torch.bfloat16
    assert torch.equal(down.weight, expected)
    with torch.no_grad():
        assert snr_db(ref.float(), merged(input_ids=ids).logits.float()) > 25  # bf16 merged vs INT8 compute


def test_lora_linear_refuses_what_needs_the_base_weight():
    m = nn.Sequential(nn.Linear(128, 128)).bfloat16()
    quantize_base(m, QuantizedBaseConfig("nf4"), LinearFilter(exclude=()))
    with pytest.raises(ValueError, match="DoRA|variant"):
        get_peft_model(m, LoraConfig(r=4, target_modules=["0"], use_dora=True))
    with pytest.raises(ValueError, match="init_lora_weights"):
        get_peft_model(m, LoraConfig(r=4, target_modules=["0"], init_lora_weights="pissa"))


def test_swap_report_skips_what_nf4_cannot_store(tmp_path):
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 96), nn.Linear(96, 64), nn.Conv1d(4, 4, 3))
    report = quantize_base(m, QuantizedBaseConfig("nf4"), LinearFilter(exclude=()))
    swapped = {e.name for e in report.swapped}
    assert swapped == {"0", "1"} and isinstance(m[0], Nf4Linear) and type(m[2]) is nn.Linear
    assert "in_features 96 is not a multiple of 64" in {e.name: e.reason for e in report.skipped}["2"]
    assert quantize_base(m, QuantizedBaseConfig("nf4"), LinearFilter(exclude=())).swapped == []  # twice: harmless


def test_lora_base_quant_needs_peft_config_and_valid_args(tmp_path):
    with pytest.raises(ValueError, match="peft_config"):
        prepare_model(tiny_model(), _args(tmp_path))
    with pytest.raises(ValueError, match="lora_base_quant"):
        _args(tmp_path, lora_base_quant="nf3")
    with pytest.raises(ValueError, match="lora_base_quant"):
        _args(tmp_path, int8_mixed_precision=False, fp8_mixed_precision=True)
    with pytest.raises(ValueError, match="lora_base_int8_cache"):
        _args(tmp_path, lora_base_quant="int8", lora_base_int8_cache=True)


def test_quantize_on_load_matches_in_memory_quantization(tmp_path):
    model = tiny_model().bfloat16()
    model.save_pretrained(str(tmp_path / "ckpt"), max_shard_size="100KB")  # several shards + index
    assert os.path.exists(tmp_path / "ckpt" / "model.safetensors.index.json")
    from transformers import AutoModelForCausalLM

    config = QuantizedBaseConfig("nf4", compute=INT8)
    loaded, report = load_quantized_model(AutoModelForCausalLM, str(tmp_path / "ckpt"), config,
                                          filter=LinearFilter(min_features=16))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.bfloat16)  # fp32 rotary buffers
    quantize_base(model, config, LinearFilter(min_features=16))
    assert len(report.swapped) == 14 and not any(p.is_meta for p in loaded.parameters())
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_trainer_qlora_end_to_end(tmp_path):
    args = _args(tmp_path, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                 save_strategy="no", disable_tqdm=True, optim="adamw_torch", lora_base_int8_cache=True)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (16, 32))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    trainer = LowBitTrainer(tiny_model().bfloat16(), args=args, train_dataset=ds,
                            peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert [r.recipe for r in trainer.lowbit_reports] == ["lora_base_quant", "int8_mixed_precision"]
    base = trainer.model.base_model.model.model.layers[1].self_attn.o_proj.base_layer
    assert isinstance(base, Nf4Linear) and base._cache_q is not None
    before = base.qweight.clone()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert torch.equal(base.qweight, before)  # the base stays frozen


# ---- CUDA (run on the device) --------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_nf4_codes_and_compiled_qlora_layer(monkeypatch):
    """NF4 codes against torchao's; the compiled LoRA layer over each base: INT8 compute (the up-projection in the
    INT8 matmul's epilogue) against bf16 compute (SNR > 20 dB), and fused against unfused (SNR > 40 dB)."""
    from torchao.quantization import to_nf4

    w = torch.randn(1024, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    ours, ref = quantize_nf4(w), to_nf4(w)
    assert torch.equal(ours.scales.view(-1), ref.quantized_scalers)
    assert (ours.codes.view(-1) == ref.quantized_data).float().mean() > 0.9999  # CUDA argmin ties may differ
    assert snr_db(w.float(), dequantize_nf4(ours).float()) > 18
    grads = {}
    for fmt in ("nf4", "int8"):
        for compute in (None, INT8, "unfused"):
            monkeypatch.setattr(LoraLinear, "fuse_into_base", compute != "unfused")
            torch._dynamo.reset()
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4096, 1024, bias=False)).to("cuda", torch.bfloat16)
            quantize_base(m, QuantizedBaseConfig(fmt, compute=INT8 if compute == "unfused" else compute),
                          LinearFilter(exclude=()))
            pm = get_peft_model(m, LoraConfig(r=16, target_modules=["0"], init_lora_weights="gaussian"))
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    nn.init.normal_(p, std=0.02)
            x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            torch.compile(pm, fullgraph=True)(x).float().square().mean().backward()
            grads[fmt, compute] = [p.grad.float() for p in pm.parameters() if p.requires_grad] + [x.grad.float()]
        for ref_g, g in zip(grads[fmt, None], grads[fmt, INT8]):
            assert snr_db(ref_g, g) > 20
        for unfused, fused in zip(grads[fmt, "unfused"], grads[fmt, INT8]):
            assert snr_db(unfused, fused) > 40
