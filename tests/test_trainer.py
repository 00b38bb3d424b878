"""LowBitTrainer end to end on tiny models: loss falls, INT8 tracks bf16, checkpoints, resume, PEFT."""

import math
from functools import partial

import pytest
import torch
from conftest import ARITH_TOKENIZER, arithmetic_blocks, lowbit_args, snr_db, tiny_model
from peft import LoraConfig, PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_lowbit import LowBitLinear, LowBitTrainer, LowBitWarning
from hf_lowbit.trainer import LowBitTrainerMixin

TOKENIZER = ARITH_TOKENIZER


def _data(n_blocks=64):
    return arithmetic_blocks(n_blocks)


_args = partial(lowbit_args, max_steps=30, per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=1,
                save_strategy="no", seed=0, lowbit_min_features=16, disable_tqdm=True, optim="adamw_torch")


def _losses(trainer, after_step=0):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after_step]


def _model(arch):
    return tiny_model(arch, vocab_size=len(TOKENIZER))


@pytest.mark.slow
@pytest.mark.parametrize("arch,recipe", [("llama", "int8_mixed_precision"), ("qwen2", "int8_mixed_precision"),
                                         ("llama", "fp8_mixed_precision"),
                                         ("llama", "fp8_tensorwise_mixed_precision")])
def test_lowbit_loss_falls_and_tracks_bf16(tmp_path, arch, recipe):
    ds = _data()
    runs = {}
    for lowbit in (False, True):
        trainer = LowBitTrainer(_model(arch), _args(tmp_path / str(lowbit), bf16=True, **{recipe: lowbit}),
                                train_dataset=ds)
        if lowbit:
            assert sum(isinstance(m, LowBitLinear) for m in trainer.model.modules()) == 14
        trainer.train()
        runs[lowbit] = torch.tensor(_losses(trainer))
    bf16, lowbit = runs[False], runs[True]
    assert lowbit[-5:].mean() < 0.85 * lowbit[:5].mean(), f"{recipe} loss did not fall"
    rel = ((lowbit - bf16).abs() / bf16).mean().item()
    assert rel < 0.03, f"{recipe} losses differ from bf16 by {rel:.2%} on average"


@pytest.mark.slow
@pytest.mark.parametrize("recipe,tied", [("int8_mixed_precision", False), ("fp8_mixed_precision", False),
                                         ("int8_mixed_precision", True)])
def test_lowbit_lm_head_loss_falls_and_tracks_bf16(tmp_path, recipe, tied):
    """lowbit_include_lm_head: the head (15th layer) computes low-bit too and training still tracks bf16; tied, the
    head keeps the input embedding's Parameter through the Trainer's wrapping and its optimizer."""
    ds = _data()
    runs = {}
    for lowbit in (False, True):
        model = _model("llama") if not tied else tiny_model("llama", vocab_size=len(TOKENIZER), tie_word_embeddings=True)
        trainer = LowBitTrainer(model, _args(tmp_path / str(lowbit), bf16=True, lowbit_include_lm_head=lowbit,
                                             **{recipe: lowbit}), train_dataset=ds)
        if lowbit:
            assert sum(isinstance(m, LowBitLinear) for m in trainer.model.modules()) == 15
            assert isinstance(trainer.model.lm_head, LowBitLinear)
            assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) == tied
        trainer.train()
        runs[lowbit] = torch.tensor(_losses(trainer))
    bf16, lowbit = runs[False], runs[True]
    assert torch.isfinite(lowbit).all() and len(lowbit) == 30
    fall = 0.95 if tied else 0.85  # the tied tiny Llama learns slower, bf16 too (2.69 -> 2.44 over the 5-step means)
    assert lowbit[-5:].mean() < fall * lowbit[:5].mean(), f"{recipe} loss did not fall"
    rel = ((lowbit - bf16).abs() / bf16).mean().item()
    assert rel < 0.03, f"{recipe} with the LM head losses differ from bf16 by {rel:.2%} on average"


