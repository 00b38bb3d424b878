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
    padding = dict(attention_mask=torch.ones(2, 8, dtype=torch.bool))
    with cm.plain_causal(mask_all_ones=True):  # a FullMaskBatch's mask: vouched all ones, so ignored
        assert fn(**_mask_kwargs(**padding)) is None and fn(**_mask_kwargs()) is None
        for other in (dict(q_offset=3), dict(local_size=4), dict(kv_length=12)):
            assert fn(**_mask_kwargs(**padding, **other)) == "transformers", other
    assert cm._mask_all_ones is False
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


def _sdpa_calls(model, ids, skip: bool, mask=None):
    """The SDPA calls of the compiled forward+backward (Dynamo's graphs, eager backend): (has a mask, is_causal),
    and the loss and gradients. ``mask``: an attention_mask to pass (then vouched all ones under the context)."""
    calls = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if "scaled_dot_product_attention" in str(n.target):
                mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
                calls.append((mask is not None, n.kwargs.get("is_causal")))
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    extra = {} if mask is None else {"attention_mask": mask}
    with cm.plain_causal(skip, mask_all_ones=mask is not None):
        loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids, **extra).loss
    loss.backward()
    return calls, loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("use_cache,all_ones_mask", [(True, False), (False, False), (False, True)])
def test_compiled_forward_gets_no_mask_and_the_same_loss(use_cache, all_ones_mask):
    """all_ones_mask: the batch carries an attention_mask of all ones (a FullMaskBatch's), on both sides."""
    model = tiny_model("llama")
    model.config.use_cache = use_cache
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids) if all_ones_mask else None
    stock, ref_loss, ref_grads = _sdpa_calls(model, ids, skip=False, mask=mask)
    ours, loss, grads = _sdpa_calls(model, ids, skip=True, mask=mask)
    assert stock and all(has_mask for has_mask, _ in stock)  # transformers' compiled path: a materialized mask
    assert ours and all(not has_mask and causal for has_mask, causal in ours)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_the_eager_forward_reads_nothing_back_within_the_context():
    """Eagerly with no cache transformers checks the model's own position ids for packing with a bool() of a tensor
    (on a GPU a host sync a forward); within the context the check answers "not packed" without reading it, and
    the forward computes the same loss. A caller's packing check outside the context is transformers' own."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import masking_utils

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    model = tiny_model("llama", use_cache=False)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for skip in (False, True):
        Reads.count = 0
        with cm.plain_causal(skip), torch.no_grad(), Reads():
            losses.append(model(input_ids=ids, labels=ids).loss)
        assert (Reads.count == 0) == skip, (skip, Reads.count)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert masking_utils.find_packed_sequence_indices is cm._find_packed_sequence_indices
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1]]


def test_full_attention_mask_collator():
    def collate(features):
        ids = torch.tensor([f["ids"] for f in features])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.tensor([f["mask"] for f in features])})

    for drop in (True, False):
        wrapped = cm.FullAttentionMaskCollator(collate, drop=drop)
        full = wrapped([{"ids": [1, 2, 3], "mask": [1, 1, 1]}] * 2)
        if drop:  # the stock loss: the mask removed
            assert set(full) == {"input_ids"} and not isinstance(full, cm.FullMaskBatch)
        else:  # a loss that reads it: kept, the batch marked
            assert isinstance(full, cm.FullMaskBatch) and set(full) == {"input_ids", "attention_mask"}
        assert cm.batch_is_plain_causal(full)
        padded = wrapped([{"ids": [1, 2, 3], "mask": [1, 1, 1]}, {"ids": [1, 2, 0], "mask": [1, 1, 0]}])
        assert "attention_mask" in padded and not isinstance(padded, cm.FullMaskBatch)
        assert not cm.batch_is_plain_causal(padded)
        packed = cm.FullAttentionMaskCollator(
            lambda f: {"input_ids": torch.ones(1, 4), "attention_mask": torch.ones(1, 4),
                       "position_ids": torch.tensor([[0, 1, 0, 1]])}, drop=drop)([None])
        assert "attention_mask" in packed and not cm.batch_is_plain_causal(packed)
    assert not cm.batch_is_plain_causal({"input_ids": 1, "attention_mask": 1})  # an unmarked mask: not vouched for
    assert not cm.batch_is_plain_causal(cm.FullMaskBatch(input_ids=1, attention_mask=1, position_ids=1))
    back = pickle.loads(pickle.dumps(cm.FullAttentionMaskCollator(torch.stack, drop=False)))
    assert back.collator is torch.stack and back.drop is False
    assert type(pickle.loads(pickle.dumps(cm.FullMaskBatch(a=1)))) is cm.FullMaskBatch


def test_a_marked_batch_keeps_its_type_on_the_way_to_the_model():
    """The mark is the batch's type: DataLoader's pinning (where it runs), accelerate's send_to_device and the
    Trainer's _prepare_input rebuild a mapping as its own type."""
    from accelerate.utils import send_to_device
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = cm.FullMaskBatch(input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4))
    assert type(send_to_device(batch, "cpu")) is cm.FullMaskBatch
    if torch.cuda.is_available():  # pinning needs an accelerator
        assert type(pin_memory(batch)) is cm.FullMaskBatch

    class Prep:  # Trainer._prepare_input, unbound, on a stand-in with the attributes it reads
        args = type("A", (), {"device": torch.device("cpu")})()
        is_deepspeed_enabled = False

    from transformers import Trainer

    Prep._prepare_input = Trainer._prepare_input
    assert type(Prep()._prepare_input(batch)) is cm.FullMaskBatch


