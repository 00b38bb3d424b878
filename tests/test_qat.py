"""QAT: fake quant against torchao's quantization, the delay (also across resume), convert -> export -> load."""

import argparse
import json
import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import ARITH_TOKENIZER, arithmetic_blocks, lowbit_args, saved_bytes, snr_db, tiny_model
from peft import LoraConfig
from torch import nn
from transformers import TrainerCallback

from hf_lowbit import LowBitTrainer, LowBitTrainingArguments
from hf_lowbit.kernels.fake_quant import fake_quant_per_group_sym, fake_quant_per_token_asym
from hf_lowbit.qat import (PER_CHANNEL, QATConfig, QATLinear, convert_qat, prepare_qat, qat_linear,
                           set_fake_quant_enabled)

TOKENIZER = ARITH_TOKENIZER
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n_blocks=32):
    return arithmetic_blocks(n_blocks)


_args = partial(lowbit_args, max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1,
                save_strategy="no", seed=0, disable_tqdm=True, optim="adamw_torch", qat_scheme="8da4w", qat_group_size=32)


def _model(**kw):
    return tiny_model(vocab_size=len(TOKENIZER), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_equals_torchao_convert(dtype):
    """The fake-quantized weight is what torchao's convert stores; the QAT linear computes what the converted one does."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    w = torch.randn(48, 128, dtype=dtype)
    x = torch.randn(3, 5, 128, dtype=dtype) * 2 + 0.3
    layer = nn.Sequential(nn.Linear(128, 48, bias=False, dtype=dtype))
    layer[0].weight.data.copy_(w)
    quantize_(layer, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    assert type(layer[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert torch.equal(fake_quant_per_group_sym(w, 32), layer[0].weight.dequantize())
    with torch.no_grad():
        ours = qat_linear(x, w, None, QATConfig("8da4w", 32))
        assert torch.equal(ours, layer(x))
    assert snr_db(F.linear(x, w), ours) > 15  # and it is a quantization of the plain product


@pytest.mark.parametrize("scheme", ["8da4w", "int4_weight_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [2816, 1000])
def test_per_channel_fake_quant_equals_torchao_convert(scheme, dtype, in_features):
    """Per channel (group_size=-1): convert_qat stores torchao's PerAxis(0) tensor (one scale per row, block
    (1, in_features)), and the fake-quantized weight (one group of in_features per row) is it dequantized, bit for
    bit; the QAT linear computes what the converted one does. Odd in_features that no usual group divides."""
    from torchao.quantization import PerAxis

    gen = torch.Generator().manual_seed(in_features)
    w = (torch.randn(48, in_features, generator=gen) * torch.rand(48, 1, generator=gen) * 3).to(dtype)
    w[0] = 0  # an all-zero row: the smallest-normal scale clamp
    w[1, :7] = 50.0  # an outlier row
    x = (torch.randn(3, 5, in_features, generator=gen) * 2 + 0.3).to(dtype)
    config = QATConfig(scheme, PER_CHANNEL)
    granularity = config.base_config().weight_granularity if scheme == "8da4w" else config.base_config().granularity
    assert granularity == PerAxis(0) and config.per_channel and config.granularity == "per channel"
    layer = nn.Sequential(QATLinear.from_linear(nn.Linear(in_features, 48, bias=True, dtype=dtype), config))
    layer[0].weight.data.copy_(w)
    with torch.no_grad():
        fake = layer(x)
        assert torch.equal(fake, qat_linear(x, w, layer[0].bias, config))
        assert convert_qat(layer, config) == ["0"]
        t = layer[0].weight
        assert type(t).__name__ == "IntxUnpackedToInt8Tensor" and tuple(t.block_size) == (1, in_features)
        assert t.scale.shape == (48, 1) and t.scale.dtype == dtype
        assert torch.equal(fake_quant_per_group_sym(w, in_features), t.dequantize())
        assert torch.equal(layer(x), fake)


def test_fake_quant_equals_torchao_fake_quantizers_in_fp32():
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    x = torch.randn(7, 256) * 3 + 1
    w = torch.randn(16, 256)
    act = IntxFakeQuantizer(IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False))
    wq = IntxFakeQuantizer(IntxFakeQuantizeConfig(torch.int4, group_size=64, is_symmetric=True))
    assert torch.equal(fake_quant_per_token_asym(x), act(x))
    assert torch.equal(fake_quant_per_group_sym(w, 64), wq(w))
    # int8 per token: at most half a step from the input; int4 keeps 16 levels per group
    step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    assert ((fake_quant_per_token_asym(x) - x).abs() <= step / 2 + 1e-6).all()
    assert fake_quant_per_group_sym(w, 64).reshape(16, 4, 64).unique(dim=-1).shape[-1] <= 64


def test_qat_linear_gradients_are_straight_through():
    x = torch.randn(2, 6, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    g = torch.randn(2, 6, 32)
    qat_linear(x, w, b, QATConfig("8da4w", 32)).backward(g)
    xq = fake_quant_per_token_asym(x.detach()).requires_grad_()
    wq = fake_quant_per_group_sym(w.detach(), 32).requires_grad_()
    bq = b.detach().clone().requires_grad_()
    F.linear(xq, wq, bq).backward(g)
    torch.testing.assert_close(x.grad, xq.grad)
    torch.testing.assert_close(w.grad, wq.grad)
    torch.testing.assert_close(b.grad, bq.grad)


def test_qat_linear_traces_without_graph_break():
    layer = QATLinear.from_linear(nn.Linear(64, 32), QATConfig("8da4w", 32))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 64, requires_grad=True)
    compiled(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_compiled_qat_linear_keeps_what_a_bf16_linear_keeps_for_backward():
    """Under torch.compile the fake-quantized operands are recomputed in backward, not kept from forward.

    Without the selective checkpoint in ``qat_linear``, CSE merges backward's recomputation with the
    forward's fake quant and the partitioner keeps a bf16 fake-quantized weight and input (2x here).
    ``aot_eager_decomp_partition``: Inductor's decompositions and partitioner, no code generation.
    """
    linear = nn.Linear(256, 64, dtype=torch.bfloat16)
    qat = QATLinear.from_linear(linear, QATConfig("8da4w", 128))
    x = torch.randn(4, 16, 256, dtype=torch.bfloat16, requires_grad=True)
    kept = {}
    for name, layer in (("bf16", linear), ("qat", qat)):
        compiled = torch.compile(lambda t: layer(t * 2), backend="aot_eager_decomp_partition", fullgraph=True)
        out, kept[name] = saved_bytes(lambda: compiled(x), free=(x, *layer.parameters()))
        out.float().sum().backward()
    min_max = 2 * 2 * (4 * 16 + 64 * 256 // 128)  # bf16 min and max per token and per weight group
    assert kept["bf16"] == 4 * 16 * 256 * 2  # the linear's input
    assert kept["qat"] <= kept["bf16"] + min_max, kept


def test_non_divisible_layers_are_skipped_and_reported():
    model = _model(intermediate_size=96)
    report = prepare_qat(model, QATConfig("8da4w", 64))
    skipped = {e.name: e.reason for e in report.skipped}
    assert "in_features 96 is not a multiple of 64" in skipped["model.layers.0.mlp.down_proj"]
    assert isinstance(model.model.layers[0].mlp.up_proj, QATLinear)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert "lm_head" in skipped and "model.embed_tokens" in skipped
    assert len(report.swapped) == 12
    # through the arguments: nothing divisible is an error naming the field, not a silent no-op
    with pytest.raises(ValueError, match="qat_group_size"):
        LowBitTrainer(_model(), _args("/tmp/unused", qat_group_size=48))


def test_per_channel_swaps_layers_no_group_divides():
    """Per channel has no divisibility rule: a down_proj of in_features 97 (prime) swaps too, the LM head with
    include_lm_head, and the report says per channel."""
    model = _model(intermediate_size=97)
    report = prepare_qat(model, QATConfig("int4_weight_only", PER_CHANNEL), include_lm_head=True)
    assert len(report.swapped) == 15 and {e.name for e in report.skipped} == {"model.embed_tokens"}
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, QATLinear) and down.in_features == 97 and "per channel" in repr(down)
    assert "QAT int4_weight_only fake quant (per channel)" in report.summary()
    assert "group" not in report.summary()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="qat_scheme='nf4'.*valid schemes: 8da4w, int4_weight_only"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="nf4")
    with pytest.raises(ValueError, match="qat_group_size"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="8da4w", qat_group_size=1)
    with pytest.raises(ValueError, match=r"qat_group_size must be an integer >= 2, or -1 for per channel, got -2"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="8da4w", qat_group_size=-2)
    with pytest.raises(ValueError, match=r"group_size must be an integer >= 2, or -1 for per channel"):
        QATConfig("8da4w", 0)
    assert LowBitTrainingArguments(output_dir="x", qat_scheme="int4_weight_only", qat_group_size=-1).qat_group_size == -1
    with pytest.raises(ValueError, match="qat_fake_quant_after_n_steps"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="8da4w", qat_fake_quant_after_n_steps=-1)
    with pytest.raises(ValueError, match="int8_mixed_precision"):
        LowBitTrainingArguments(output_dir="x", qat_scheme="8da4w", int8_mixed_precision=True)
    with pytest.raises(ValueError, match="valid schemes"):
        QATConfig("int3")


class _Recorder(TrainerCallback):
    """Which optimizer steps (1-based global_step after the step) ran with fake quant."""

    def __init__(self):
        self.steps = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layer = model.model.layers[0].mlp.up_proj
        self.steps[state.global_step] = layer.fake_quant_enabled


def test_delay_switches_at_step_n_also_across_resume(tmp_path):
    ds = _data()
    kw = dict(max_steps=6, qat_fake_quant_after_n_steps=3, save_strategy="steps", save_steps=2)
    rec = _Recorder()
    trainer = LowBitTrainer(_model(), _args(tmp_path, **kw), train_dataset=ds, callbacks=[rec])
    assert not trainer.model.model.layers[0].mlp.up_proj.fake_quant_enabled  # off until step N
    trainer.train()
    # steps 1..3 (global_step 0..2 at their start) without, 4..6 with fake quant
    assert rec.steps == {1: False, 2: False, 3: False, 4: True, 5: True, 6: True}
    for ckpt, expected in (("checkpoint-2", {3: False, 4: True, 5: True, 6: True}),
                           ("checkpoint-4", {5: True, 6: True})):
        rec = _Recorder()
        resumed = LowBitTrainer(_model(), _args(tmp_path, **kw), train_dataset=ds, callbacks=[rec])
        resumed.train(resume_from_checkpoint=str(tmp_path / ckpt))
        assert rec.steps == expected, ckpt


def test_set_fake_quant_enabled_for_custom_loops():
    model = _model()
    prepare_qat(model, QATConfig("8da4w", 32), enabled=False)
    ids = torch.randint(0, len(TOKENIZER), (2, 16))
    plain = _model()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
        assert set_fake_quant_enabled(model, True) == 14
        assert not torch.equal(model(ids).logits, plain(ids).logits)


_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids = sys.argv[1], torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(path)
assert "hf_lowbit" not in sys.modules
w = model.model.layers[0].mlp.up_proj.weight
down = model.model.layers[0].mlp.down_proj.weight
with torch.no_grad():
    logits = model(ids).logits
out = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
tok = AutoTokenizer.from_pretrained(path)
torch.save({"logits": logits, "weight_type": type(w).__name__, "generated": out.shape[1], "vocab": len(tok),
            "head_type": type(model.lm_head.weight.data).__name__,
            "down_block": list(getattr(down, "block_size", [])), "head_block": list(getattr(model.lm_head.weight, "block_size", []))},
           sys.argv[3])
"""


