"""lowbit_skip_causal_mask (hf_lowbit.integrations.causal_mask): under torch.compile a plain causal batch reaches SDPA
with no mask and is_causal=True, as it does eagerly; anything else keeps transformers' mask; the same losses."""

import pickle

import pytest
import torch
from conftest import lowbit_args, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, BatchEncoding, MistralConfig

from hf_lowbit import LowBitTrainer
from hf_lowbit.integrations import causal_mask as cm


def _mask_kwargs(**kw):
    return {"batch_size": 2, "q_length": 8, "kv_length": 8, "q_offset": 0, "kv_offset": 0, "attention_mask": None,
            "local_size": None, "allow_is_causal_skip": True, "device": "cpu", **kw}


def test_the_mask_function_skips_only_a_plain_causal_mask(monkeypatch):
    cm.install()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    assert fn is cm._sdpa_mask
    monkeypatch.setattr(cm, "_installed", lambda *a, **k: "transformers")  # what delegation returns
    with cm.plain_causal():
        assert fn(**_mask_kwargs()) is None
        for other in (dict(attention_mask=torch.tensor([[1] * 8, [0] + [1] * 7]).bool()), dict(q_offset=3),
                      dict(q_offset=torch.tensor(0)), dict(local_size=4), dict(q_length=1, kv_length=1),
                      dict(kv_length=12)):
            assert fn(**_mask_kwargs(**other)) == "transformers", other
    with cm.plain_causal(enabled=False):
        assert fn(**_mask_kwargs()) == "transformers" and cm._active is False
    assert fn(**_mask_kwargs()) == "transformers" and cm._active is False


def test_which_models_qualify():
    assert cm.plain_causal_model(tiny_model("llama")) is None
    assert cm.plain_causal_model(tiny_model("qwen2")) is None
    mistral = AutoModelForCausalLM.from_config(MistralConfig(**{**tiny_config("llama").to_diff_dict(),
                                                                "sliding_window": 16}))
    assert "sliding_window=16" in cm.plain_causal_model(mistral)
    eager = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    assert "not 'sdpa'" in cm.plain_causal_model(eager)
    gpt2 = type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})()
    assert "'gpt2' is not one of" in cm.plain_causal_model(gpt2)


def _sdpa_calls(model, ids, skip: bool):
    """The SDPA calls of the compiled forward+backward (Dynamo's graphs, eager backend): (has a mask, is_causal),
    and the loss and gradients."""
    calls = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                calls.append((mask is not None, n.kwargs.get("is_causal")))
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    with cm.plain_causal(skip):
        loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss
    loss.backward()
    return calls, loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_cache", [True, False])
def test_compiled_forward_gets_no_mask_and_the_same_loss(use_cache):
    model = tiny_model("llama")
    model.config.use_cache = use_cache
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    stock, ref_loss, ref_grads = _sdpa_calls(model, ids, skip=False)
    ours, loss, grads = _sdpa_calls(model, ids, skip=True)
    assert stock and all(has_mask for has_mask, _ in stock)  # transformers' compiled path: a materialized mask
    assert ours and all(not has_mask and causal for has_mask, causal in ours)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_drop_full_attention_mask():
    def collate(features):
        ids = torch.tensor([f["ids"] for f in features])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.tensor([f["mask"] for f in features])})

    wrapped = cm.DropFullAttentionMask(collate)
    full = wrapped([{"ids": [1, 2, 3], "mask": [1, 1, 1]}] * 2)
    assert set(full) == {"input_ids"} and cm.batch_is_plain_causal(full)
    padded = wrapped([{"ids": [1, 2, 3], "mask": [1, 1, 1]}, {"ids": [1, 2, 0], "mask": [1, 1, 0]}])
    assert "attention_mask" in padded and not cm.batch_is_plain_causal(padded)
    packed = cm.DropFullAttentionMask(lambda f: {"input_ids": torch.ones(1, 4), "attention_mask": torch.ones(1, 4),
                                                 "position_ids": torch.tensor([[0, 1, 0, 1]])})([None])
    assert "attention_mask" in packed and not cm.batch_is_plain_causal(packed)
    assert pickle.loads(pickle.dumps(cm.DropFullAttentionMask(torch.stack))).collator is torch.stack


def test_trainer_skips_the_mask_for_plain_batches(tmp_path, monkeypatch):
    """LowBitTrainer: the collator wrapped, the context on for each training step of a plain batch (the mask
    function answered None there), and off with lowbit_skip_causal_mask=False."""
    from conftest import arithmetic_blocks

    answers = []
    real = cm._sdpa_mask

    def spy(*args, **kwargs):
        answers.append(real(*args, **kwargs) is None and cm._active)
        return real(*args, **kwargs)

    cm.install()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)
    for skip in (True, False):
        answers.clear()
        args = lowbit_args(tmp_path / str(skip), max_steps=2, per_device_train_batch_size=4, save_strategy="no",
                           int8_mixed_precision=True, lowbit_min_features=16, lowbit_skip_causal_mask=skip,
                           disable_tqdm=True)
        trainer = LowBitTrainer(tiny_model("llama", vocab_size=96), args, train_dataset=arithmetic_blocks(8))
        assert isinstance(trainer.data_collator, cm.DropFullAttentionMask) == skip
        assert trainer.lowbit_skip_causal_mask == skip
        trainer.train()
        assert answers and all(answers) == skip and any(answers) == skip


def test_the_argument_is_checked(tmp_path):
    with pytest.raises(TypeError, match="lowbit_skip_causal_mask must be True or False"):
        lowbit_args(tmp_path, lowbit_skip_causal_mask="yes")