def test_checkpoint_loads_into_plain_transformers(tmp_path):
    trainer = LowBitTrainer(_model("llama"), _args(tmp_path, max_steps=3, int8_mixed_precision=True),
                            train_dataset=_data(16))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert not any(isinstance(m, LowBitLinear) for m in plain.modules())
    assert all(type(plain.get_submodule(n)) is nn.Linear for n, m in trainer.model.named_modules()
               if isinstance(m, LowBitLinear))
    ours = trainer.model.state_dict()
    theirs = plain.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k].cpu(), theirs[k]) for k in ours)
    ids = torch.randint(4, len(TOKENIZER), (2, 16))
    trainer.model.eval()
    with torch.no_grad():
        assert snr_db(plain(ids).logits, trainer.model(ids.to(trainer.model.device)).logits.cpu()) > 20


def test_resume_from_checkpoint_continues_identically(tmp_path):
    ds = _data(32)
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3, int8_mixed_precision=True)
    full = LowBitTrainer(_model("llama"), _args(tmp_path / "full", **kw), train_dataset=ds)
    full.train()
    resumed = LowBitTrainer(_model("llama"), _args(tmp_path / "full", **kw), train_dataset=ds)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    after = torch.tensor(_losses(resumed, after_step=3))
    assert len(after) == 3
    torch.testing.assert_close(after, torch.tensor(_losses(full, after_step=3)), rtol=1e-5, atol=1e-6)


def test_peft_lora_over_int8_base(tmp_path):
    """LoRA over an INT8-compute base learns as LoRA over the same base in fp32 does (the reference run)."""
    runs = {}
    for int8 in (False, True):
        trainer = LowBitTrainer(_model("llama"), _args(tmp_path / str(int8), max_steps=15, int8_mixed_precision=int8),
                                train_dataset=_data(32), peft_config=LoraConfig(r=4, target_modules="all-linear"))
        assert isinstance(trainer.model, PeftModel)
        q = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
        assert isinstance(q.base_layer, LowBitLinear if int8 else nn.Linear) and not q.base_layer.weight.requires_grad
        trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        trainer.train()
        runs[int8] = torch.tensor(_losses(trainer))
    ref, int8 = runs[False], runs[True]
    # measured: the last 3 steps' mean is 0.959x the first 3's in both runs (LoRA r4 at lr 3e-3 moves slowly;
    # with learning rate 0 the same batches give 0.998x), and INT8 is within 0.01% of the
    # reference at every step: bars at 0.975x and 0.5%
    assert int8[-3:].mean() < 0.975 * int8[:3].mean(), f"LoRA over INT8 did not learn: {int8.tolist()}"
    assert ref[-3:].mean() < 0.975 * ref[:3].mean()
    rel = ((int8 - ref).abs() / ref).mean().item()
    assert rel < 0.005, f"LoRA over INT8 differs from LoRA over fp32 by {rel:.2%} on average"


def test_setup_warnings(tmp_path):
    ragged = [{"input_ids": torch.arange(n)} for n in (8, 9, 10)]
    trainer = LowBitTrainer(_model("llama"), _args(tmp_path, int8_mixed_precision=True, optim="adamw_bnb_8bit"),
                            train_dataset=ragged)
    with pytest.warns(LowBitWarning) as record:
        found = trainer.check_setup()
    text = " ".join(found)
    assert len(record) == len(found) == 4
    for needle in ("not faster", "torch_compile=True", "varying length", "adamw_bnb_8bit"):
        assert needle in text
    packed = LowBitTrainer(_model("llama"), _args(tmp_path, int8_mixed_precision=True, per_device_train_batch_size=2),
                           train_dataset=_data(8))
    with pytest.warns(LowBitWarning):
        assert any("64 tokens per micro-batch" in m for m in packed.check_setup())