def _load_in_fresh_process(path, ids, tmp_path):
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("lora", [False, True])
def test_train_convert_export_load_in_fresh_process(tmp_path, lora):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    trainer = LowBitTrainer(_model(), _args(tmp_path / "run", max_steps=3), train_dataset=_data(),
                            processing_class=TOKENIZER, peft_config=peft_config)
    if lora:  # LoRA over the fake-quantized base
        assert isinstance(trainer.model.base_model.model.model.layers[0].mlp.up_proj.base_layer, QATLinear)
    trainer.train()
    files = trainer.save_quantized(str(tmp_path / "q"))
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(files)
    assert not any(n.startswith(".tmp") for n in os.listdir(tmp_path))  # the temporary dir was renamed
    model = trainer.model
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "torchao"
    assert config["quant_type"]["default"]["_type"] == "Int8DynamicActivationIntxWeightConfig"
    assert "8da4w" in (tmp_path / "q" / "README.md").read_text()
    ids = torch.randint(0, len(TOKENIZER), (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    if lora:  # the fresh process (no hf_lowbit import) once; the plain case loads in this process (faster)
        got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path)
    else:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"))
        with torch.no_grad():
            got = {"logits": loaded(ids).logits, "weight_type": type(loaded.model.layers[0].mlp.up_proj.weight).__name__,
                   "head_type": type(loaded.lm_head.weight.data).__name__, "vocab": len(TOKENIZER),
                   "generated": loaded.generate(ids[:1, :5], max_new_tokens=4, do_sample=False).shape[1]}
    assert got["weight_type"] == "IntxUnpackedToInt8Tensor" and got["head_type"] == "Tensor"
    assert torch.equal(got["logits"], ref)
    assert got["generated"] == 9 and got["vocab"] == len(TOKENIZER)


def test_per_channel_train_export_load_in_fresh_process(tmp_path):
    """qat_group_size=-1: every linear, the LM head and a down_proj of in_features 97 included, trains per channel,
    exports torchao's PerAxis(0) tensors (config.json, model card say so) that plain from_pretrained loads in a process
    without hf_lowbit, computing what the converted model does."""
    trainer = LowBitTrainer(_model(intermediate_size=97),
                            _args(tmp_path / "run", max_steps=2, qat_scheme="int4_weight_only", qat_group_size=-1,
                                  qat_include_lm_head=True),
                            train_dataset=_data(), processing_class=TOKENIZER)
    assert isinstance(trainer.model.model.layers[0].mlp.down_proj, QATLinear)
    trainer.train()
    trainer.save_quantized(str(tmp_path / "q"))
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    quant = config["quant_type"]["default"]
    assert quant["_type"] == "IntxWeightOnlyConfig"
    assert quant["_data"]["granularity"] == {"_type": "PerAxis", "_version": 1, "_data": {"axis": 0}}
    assert config["modules_to_not_convert"] in (None, [])
    card = (tmp_path / "q" / "README.md").read_text()
    assert "int4 per-channel symmetric weights" in card and "per channel: one scale per weight row" in card
    assert "per-group" not in card
    ids = torch.randint(0, len(TOKENIZER), (2, 12))
    with torch.no_grad():
        ref = trainer.model(ids).logits
    got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path)
    assert got["weight_type"] == "IntxUnpackedToInt8Tensor" and got["head_type"] == "IntxUnpackedToInt8Tensor"
    assert got["down_block"] == [1, 97] and got["head_block"] == [1, 64]
    assert torch.equal(got["logits"], ref)


