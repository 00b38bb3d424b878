"""LowBitSFTTrainer (trl's SFTTrainer + LowBitTrainerMixin) on tiny models, and the throughput logs."""

import itertools
import math

import pytest
import torch

pytest.importorskip("trl")

from conftest import tiny_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, PeftModel  # noqa: E402

from hf_lowbit import Int8Linear, LoraLinear, LowBitLinear, LowBitSFTConfig, LowBitSFTTrainer  # noqa: E402
from hf_lowbit.data import build_char_tokenizer  # noqa: E402
from hf_lowbit.qat import QATLinear  # noqa: E402
from hf_lowbit.integrations.throughput import ThroughputMeter  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{{ eos_token }}"


def _tokenizer():
    tok = build_char_tokenizer(list("0123456789+=:\nua"))
    tok.chat_template = TEMPLATE
    return tok


TOKENIZER = _tokenizer()


def _chat(n=96):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 50, (2, n), generator=g).tolist()
    return Dataset.from_list([{"messages": [{"role": "user", "content": f"{x}+{y}="},
                                            {"role": "assistant", "content": str(x + y)}]} for x, y in zip(a, b)])


def _cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, save_strategy="no", report_to="none", seed=0, lowbit_min_features=16,
                disable_tqdm=True, optim="adamw_torch", use_cpu=True, bf16=False, max_length=32, packing=True)
    base.update(kw)
    return LowBitSFTConfig(**base)


def _model(**kw):
    return tiny_model(vocab_size=len(TOKENIZER), **kw)


def _trainer(tmp_path, peft_config=None, model=None, **kw):
    return LowBitSFTTrainer(model=model or _model(), args=_cfg(tmp_path, **kw), train_dataset=_chat(),
                            processing_class=TOKENIZER, peft_config=peft_config)


def _losses(trainer, after_step=0):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after_step]


def test_int8_sft_packed_chat(tmp_path):
    trainer = _trainer(tmp_path, int8_mixed_precision=True)
    assert sum(isinstance(m, LowBitLinear) for m in trainer.model.modules()) == 14
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["train_tokens_per_second"] > 0 for h in logs)
    assert not any("train_mfu" in h for h in logs)  # CPU: no known peak


def test_qlora_through_sft_peft_config(tmp_path):
    trainer = _trainer(tmp_path, max_steps=3, peft_config=LoraConfig(r=4, target_modules="all-linear"),
                       lora_base_quant="int8", int8_mixed_precision=True)
    assert isinstance(trainer.model, PeftModel)
    layer = trainer.model.base_model.model.model.layers[0]
    for proj in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert isinstance(proj, LoraLinear) and isinstance(proj.base_layer, Int8Linear)  # wrapped once
    assert not isinstance(trainer.model.base_model.model.lm_head, LoraLinear)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    assert all(math.isfinite(x) for x in _losses(trainer))


def test_qat_sft_exports_a_checkpoint_plain_transformers_loads(tmp_path):
    from test_qat import _load_in_fresh_process

    trainer = _trainer(tmp_path / "run", max_steps=3, qat_scheme="8da4w", qat_group_size=32)
    assert isinstance(trainer.model.model.layers[0].mlp.up_proj, QATLinear)
    trainer.train()
    files = trainer.save_quantized(str(tmp_path / "q"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    ids = torch.randint(0, len(TOKENIZER), (2, 12))
    with torch.no_grad():
        ref = trainer.model(ids).logits
    got = _load_in_fresh_process(tmp_path / "q", ids, tmp_path)
    assert got["weight_type"] == "IntxUnpackedToInt8Tensor"
    assert torch.equal(got["logits"], ref)


def test_resume_from_checkpoint_continues_identically(tmp_path):
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, int8_mixed_precision=True)
    full = _trainer(tmp_path, **kw)
    full.train()
    resumed = _trainer(tmp_path, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4
    after = torch.tensor(_losses(resumed, after_step=2))
    assert [h["step"] for h in resumed.state.log_history if "loss" in h and h["step"] > 2] == [3, 4]
    torch.testing.assert_close(after, torch.tensor(_losses(full, after_step=2)), rtol=1e-5, atol=1e-6)


def test_logged_throughput_is_tokens_over_elapsed_with_accumulation_and_packing(tmp_path):
    """Fixed-length packed rows ("wrapped"): every optimizer step is 2 micro-batches x 4 rows x 32 tokens."""
    peak = 1e-6  # TFLOP/s: any known peak turns MFU on
    trainer = _trainer(tmp_path, max_steps=3, gradient_accumulation_steps=2, packing_strategy="wrapped",
                       dataloader_drop_last=True, int8_mixed_precision=True, lowbit_peak_tflops=peak)
    trainer.train_dataset = trainer.train_dataset.filter(lambda r: len(r["input_ids"]) == 32)  # the short tail
    ticks = itertools.count()
    trainer.lowbit_throughput.clock = lambda: next(ticks) * 0.5  # read at the first micro-batch and at each log
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens, seq = 2 * 4 * 32, 32
    assert len(logs) == 3 and all(h["train_tokens_per_second"] == tokens / 0.5 for h in logs)
    c = trainer.model.config
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    per_layer = c.hidden_size * (2 * c.hidden_size + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    n_params = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size  # all trainable, lm_head included
    flops = 6 * n_params * tokens + 12 * c.num_hidden_layers * c.hidden_size * seq * tokens
    for h in logs:
        assert h["train_mfu"] == pytest.approx(flops / 0.5 / (peak * 1e12), rel=1e-12)


def test_meter_sums_processes_and_counts_frozen_weights_as_4n():
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False))
    model[0].weight.requires_grad_(False)
    ticks = iter([0.0, 2.0])
    meter = ThroughputMeter(clock=lambda: next(ticks))
    meter.count(torch.zeros(3, 5, dtype=torch.long))
    logs = meter.read(model, peak=1e-9, processes=2, reduce=lambda counts: [2 * c for c in counts])
    assert logs["train_tokens_per_second"] == 30 / 2.0  # both processes' tokens
    assert logs["train_mfu"] == (4 * 32 + 6 * 8) * 30 / 2.0 / (1e-9 * 1e12 * 2)  # no config: no attention term


def test_rejects_arguments_without_the_low_bit_fields(tmp_path):
    from trl import SFTConfig

    with pytest.raises(TypeError, match="LowBitSFTConfig"):
        LowBitSFTTrainer(model=_model(), args=SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True),
                         train_dataset=_chat(), processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="qat_include_lm_head"):
        _cfg(tmp_path, qat_scheme="8da4w", qat_include_lm_head=True)
    with pytest.raises(ValueError, match="lowbit_include_lm_head=True is not supported: SFTTrainer's fused LM head"):
        _cfg(tmp_path, int8_mixed_precision=True, lowbit_include_lm_head=True)
    with pytest.raises(ValueError, match="LowBitSFTConfig.lowbit_peak_tflops"):
        _cfg(tmp_path, lowbit_peak_tflops=0)