def test_trainer_rejects_plain_training_arguments(tmp_path):
    with pytest.raises(TypeError, match="LowBitTrainingArguments"):
        LowBitTrainer(_model("llama"), TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    with pytest.raises(ValueError, match="pass model="):
        LowBitTrainer(None, _args(tmp_path))


def test_fsdp2_quantized_bases_get_a_float_carrier_where_torch_cannot_shard_integer_parameters():
    """torch < 2.13: codes re-registered as flat parameters of the policy's param_dtype over the same bytes; a
    module whose byte count the carrier does not divide stays whole instead; torch >= 2.13: nothing changes."""
    from types import SimpleNamespace

    from hf_lowbit import Int8Linear, Nf4Linear
    from hf_lowbit.integrations.distributed import prepare_integer_params_for_fsdp2

    def model():
        torch.manual_seed(0)
        return nn.ModuleList([Nf4Linear.from_linear(nn.Linear(128, 64)), nn.Linear(64, 64),
                              Int8Linear.from_linear(nn.Linear(64, 64)), Int8Linear.from_linear(nn.Linear(3, 3))])

    def forward(m, x):
        return m[2](m[1](m[0](x)))

    ref = model()
    m = model()
    plugin = SimpleNamespace(ignored_modules=None, mixed_precision_policy=SimpleNamespace(param_dtype=torch.float32))
    assert prepare_integer_params_for_fsdp2(plugin, m, "cpu", torch_version="2.13.0") == ([], [])
    assert m[0].qweight.dtype == torch.uint8 and plugin.ignored_modules is None
    with pytest.warns(LowBitWarning, match="1 modules holding them stay whole"):
        carried, whole = prepare_integer_params_for_fsdp2(plugin, m, "cpu", torch_version="2.11.0")
    assert (carried, whole) == (["0", "2"], ["3"])  # 3x3 int8 = 9 bytes: no whole number of float32
    assert m[0].qweight.dtype == m[0].qscale.dtype == m[2].qweight.dtype == torch.float32
    assert m[0].qweight.shape == (64 * 64 // 4,) and m[3].qweight.dtype == torch.int8
    x = torch.randn(2, 128)
    assert torch.equal(forward(m, x), forward(ref, x))
    assert all(torch.equal(a, b) for a, b in zip(m[0]._stored(), ref[0]._stored()))
    sd = m.state_dict()
    assert sd["0.qweight"].dtype == torch.float32  # the checkpoint holds what the module holds
    for codes in ("qweight", "qscale"):  # loading must overwrite these
        getattr(m[0], codes).data.zero_()
    m.load_state_dict(ref.state_dict())  # integer codes into a carrier: by their bytes
    assert torch.equal(forward(m, x), forward(ref, x))
    fresh = model()
    for layer in (fresh[0], fresh[2]):
        layer.qweight.data.zero_()
    fresh.load_state_dict(sd)  # a carrier checkpoint into integer codes: by its bytes too
    assert fresh[0].qweight.dtype == torch.uint8 and torch.equal(forward(fresh, x), forward(ref, x))


def test_fsdp2_keeps_quantized_bases_whole_where_torch_cannot_shard_integer_parameters():
    """torch < 2.13's fully_shard fails on integer parameters: those modules are left out of sharding instead."""
    import re
    from types import SimpleNamespace

    from hf_lowbit import Nf4Linear
    from hf_lowbit.integrations.distributed import keep_integer_params_unsharded

    model = nn.Sequential(Nf4Linear.from_linear(nn.Linear(128, 64)), nn.Linear(64, 8), Nf4Linear.from_linear(nn.Linear(64, 64)))
    plugin = SimpleNamespace(ignored_modules=None)
    assert keep_integer_params_unsharded(plugin, model, "cpu", torch_version="2.13.0") == [] and plugin.ignored_modules is None
    with pytest.warns(LowBitWarning, match=r"torch 2\.11\.0\+cu130's FSDP2 cannot shard integer parameters.*2 modules"):
        names = keep_integer_params_unsharded(plugin, model, "cpu", torch_version="2.11.0+cu130")
    assert names == ["0", "2"]
    matched = [n for n, _ in model.named_modules() if n and re.fullmatch(plugin.ignored_modules, n)]
    assert matched == ["0", "2"]  # accelerate matches the regex with fullmatch: not "1"
    plugin = SimpleNamespace(ignored_modules="1")  # a user's own regex is kept
    with pytest.warns(LowBitWarning):
        keep_integer_params_unsharded(plugin, model, "cpu", torch_version="2.11.0")
    assert [n for n, _ in model.named_modules() if n and re.fullmatch(plugin.ignored_modules, n)] == ["0", "1", "2"]
    plugin = SimpleNamespace(ignored_modules=[model[1]])  # or their module list
    with pytest.warns(LowBitWarning):
        keep_integer_params_unsharded(plugin, model, "cpu", torch_version="2.11.0")
    assert plugin.ignored_modules == [model[1], model[0], model[2]]
    assert keep_integer_params_unsharded(SimpleNamespace(ignored_modules=None), nn.Linear(4, 4), "cpu",
                                         torch_version="2.11.0") == []  # nothing integer: nothing to do


class _NanEveryThird(Trainer):
    """Reports a NaN loss for every third micro-batch and +inf for every fifth (the gradients stay finite),
    beneath whatever is mixed in; ``raw`` keeps what its ``training_step`` returned."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self._micro = getattr(self, "_micro", 0) + 1
        loss = loss * float("nan") if self._micro % 3 == 0 else loss * float("inf") if self._micro % 5 == 0 else loss
        self.__dict__.setdefault("raw", []).append(loss.item())
        return loss


class _LowBitNanEveryThird(LowBitTrainerMixin, _NanEveryThird):
    pass


class _SeesRawLoss(_LowBitNanEveryThird):
    """A user's subclass over LowBitTrainer: its training_step must still see the raw loss."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.__dict__.setdefault("seen", []).append(loss.item())
        return loss


def test_nan_inf_filter_runs_on_the_device_and_logs_what_the_trainer_logs(tmp_path, monkeypatch):
    """LowBitTrainer applies logging_nan_inf_filter without the Trainer's host test per micro-batch (no
    torch.isnan in its loop) and logs exactly the stock Trainer's losses; callbacks, subclasses and saved
    arguments see the user's flag and the raw loss."""
    flags = []

    class Flag(TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):
            flags.append(args.logging_nan_inf_filter)

        on_step_end = on_substep_end

    tested = []
    isnan = torch.isnan
    monkeypatch.setattr(torch, "isnan", lambda *a, **k: tested.append(1) or isnan(*a, **k))
    kw = dict(max_steps=6, gradient_accumulation_steps=2, per_device_train_batch_size=4, save_strategy="steps",
              save_steps=3)
    logs, tests = {}, {}
    for name, cls in (("stock", _NanEveryThird), ("ours", _SeesRawLoss)):
        trainer = cls(_model("llama"), args=_args(tmp_path / name, **kw), train_dataset=_data(48))
        trainer.add_callback(Flag())
        tested.clear()
        trainer.train()
        logs[name], tests[name] = _losses(trainer), len(tested)
        assert trainer.args.logging_nan_inf_filter is True and "training_step" not in trainer.__dict__
    assert tests["stock"] >= 12 and tests["ours"] == 0, tests  # the stock loop tests each of the 12 micro-batches
    assert flags and all(flags), "a callback saw the flag switched off"
    assert len(logs["ours"]) == 6 and all(math.isfinite(v) for v in logs["ours"])
    assert logs["ours"] == logs["stock"]
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731
    assert len(trainer.seen) == len(trainer.raw) == 12 and all(map(same, trainer.seen, trainer.raw))
    assert any(math.isnan(v) for v in trainer.seen)  # the subclass saw them raw
    assert any(math.isinf(v) for v in trainer.seen)
    saved = torch.load(tmp_path / "ours" / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert saved.logging_nan_inf_filter is True


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
@pytest.mark.parametrize("device,accelerator_config,expected", [
    ("cuda", None, True), ("cuda", {"non_blocking": False}, False), ("cpu", None, False)])
def test_prepared_train_dataloader_copies_as_the_arguments_chose(tmp_path, monkeypatch, device, accelerator_config,
                                                                 expected):
    """The non_blocking the arguments pick for the training device reaches accelerate's prepared train dataloader
    (built on the CPU: the arguments see ``device`` only while they are constructed); a batch still arrives whole."""
    with monkeypatch.context() as patch:
        patch.setattr(TrainingArguments, "device", property(lambda self: torch.device(device)))
        args = _args(tmp_path, use_cpu=False, per_device_train_batch_size=4, accelerator_config=accelerator_config)
    args.use_cpu = True  # the run itself on the CPU, on any machine (pinned memory stays requested)
    data = _data(8)
    trainer = LowBitTrainer(_model("llama"), args, train_dataset=data)
    loader = trainer.get_train_dataloader()
    assert trainer.accelerator.non_blocking is expected and loader._non_blocking is expected
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 32)
    assert all(any(torch.equal(row, data[i]["input_ids"]) for i in range(len(data))) for row in batch["input_ids"])