def test_per_channel_configs_survive_config_json():
    from transformers import TorchAoConfig

    for scheme in ("8da4w", "int4_weight_only"):
        config = QATConfig(scheme, PER_CHANNEL).base_config()
        text = json.dumps(TorchAoConfig(quant_type=config, modules_to_not_convert=["lm_head"]).to_dict())
        back = TorchAoConfig.from_dict(json.loads(text)).quant_type
        assert type(back) is type(config) and back == config


def test_push_to_hub_uploads_exactly_the_saved_files(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, repo_id, folder_path, **kw: calls.append(("upload", repo_id, sorted(os.listdir(folder_path)))))
    trainer = LowBitTrainer(_model(), _args(tmp_path / "run", max_steps=1), train_dataset=_data(8),
                            processing_class=TOKENIZER)
    trainer.train()
    files = trainer.save_quantized(str(tmp_path / "q"))
    trainer.model.push_to_hub("me/tiny-8da4w")
    assert calls == [("create", "me/tiny-8da4w"), ("upload", "me/tiny-8da4w", files)]


def test_save_quantized_refuses_foreign_directory_and_leaves_nothing(tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "notes.txt").write_text("mine")
    model = _model()
    prepare_qat(model, QATConfig("8da4w", 32))
    from hf_lowbit import save_quantized

    with pytest.raises(FileExistsError, match="neither empty"):
        save_quantized(model, str(tmp_path / "q"), QATConfig("8da4w", 32))
    assert sorted(os.listdir(tmp_path)) == ["q"] and os.listdir(tmp_path / "q") == ["notes.txt"]