def test_sft_config_fields_are_cli_flags():
    from transformers import HfArgumentParser

    (cfg,) = HfArgumentParser(LowBitSFTConfig).parse_args_into_dataclasses(args=[
        "--output_dir", "o", "--use_cpu", "--report_to", "none", "--int8_mixed_precision", "--no_lowbit_grad_weight",
        "--lowbit_peak_tflops", "989", "--packing", "--max_length", "64"])
    assert cfg.lowbit_recipes == ["int8_mixed_precision"] and not cfg.lowbit_grad_weight
    assert cfg.lowbit_peak_tflops == 989.0 and cfg.packing and cfg.max_length == 64


def test_without_trl_the_error_says_what_to_install(monkeypatch):
    import sys

    import hf_lowbit

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError
    monkeypatch.delitem(sys.modules, "hf_lowbit.trl")
    monkeypatch.delattr(hf_lowbit, "trl")
    with pytest.raises(ImportError, match=r"hf_lowbit\[trl\]"):
        hf_lowbit.LowBitSFTTrainer


def test_sft_leaves_an_unpadded_batch_causal_mask_to_sdpa(tmp_path, monkeypatch):
    """lowbit_skip_causal_mask under SFTTrainer, whose loss counts tokens with attention_mask: an all-ones mask is
    kept (the batch marked on the CPU) and the mask function answers None for it; padded batches keep
    transformers' mask; the same losses as with the option off (eagerly transformers skips that mask too)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from hf_lowbit.integrations import causal_mask as cm

    answers = []
    real = cm._sdpa_mask

    def spy(*args, **kwargs):
        answers.append((real(*args, **kwargs) is None and cm._active, cm._mask_all_ones))
        return real(*args, **kwargs)

    cm.install()
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    losses = {}
    for skip, batch in ((True, 1), (False, 1), (True, 4)):
        answers.clear()
        trainer = _trainer(tmp_path / f"{skip}{batch}", max_steps=3, packing=False, per_device_train_batch_size=batch,
                           lowbit_skip_causal_mask=skip)
        assert not isinstance(trainer.data_collator, cm.FullAttentionMaskCollator)  # trl inspects its type
        fn = trainer.get_train_dataloader().collate_fn  # in the data loader only, under trl's loss: keep + mark
        while fn is not None and not isinstance(fn, cm.FullAttentionMaskCollator):
            fn = getattr(fn, "data_collator", None)
        assert (fn is not None) == skip and (not skip or not fn.drop)
        trainer.train()
        losses[skip, batch] = _losses(trainer)
        if batch == 1:  # one sequence: no padding, every batch marked and its mask left to SDPA
            assert answers and all(a == (skip, skip) for a in answers), answers
        else:  # 4 sequences: padded where their lengths differ (transformers' mask), marked where they do not
            assert any(not skipped for skipped, _ in answers), answers
            assert all(marked for skipped, marked in answers if skipped), answers
    assert losses[True, 1] == losses[False, 1]
