"""Faults leave no damage: a process SIGKILLed in the middle of a Trainer checkpoint save or of
``save_quantized`` leaves the previous checkpoint / export loadable, and training resumes."""

import hashlib
import os
import signal
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(*argv):
    return subprocess.run([sys.executable, os.path.join(HERE, "_fault_child.py"), *argv], capture_output=True,
                          text=True, timeout=600, cwd=HERE)


def test_kill_during_checkpoint_save_keeps_previous_checkpoint_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import get_last_checkpoint

    out = str(tmp_path / "run")
    proc = _child("checkpoint_kill", out)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-2")  # the half-written one is not a checkpoint
    assert not os.path.exists(os.path.join(out, "checkpoint-4"))
    AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-2"))
    proc = _child("resume", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GLOBAL_STEP 6" in proc.stdout
    assert sorted(d for d in os.listdir(out) if "checkpoint" in d) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_kill_during_save_quantized_keeps_previous_export(tmp_path):
    pytest.importorskip("torchao")
    from transformers import AutoModelForCausalLM

    q = str(tmp_path / "q")
    proc = _child("export", q)
    assert proc.returncode == 0 and "EXPORTED" in proc.stdout, proc.stderr[-3000:]
    weights = os.path.join(q, "model.safetensors")
    before = hashlib.sha256(open(weights, "rb").read()).hexdigest()
    proc = _child("export_kill", q)
    assert proc.returncode == -signal.SIGKILL and "EXPORTED" not in proc.stdout, proc.stderr[-3000:]
    assert hashlib.sha256(open(weights, "rb").read()).hexdigest() == before  # untouched
    model = AutoModelForCausalLM.from_pretrained(q)
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    proc = _child("export", q)  # and the next export replaces it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [d for d in os.listdir(tmp_path) if d.startswith("q.old")]