def test_convert_int4_weight_only():
    model = _model()
    prepare_qat(model, QATConfig("int4_weight_only", 32))
    ids = torch.randint(0, len(TOKENIZER), (2, 12))
    with torch.no_grad():
        fake = model(ids).logits
        names = convert_qat(model, QATConfig("int4_weight_only", 32))
        real = model(ids).logits
    assert len(names) == 14
    torch.testing.assert_close(real, fake, rtol=1e-4, atol=1e-4)


def test_sft_cli_qat_writes_quantized_checkpoint(tmp_path, capsys):
    from hf_lowbit.cli.sft import main

    metrics = main(["--output_dir", str(tmp_path), "--max_steps", "3", "--eval_strategy", "no", "--qat_scheme", "8da4w",
                    "--qat_fake_quant_after_n_steps", "1", "--arithmetic_train_records", "300",
                    "--arithmetic_eval_records", "4", "--disable_tqdm", "True"])
    out = capsys.readouterr().out
    assert "[hf_lowbit] qat: 14 modules swapped" in out and "int8_mixed_precision" not in out
    files = set(os.listdir(metrics["quantized_dir"]))
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= files


# benchmarks/eval_qat.py's tiny CPU run (a few seconds per seed)
EVAL_QAT_TINY = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4",
                 "--kv_heads", "2", "--seq", "32", "--batch", "4", "--pretrain_steps", "3", "--finetune_steps", "2",
                 "--vocab", "300", "--group_size", "32", "--eval_blocks", "8", "--include_lm_head"]


def _eval_qat_script(monkeypatch, name="eval_qat"):
    """benchmarks/eval_qat.py (or another script ``name`` of benchmarks/) as a module, the corpus cut to pydoc's
    topic pages to stay fast."""
    import importlib.util

    import pydoc_data.topics

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from benchmarks import corpus

    topics = pydoc_data.topics.topics
    monkeypatch.setattr(corpus, "python_docs_corpus",
                        lambda packages=(), max_docs=0: [topics[k] for k in sorted(topics)][:max_docs or None])
    return script


def test_eval_qat_smoke(tmp_path, monkeypatch, capsys):
    """benchmarks/eval_qat.py end to end on a tiny model (the corpus cut to pydoc's topic pages to stay fast)."""
    script = _eval_qat_script(monkeypatch)
    out = tmp_path / "qat.json"
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *EVAL_QAT_TINY, "--repeats", "2", "--json", str(out)])
    partial = []  # what a run cut short would leave: each seed written as it finishes (all but the last)
    monkeypatch.setattr(script, "save_json", lambda path, data: partial.append((path, json.loads(json.dumps(data)))))
    script.main()
    assert [(p, len(d["repeats"]), d["meta"]["partial"]) for p, d in partial] == [(str(out), 1, True)]
    assert partial[0][1]["repeats"][0]["seed"] == 0
    printed = capsys.readouterr().out  # progress lines, seconds since start
    for line in ("corpus:", "seed 0: pre-trained 3 steps", "seed 1: fine-tuned (qat) 2 steps"):
        assert line in printed, line
    data = json.loads(out.read_text())
    ppl = data["perplexity"]
    assert set(ppl) == {"base bf16", "base PTQ", "fine-tuned bf16", "fine-tuned PTQ", "QAT fine-tuned, fake quant",
                        "QAT fine-tuned, converted"}
    assert all(1 < v < 1e4 for v in ppl.values())
    assert data["ptq_loss"] == ppl["fine-tuned PTQ"] - ppl["fine-tuned bf16"]
    runs = data["repeats"]
    assert [r["seed"] for r in runs] == [0, 1] and len(runs[1]["finetune_losses"]["qat"]) == 2
    assert runs[0]["pretrain_losses"] != runs[1]["pretrain_losses"]  # another seed: another init and batch order
    for k in ppl:  # the table's figures are the means over the seeds
        assert ppl[k] == pytest.approx((runs[0]["perplexity"][k] + runs[1]["perplexity"][k]) / 2)
    # held-out loss = log perplexity: PTQ's relative loss increase and QAT's share of it, per seed and their spread
    for r in runs:
        p, loss = r["perplexity"], r["loss"]
        assert loss["ptq_loss_increase"] == pytest.approx(math.log(p["fine-tuned PTQ"]) / math.log(p["fine-tuned bf16"]) - 1)
        lost = math.log(p["fine-tuned PTQ"] / p["fine-tuned bf16"])
        if lost > 0:
            assert loss["recovered_loss"] == pytest.approx(math.log(p["fine-tuned PTQ"] / p["QAT fine-tuned, converted"]) / lost)
        else:  # PTQ lost nothing (a 3-step model): there is nothing to recover
            assert math.isnan(loss["recovered_loss"])
    rec = data["loss"]["ptq_loss_increase"]
    values = [r["loss"]["ptq_loss_increase"] for r in runs]
    assert rec["mean"] == pytest.approx(sum(values) / 2) and rec["min"] == min(values) and rec["max"] == max(values)
    assert rec["std"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2)) and rec["n"] == 2
    assert data["meta"]["config"]["include_lm_head"]


