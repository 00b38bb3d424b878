"""hf_lowbit.atomic and the save/resume rules built on it, without training (tests/test_fault.py kills real runs)."""

import os

import pytest

from hf_lowbit import atomic
from hf_lowbit.cli.sft import UsageError, cli, resume_checkpoint


def _write(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_publish_moves_the_config_last_and_drops_stale_weights(tmp_path, monkeypatch):
    """Into a directory holding an earlier sharded model and checkpoints: the old config goes first, weight files
    the new save does not write (other shards, an index) go before the new config arrives, which comes last;
    everything else in the directory stays."""
    target, staging = tmp_path / "out", tmp_path / "out" / atomic.MODEL_STAGING
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "sft_metrics.json", "checkpoint-2/config.json"):
        _write(str(target / name), "old")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        _write(str(staging / name), "new")
    moves, replace = [], os.replace

    def record(src, dst):
        moves.append((os.path.basename(dst), sorted(os.listdir(target))))
        replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", record)
    atomic.publish_files(str(staging), str(target))
    assert [m[0] for m in moves][-1] == "config.json"
    first_state = moves[0][1]  # what target held when the first new file went in: no config, no stale weights
    assert "config.json" not in first_state and not [f for f in first_state if f.startswith("model-")]
    assert sorted(os.listdir(target)) == ["checkpoint-2", "config.json", "model.safetensors", "sft_metrics.json",
                                          "tokenizer.json"]
    assert (target / "config.json").read_text() == "new" and (target / "sft_metrics.json").read_text() == "old"


def test_replace_dir_swaps_whole_directories(tmp_path):
    new, target = tmp_path / ".tmp-q", tmp_path / "q"
    _write(str(new / "a"), "new")
    atomic.replace_dir(str(new), str(target))  # nothing there yet: a rename
    assert (target / "a").read_text() == "new" and not new.exists()
    _write(str(new / "b"), "newer")
    atomic.replace_dir(str(new), str(target))  # an earlier one is replaced whole, nothing of it left
    assert sorted(os.listdir(target)) == ["b"] and sorted(os.listdir(tmp_path)) == ["q"]


def test_write_json_leaves_no_temporary(tmp_path):
    atomic.write_json(str(tmp_path / "m.json"), {"a": 1})
    assert os.listdir(tmp_path) == ["m.json"] and (tmp_path / "m.json").read_text().startswith("{")


def test_resume_checkpoint_picks_the_last_complete_one(tmp_path):
    out = tmp_path / "run"
    assert resume_checkpoint(None, str(out)) is None  # no output dir yet: start over
    for step in (2, 4):
        _write(str(out / f"checkpoint-{step}" / "trainer_state.json"), "{}")
    _write(str(out / ".tmp-checkpoint-6" / "checkpoint-6" / "trainer_state.json"), "{}")  # a killed save
    assert resume_checkpoint(None, str(out)) == str(out / "checkpoint-4")
    assert resume_checkpoint("True", str(out)) == str(out / "checkpoint-4")
    assert resume_checkpoint("False", str(out)) is None
    assert resume_checkpoint(str(out / "checkpoint-2"), str(out)) == str(out / "checkpoint-2")
    with pytest.raises(UsageError, match="--resume_from_checkpoint True: no checkpoint in --output_dir"):
        resume_checkpoint("True", str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="not a Trainer checkpoint"):
        resume_checkpoint(str(out / ".tmp-checkpoint-6"), str(out))


def test_resume_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    for value in ("nowhere", "True"):
        with pytest.raises(SystemExit) as ended:
            cli(["--resume_from_checkpoint", value, "--output_dir", str(tmp_path / "run"), "--max_steps", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(err) == 1 and err[0].startswith(
            f"hf-lowbit-sft: error: --resume_from_checkpoint {value}:"), err


def test_save_total_limit_never_leaves_half_deleted_checkpoints(tmp_path, monkeypatch):
    """Rotation renames a checkpoint to .tmp-checkpoint-N.old before deleting it, keeps the newest and the best,
    and the next checkpoint save sweeps what a killed rotation or save left."""
    from conftest import tiny_model

    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments

    out = tmp_path / "run"
    _write(str(out / ".tmp-checkpoint-9" / "junk"))  # left by killed saves of another run
    _write(str(out / ".tmp-checkpoint-1.old" / "junk"))
    args = LowBitTrainingArguments(output_dir=str(out), use_cpu=True, report_to="none", save_total_limit=2,
                                   save_strategy="steps", save_steps=1, max_steps=1, save_only_model=True)
    trainer = LowBitTrainer(tiny_model(), args=args)
    removed, rmtree = [], atomic.shutil.rmtree
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda p, *a, **k: (removed.append(str(p)), rmtree(p, *a, **k)))
    for step in (1, 2, 3):
        trainer.state.global_step = step
        trainer._save_checkpoint(trainer.model, trial=None)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-3"]
    deleted = {os.path.basename(p) for p in removed if os.path.dirname(p) == str(out)}
    assert ".tmp-checkpoint-1.old" in deleted and all(d.startswith(".tmp-") for d in deleted), deleted