def loader_collator(trainer):
    """The FullAttentionMaskCollator in the trainer's training data loader (under the Trainer's column-removing
    wrapper, if any), or None."""
    fn = trainer.get_train_dataloader().collate_fn
    while fn is not None and not isinstance(fn, cm.FullAttentionMaskCollator):
        fn = getattr(fn, "data_collator", None)
    return fn


def test_collator_mode_and_dispatch():
    from types import SimpleNamespace

    from transformers import Trainer

    class Own(LowBitTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    assert cm.collator_mode(LowBitTrainer) == "drop" and cm.collator_mode(Trainer) == "drop"
    assert cm.collator_mode(Own) is None  # a loss of its own: it may read the mask or forward another batch
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    iterable, mapped = Stream(), torch.utils.data.TensorDataset(torch.ones(2))

    def acc(n, dispatch):
        return SimpleNamespace(num_processes=n, dataloader_config=SimpleNamespace(dispatch_batches=dispatch))

    assert not cm.dispatches_batches(acc(1, True), iterable)  # one process: nothing is concatenated
    assert cm.dispatches_batches(acc(2, True), mapped) and cm.dispatches_batches(acc(2, None), iterable)
    assert not cm.dispatches_batches(acc(2, None), mapped) and not cm.dispatches_batches(acc(2, False), iterable)


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
        assert not isinstance(trainer.data_collator, cm.FullAttentionMaskCollator)  # the user's, unchanged
        wrapped = loader_collator(trainer)
        assert (wrapped is not None) == skip and (not skip or wrapped.drop)  # stock loss: the all-ones mask dropped
        assert trainer.lowbit_skip_causal_mask == skip
        trainer.train()
        assert answers and all(answers) == skip and any(answers) == skip


def test_a_loss_of_its_own_keeps_the_mask(tmp_path, monkeypatch):
    """A LowBitTrainer subclass with its own compute_loss (it reads attention_mask here): the collator is left
    alone, the loss sees the mask, and the mask function is not told to ignore it (only trl's loss, audited, gets
    a marked batch: tests/test_trl.py)."""
    from conftest import arithmetic_blocks
    from transformers import default_data_collator

    answers, seen = [], []
    real = cm._sdpa_mask

    def spy(*args, **kwargs):
        answers.append(cm._active)  # whether the trainer vouched for this forward's mask
        return real(*args, **kwargs)

    cm.install()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy)

    class CountingTrainer(LowBitTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    def with_mask(features):  # a tokenizer's padding collator on equal lengths: a mask of all ones
        batch = default_data_collator(features)
        return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}

    args = lowbit_args(tmp_path, max_steps=2, per_device_train_batch_size=4, save_strategy="no",
                       int8_mixed_precision=True, lowbit_min_features=16, disable_tqdm=True)
    trainer = CountingTrainer(tiny_model("llama", vocab_size=96), args, train_dataset=arithmetic_blocks(8),
                              data_collator=with_mask)
    assert trainer.lowbit_skip_causal_mask and loader_collator(trainer) is None
    trainer.train()
    assert seen == [4 * 32, 4 * 32]
    assert answers and not any(answers)


def test_the_argument_is_checked(tmp_path):
    with pytest.raises(TypeError, match="lowbit_skip_causal_mask must be True or False"):
        lowbit_args(tmp_path, lowbit_skip_causal_mask="yes")