def test_eval_qat_arithmetic_task(tmp_path, monkeypatch):
    """eval_qat.py --task arithmetic: the held-out operand pairs are never trained on, the split is the seed's alone,
    the loss is the answer's (the prompt and the padding masked), exact match is reported beside it; a corpus run's
    JSON records none of the task's flags."""
    script = _eval_qat_script(monkeypatch)
    a = argparse.Namespace(task="arithmetic", digits=2, task_train=300, task_eval=50, seed=0, batch=8, device="cpu")
    tok, train, held_out, record = script.arithmetic_data(a)
    assert train.shape == (300, 10) and held_out.shape == (50, 10)  # 3 * 2 + 4 tokens a row
    prompts = lambda rows: {tok.decode(r).split("=")[0] for r in rows.tolist()}  # noqa: E731
    assert not prompts(train) & prompts(held_out) and len(prompts(held_out)) == 50
    again = script.arithmetic_data(a)
    assert torch.equal(again[1], train) and torch.equal(again[2], held_out)  # deterministic per seed
    other = script.arithmetic_data(argparse.Namespace(**{**vars(a), "seed": 1}))
    assert not torch.equal(other[2], held_out)
    assert record["digits"] == 2 and record["eval_problems"] == 50
    # "12+345=357</s>" right-padded: labels only on "357" and the EOS
    row = script.problem_rows([{"prompt": "12+345=", "completion": "357"}], 3)
    assert row.shape == (1, 13)
    labels = script.targets(a, row)[0].tolist()
    ids = row[0].tolist()
    assert labels[:7] == [-100] * 7 and labels[7:11] == ids[7:11] and labels[11:] == [-100] * 2
    assert tok.decode(ids[7:10]) == "357" and ids[10] == tok.eos_token_id and ids[11:] == [tok.pad_token_id] * 2
    assert script.targets(argparse.Namespace(), row) is row  # the corpus: every token
    # the loss of a model that always predicts the answer: ~0 on the answer, whatever it says on the prompt
    class Oracle(nn.Module):
        def forward(self, input_ids):
            logits = torch.zeros(*input_ids.shape, len(tok))
            logits[:, :-1].scatter_(2, input_ids[:, 1:, None], 50.0)  # the next token, everywhere
            logits[:, :6, 5] = 100.0  # the positions predicting the prompt ("2+345="): wrong, and not counted
            return argparse.Namespace(logits=logits)
    nll, acc = script.answer_eval(Oracle(), row, a)
    assert nll < 1e-6 and acc == 1.0
    # end to end, tiny: accuracy per model, the task's flags in meta.config
    out = tmp_path / "arith.json"
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *EVAL_QAT_TINY, "--task", "arithmetic", "--digits", "2",
                                      "--task_train", "200", "--task_eval", "40", "--json", str(out)])
    script.main()
    data = json.loads(out.read_text())
    assert set(data["accuracy"]) == set(data["perplexity"])
    assert all(0 <= st["mean"] <= 1 for st in data["accuracy"].values())
    assert data["meta"]["config"]["task"] == "arithmetic" and data["meta"]["corpus"]["eval_problems"] == 40
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *EVAL_QAT_TINY, "--json", str(tmp_path / "corpus.json")])
    script.main()
    corpus = json.loads((tmp_path / "corpus.json").read_text())
    assert not set(script.TASK_FLAGS) & set(corpus["meta"]["config"]) and "accuracy" not in corpus


@pytest.mark.parametrize("scheme", ["int4_tinygemm", "8da4w"])
def test_eval_qat_compiled_qat_fine_tune_compiles_once(scheme, monkeypatch, capsys):
    """Issue 26: eval_qat.py's --compile fine-tune of a QAT Llama with the LM head quantized too (the whole model
    compiled, each QAT linear in its selective checkpoint): one frame compiled in the first step, no recompile over
    the later ones (LR schedule, optimizer state, step counters), no graph break, and the phase's log line says so.
    Dynamo's counters, not timings; aot_eager keeps it short (Dynamo's guards and breaks are the backend's input)."""
    import argparse

    script = _eval_qat_script(monkeypatch)
    model = tiny_model()
    report = prepare_qat(model, QATConfig(scheme, 32), include_lm_head=True)
    assert "lm_head" in report.summary()
    blocks = torch.randint(0, model.config.vocab_size, (16, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    stats = {}
    losses = script.train(model, blocks, argparse.Namespace(batch=2, device="cpu"), 5, 1e-3, 0,
                          torch.compile(model, backend="aot_eager"), label="qat", stats=stats)
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert (stats["frames_first_step"], stats["recompiles"], stats["graph_breaks"]) == (1, 0, 0)
    assert "qat: step 1 " in capsys.readouterr().out
    torch._dynamo.reset()


def test_eval_qat_per_channel(tmp_path, monkeypatch):
    """eval_qat.py --group_size -1: PTQ and QAT per channel (every layer, the LM head too), the JSON and the table say
    so; a scheme without per channel is refused in one line before anything runs."""
    script = _eval_qat_script(monkeypatch)
    flags = [*EVAL_QAT_TINY, "--scheme", "int4_weight_only"]
    flags[flags.index("--group_size") + 1] = "-1"
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *flags, "--json", str(tmp_path / "q.json"),
                                      "--markdown", str(tmp_path / "q.md")])
    script.main()
    data = json.loads((tmp_path / "q.json").read_text())
    assert data["meta"]["config"]["group_size"] == -1 and data["meta"]["weights"] == "int4_weight_only, per channel"
    assert all(math.isfinite(v) for v in data["perplexity"].values())
    assert "| model (int4_weight_only, per channel, LM head too) |" in (tmp_path / "q.md").read_text()
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *flags, "--scheme", "int4_tinygemm"])
    with pytest.raises(SystemExit, match="--group_size -1 --scheme int4_tinygemm: .*no per-channel") as e:
        script.main()
    assert "\n" not in str(e.value)


def test_eval_qat_merge_of_single_seed_runs_is_the_multi_seed_run(tmp_path, monkeypatch, capsys):
    """Seeds run in separate calls (--repeats 1 --repeat_from K) and joined by --merge give what one --repeats 2 run
    writes, bit for bit (the CPU runs are deterministic): files in any order, a missing one left out, a partial one
    (a run cut short) giving its finished seed; refused: another configuration, a seed twice."""
    script = _eval_qat_script(monkeypatch)

    def run(*flags):
        monkeypatch.setattr(sys, "argv", ["eval_qat.py", *flags])
        script.main()

    def load(path):
        return json.loads((tmp_path / path).read_text())

    def summary(path):  # all but meta, as JSON text (a NaN recovery compares equal to itself there)
        return json.dumps({k: v for k, v in load(path).items() if k != "meta"})

    def table(path):  # the markdown but its header (time, command)
        return (tmp_path / path).read_text().split("\n", 1)[1]

    save_json = script.save_json  # keep the partial JSON the 2-seed run writes after its first seed

    def keep_partial(path, data):
        save_json(path, data)
        save_json(str(tmp_path / "partial.json"), data)

    monkeypatch.setattr(script, "save_json", keep_partial)
    run(*EVAL_QAT_TINY, "--repeats", "2", "--json", str(tmp_path / "both.json"), "--markdown", str(tmp_path / "both.md"))
    monkeypatch.setattr(script, "save_json", save_json)
    assert load("partial.json")["meta"]["partial"] and [r["seed"] for r in load("partial.json")["repeats"]] == [0]
    run(*EVAL_QAT_TINY, "--repeats", "1", "--repeat_from", "1", "--json", str(tmp_path / "s1.json"))
    run(*EVAL_QAT_TINY, "--repeats", "1", "--json", str(tmp_path / "s0.json"))
    assert [r["seed"] for r in load("s1.json")["repeats"]] == [1] and load("s1.json")["meta"]["config"]["repeat_from"] == 1
    capsys.readouterr()

    run("--merge", str(tmp_path / "s1.json"), str(tmp_path / "gone.json"), str(tmp_path / "s0.json"),
        "--json", str(tmp_path / "merged.json"), "--markdown", str(tmp_path / "merged.md"))
    assert f"--merge: {tmp_path / 'gone.json'} does not exist; merging the others" in capsys.readouterr().out
    assert summary("merged.json") == summary("both.json") and table("merged.md") == table("both.md")
    merged = load("merged.json")["meta"]
    assert [(m["file"], m["seeds"]) for m in merged["merged"]] == [("s1.json", [1]), ("s0.json", [0])]
    assert merged["seeds"] == [0, 1] and "merged from 2 runs" in (tmp_path / "merged.md").read_text()
    config = load("s1.json")["meta"]["config"]
    assert merged["config"] == {k: v for k, v in config.items() if k not in ("repeats", "repeat_from")}
    run("--merge", str(tmp_path / "partial.json"), str(tmp_path / "s1.json"), "--json", str(tmp_path / "merged2.json"))
    assert summary("merged2.json") == summary("both.json")

    def refused(*paths):
        monkeypatch.setattr(sys, "argv", ["eval_qat.py", "--merge", *map(str, paths)])
        with pytest.raises(SystemExit) as e:
            script.main()
        return str(e.value)

    assert refused(tmp_path / "s0.json", tmp_path / "both.json") == (
        f"--merge: {tmp_path / 'both.json'}: seed 0 is in {tmp_path / 's0.json'} too")
    other = load("s1.json")
    other["meta"]["config"]["finetune_lr"] = 1e-3
    other["repeats"][0]["seed"] = 7
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert refused(tmp_path / "s0.json", tmp_path / "other.json") == (
        f"--merge: {tmp_path / 'other.json'}: its configuration differs from {tmp_path / 's0.json'}'s: finetune_lr "
        "0.001 vs 0.0003")
    other["meta"]["config"].update(finetune_lr=3e-4, seed=1)  # another corpus split (and tokenizer)
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert "differs" in refused(tmp_path / "s0.json", tmp_path / "other.json")
    assert refused(tmp_path / "gone.json") == f"--merge: none of {tmp_path / 'gone.json'} exists"


# benchmarks/ptq_sensitivity.py on EVAL_QAT_TINY's shapes: two presets cut to them, the PTQ variants of each kind
PTQ_SWEEP_TINY = ["--device", "cpu", "--configs", "s6x512_lr1e-2,m12x1024_lr8e-3", "--override",
                  "layers=1,hidden=64,intermediate=128,heads=4,kv_heads=2,batch=4,steps=3,lr=2e-3", "--vocab", "300",
                  "--seq", "32", "--eval_blocks", "8", "--eval_batch", "4", "--variants",
                  "8da4w:32,int4_weight_only:64:nohead,int4_weight_only:128,int4_weight_only:hidden,int4_weight_only:ch,"
                  "int4_weight_only:ch:nohead,int4_tinygemm:32"]


def test_ptq_sensitivity_sweep_on_cpu(tmp_path, monkeypatch, capsys):
    """benchmarks/ptq_sensitivity.py end to end on tiny shapes: the records' structure and arithmetic (increase =
    (PTQ - base) / base, per channel = one group per row of each layer, what stayed in float), a partial JSON after
    each base but the last, int4_tinygemm skipped off CUDA with one line, and its base is eval_qat.py's base."""
    script = _eval_qat_script(monkeypatch, "ptq_sensitivity")
    out, md = tmp_path / "ptq.json", tmp_path / "ptq.md"
    written = []  # (partial?, bases) of each write: partial ones after every base but the last
    write_results = script.write_results

    def keep(data, *args):
        written.append((data["meta"]["partial"], [b["name"] for b in data["bases"]]))
        write_results(data, *args)

    monkeypatch.setattr(script, "write_results", keep)
    monkeypatch.setattr(sys, "argv", ["ptq_sensitivity.py", *PTQ_SWEEP_TINY, "--json", str(out), "--markdown", str(md)])
    script.main()
    printed = capsys.readouterr().out
    assert printed.count("skipping the int4_tinygemm rows: converts on a CUDA GPU only") == 1
    data = json.loads(out.read_text())
    names = [b["name"] for b in data["bases"]]
    assert len(names) == 2 and names[0].startswith("s6x512_lr1e-2 (layers=1,")
    assert written == [(True, names[:1]), (False, names)]
    meta = data["meta"]
    assert not meta["partial"] and meta["skipped"] == {"int4_tinygemm rows": "converts on a CUDA GPU only"}
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
    for b in data["bases"]:
        assert b["config"] == {"layers": 1, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "batch": 4,
                               "steps": 3, "lr": 2e-3}
        assert b["tokens"] == 3 * 4 * 32 and b["epochs"] == pytest.approx(b["tokens"] / meta["corpus"]["pretrain_tokens"])
        assert b["tokens_per_param"] == b["tokens"] / b["params"] and b["vocab"] == 300
        assert b["params"] == sum(p.numel() for p in _tiny_llama(script).parameters())
        held_out, train = b["loss"]["held_out"], b["loss"]["train"]
        assert 1 < held_out < 10 and 1 < train < 10 and b["gap"] == held_out - train
        rows = {r["name"]: r for r in b["variants"]}
        assert list(rows) == ["8da4w g32 + LM head", "int4_weight_only g64, LM head float",
                              "int4_weight_only g128 + LM head", "int4_weight_only group = hidden + LM head",
                              "int4_weight_only per-channel + LM head", "int4_weight_only per-channel, LM head float"]
        for r in rows.values():
            assert r["ptq_loss_increase"] == (r["loss"] - held_out) / held_out and math.isfinite(r["loss"])
            assert r["reaches_target"] == (r["ptq_loss_increase"] >= 0.02)
        # which linears each quantized, in groups of what (torchao's block_size, read back from the weights)
        assert rows["8da4w g32 + LM head"]["group_sizes"] == {"64": [32], "128": [32]}
        assert rows["8da4w g32 + LM head"]["quantized"] == 8 and rows["8da4w g32 + LM head"]["unquantized"] == []
        g64 = rows["int4_weight_only g64, LM head float"]
        assert (g64["quantized"], g64["unquantized"], g64["group_sizes"]) == (7, ["lm_head"], {"64": [64], "128": [64]})
        g128 = rows["int4_weight_only g128 + LM head"]  # only down_proj's 128 inputs hold a group of 128
        assert g128["quantized"] == 1 and g128["group_sizes"] == {"128": [128]}
        assert g128["unquantized"] == [f"model.layers.*.{n}" for n in linears if n != "mlp.down_proj"] + ["lm_head"]
        hidden = rows["int4_weight_only group = hidden + LM head"]
        assert hidden["group_size"] == 64 and hidden["eval_qat_flags"] == (
            "--scheme int4_weight_only --group_size 64 --include_lm_head")
        for name, n in (("int4_weight_only per-channel + LM head", 8), ("int4_weight_only per-channel, LM head float", 7)):
            ch = rows[name]  # per channel: each layer's group is its in_features
            assert ch["group_size"] == "per_channel" and ch["quantized"] == n
            assert ch["group_sizes"] == {"64": [64], "128": [128]}
            assert ch["unquantized"] == ([] if n == 8 else ["lm_head"])
            assert ch["eval_qat_flags"] == "--scheme int4_weight_only --group_size -1" + (" --include_lm_head" if n == 8
                                                                                          else "")
        assert b["eval_qat_flags"] == ("--layers 1 --hidden 64 --intermediate 128 --heads 4 --kv_heads 2 --vocab 300 "
                                       "--seq 32 --seed 0 --batch 4 --pretrain_steps 3 --pretrain_lr 0.002")
        assert b["loss"]["train_blocks"] == 8  # 3 steps x 4 blocks: the first 8 distinct ones the batches drew
    # the "train" loss is on blocks pretraining drew: the first distinct ones of eval_qat.train's batches
    draws = [i for idx in script.batch_order(1000, 3, 4, 0) for i in idx.tolist()]
    seen = script.seen_blocks(1000, {"steps": 3, "batch": 4}, 0, 8).tolist()
    assert seen == list(dict.fromkeys(draws))[:8] and len(set(seen)) == 8
    # the presets differ only in their rate, which the override sets alike: the same base twice
    assert data["bases"][0]["loss"] == data["bases"][1]["loss"]
    text = md.read_text()
    assert "int4_weight_only per-channel + LM head" in text and "Not run: int4_tinygemm rows" in text

    # the base and its PTQ are eval_qat.py's "base bf16" / "base PTQ" for the flags the row names
    eval_qat = _eval_qat_script(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["eval_qat.py", *EVAL_QAT_TINY, "--json", str(tmp_path / "qat.json")])
    eval_qat.main()
    ppl = json.loads((tmp_path / "qat.json").read_text())["perplexity"]
    base = data["bases"][0]
    assert EVAL_QAT_TINY[EVAL_QAT_TINY.index("--pretrain_steps") + 1] == "3" and "--scheme" not in EVAL_QAT_TINY
    assert base["loss"]["held_out"] == pytest.approx(math.log(ppl["base bf16"]), rel=1e-12)
    assert base["variants"][0]["loss"] == pytest.approx(math.log(ppl["base PTQ"]), rel=1e-12)  # 8da4w g32 + LM head


def _tiny_llama(script):
    import argparse

    from transformers import AutoModelForCausalLM

    a = argparse.Namespace(layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=300, seq=32)
    return AutoModelForCausalLM.from_config(script.llama_config(a))


def test_ptq_sensitivity_refuses_bad_specs_and_skips_past_the_deadline(tmp_path, monkeypatch, capsys):
    """Variants the schemes cannot convert are refused before anything runs; a base that would end past
    --deadline_s is skipped and said so, the files written all the same; --plan prints the estimates."""
    script = _eval_qat_script(monkeypatch, "ptq_sensitivity")
    for spec, why in (("int4_tinygemm:ch", "no per-channel int4.*scheme 8da4w or int4_weight_only"),
                      ("int4_tinygemm:-1", "no per-channel"), ("int4_tinygemm:hidden", "no 'hidden'"),
                      ("int4_tinygemm:512", "groups of 32, 64, 128, 256"), ("fp8_rowwise:32", "not int4"),
                      ("int4_weight_only:big", "GROUP must be"), ("int4_weight_only:32:head", "SCHEME:GROUP")):
        with pytest.raises(SystemExit, match=why):
            script.parse_variant(spec)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        script.parse_override("depth=3")
    with pytest.raises(SystemExit, match="unknown configuration"):
        script.parse_config("huge", {})
    assert script.parse_variant("8da4w:ch") == {"name": "8da4w per-channel + LM head", "scheme": "8da4w",
                                                "group": "ch", "include_lm_head": True}
    assert script.parse_variant("8da4w:-1") == script.parse_variant("8da4w:ch")

    out = tmp_path / "ptq.json"
    monkeypatch.setattr(sys, "argv", ["ptq_sensitivity.py", *PTQ_SWEEP_TINY, "--deadline_s", "1e-9", "--json", str(out)])
    script.main()
    data = json.loads(out.read_text())
    assert data["bases"] == [] and not data["meta"]["partial"]
    skipped = data["meta"]["skipped"]
    assert [k for k in skipped if k != "int4_tinygemm rows"] == [
        "s6x512_lr1e-2 (layers=1,hidden=64,intermediate=128,heads=4,kv_heads=2,batch=4,steps=3,lr=0.002)",
        "m12x1024_lr8e-3 (layers=1,hidden=64,intermediate=128,heads=4,kv_heads=2,batch=4,steps=3,lr=0.002)"]
    assert all("past --deadline_s 1e-09" in why for k, why in skipped.items() if k != "int4_tinygemm rows")

    monkeypatch.setattr(sys, "argv", ["ptq_sensitivity.py", "--plan", "--deadline_s", "500"])
    script.main()
    plan = capsys.readouterr().out
    for name in script.DEFAULT_CONFIGS.split(","):
        assert f"  {name} " in plan
    assert "total ~" in plan


def test_ptq_sensitivity_records_a_failure_and_goes_on(tmp_path, monkeypatch):
    """One device call runs the whole sweep: a variant that raises is an error row, a base that raises (out of
    memory, say) an error record, and the rest still runs and is written."""
    script = _eval_qat_script(monkeypatch, "ptq_sensitivity")
    quantize, pretrain, calls = script.quantize, script.pretrain, []

    def failing_quantize(base, variant, hidden):
        if variant["group"] == "ch":
            raise NotImplementedError("no per-channel kernel here\nsecond line")
        return quantize(base, variant, hidden)

    def failing_pretrain(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return pretrain(*args)

    monkeypatch.setattr(script, "quantize", failing_quantize)
    monkeypatch.setattr(script, "pretrain", failing_pretrain)
    out, md = tmp_path / "ptq.json", tmp_path / "ptq.md"
    monkeypatch.setattr(sys, "argv", ["ptq_sensitivity.py", *PTQ_SWEEP_TINY, "--json", str(out), "--markdown", str(md)])
    script.main()
    first, second = json.loads(out.read_text())["bases"]
    assert first["error"] == "error: RuntimeError: CUDA out of memory (simulated)" and "variants" not in first
    rows = {r["name"]: r for r in second["variants"]}
    assert rows["int4_weight_only per-channel + LM head"]["error"] == (
        "error: NotImplementedError: no per-channel kernel here")
    assert "loss" not in rows["int4_weight_only per-channel + LM head"]
    assert math.isfinite(rows["8da4w g32 + LM head"]["ptq_loss_increase"]) and len(rows) == 6
    text = md.read_text()
    assert "error: RuntimeError: CUDA out of memory (simulated)" in text and "no per-channel kernel here" in text
