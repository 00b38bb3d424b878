"""Nothing lost at any kill point: ``hf-lowbit-sft`` on its embedded default, SIGKILLed mid-step, mid-checkpoint,
mid-final-save and mid-export, then the same command run again (tests/_fault_child.py runs it).

After every kill each directory the run left either loads or is named ``.tmp-*`` (incomplete, never picked by
resume, removed by the next save into the same place); the next run resumes from the last complete checkpoint
(or starts over where there is none) and logs the losses of the uninterrupted run: exactly, since one process
with one thread repeats the same arithmetic on the same restored weights, optimizer state, RNG and data position.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
# the embedded default (INT8), made short: 6 steps, a checkpoint every 2
RUN = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
       "--arithmetic_train_records", "400", "--arithmetic_eval_records", "8", "--eval_strategy", "no",
       "--disable_tqdm", "True"]
QAT = ["--int8_mixed_precision", "False", "--qat_scheme", "8da4w"]


def _sft(phase: str, out, *flags) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the same thread count in every run: the same float sums
    return subprocess.run([sys.executable, os.path.join(HERE, "_fault_child.py"), phase, *RUN, *flags,
                           "--output_dir", str(out)], capture_output=True, text=True, timeout=600, cwd=HERE, env=env)


def _killed(proc) -> None:
    assert proc.returncode == -signal.SIGKILL and "COMPLETED" not in proc.stdout, proc.stderr[-3000:]


def _completed(proc) -> None:
    assert proc.returncode == 0 and "COMPLETED" in proc.stdout, proc.stderr[-3000:]


def _losses(proc) -> dict[int, float]:
    return {int(step): float(v) for step, v in re.findall(r"^LOSS (\d+) (\S+)$", proc.stdout, re.M)}


def _resumed_from(proc) -> str | None:
    found = re.search(r"^\[hf_lowbit\] resuming from (\S+)", proc.stdout, re.M)
    return found and os.path.basename(found.group(1))


def _checkpoints(out) -> list[str]:
    return sorted((d for d in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", d)), key=lambda d: int(d[11:]))


def _check_left_on_disk(out) -> None:
    """Every directory under ``out`` loads or is named incomplete: checkpoints load with stock transformers and
    hold what resuming reads; ``out`` itself is a model only when it has its config.json (then it loads), and
    model files without one come with the ``.tmp-model`` that names the interrupted save."""
    from transformers import AutoModelForCausalLM

    for d in os.listdir(out):
        path = os.path.join(out, d)
        if not os.path.isdir(path) or d.startswith(".tmp-"):
            continue
        assert re.fullmatch(r"checkpoint-\d+|quantized", d), d
        AutoModelForCausalLM.from_pretrained(path)
        if d.startswith("checkpoint-"):
            assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= set(os.listdir(path))
    files = {f for f in os.listdir(out) if os.path.isfile(os.path.join(out, f))}
    if "config.json" in files:
        AutoModelForCausalLM.from_pretrained(out)
    elif files - {"sft_metrics.json"}:  # files of a model save, but not the one that makes it a model
        assert os.path.isdir(os.path.join(out, ".tmp-model")), files


def _no_leftovers(*dirs) -> None:
    for d in dirs:
        assert not [f for f in os.listdir(d) if f.startswith(".tmp-")], os.listdir(d)


@pytest.mark.slow
def test_kill_at_each_phase_then_the_same_command_resumes(tmp_path):
    ref, out = tmp_path / "uninterrupted", tmp_path / "run"
    full = _sft("none", ref)
    _completed(full)
    expected = _losses(full)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    proc = _sft("step", out)  # killed inside step 3: checkpoint-2 is the last
    _killed(proc)
    assert _losses(proc) == {s: expected[s] for s in (1, 2)} and _resumed_from(proc) is None
    assert _checkpoints(out) == ["checkpoint-2"]
    _check_left_on_disk(out)

    proc = _sft("checkpoint", out)  # resumes from 2; killed writing checkpoint-4
    _killed(proc)
    assert _resumed_from(proc) == "checkpoint-2" and _losses(proc) == {s: expected[s] for s in (3, 4)}
    assert _checkpoints(out) == ["checkpoint-2"] and os.path.isdir(out / ".tmp-checkpoint-4")
    _check_left_on_disk(out)

    proc = _sft("final_write", out)  # resumes from 2 again, saves 4 and 6; killed writing the final model
    _killed(proc)
    assert _resumed_from(proc) == "checkpoint-2" and _losses(proc) == {s: expected[s] for s in (3, 4, 5, 6)}
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / "config.json").exists() and (out / ".tmp-model").is_dir()
    _no_leftovers(out / "checkpoint-4")  # the earlier killed checkpoint-4's staging was removed
    assert not (out / ".tmp-checkpoint-4").exists()
    _check_left_on_disk(out)

    proc = _sft("final_publish", out)  # resumes from 6 (no step left); killed moving the final model into place
    _killed(proc)
    assert _resumed_from(proc) == "checkpoint-6" and _losses(proc) == {}
    assert not (out / "config.json").exists() and (out / ".tmp-model").is_dir()
    assert [f for f in os.listdir(out) if os.path.isfile(out / f)]  # a file of the new model is already in place
    _check_left_on_disk(out)

    proc = _sft("none", out)
    _completed(proc)
    assert _resumed_from(proc) == "checkpoint-6"
    _check_left_on_disk(out)
    _no_leftovers(out)
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    with open(out / "sft_metrics.json") as f, open(ref / "sft_metrics.json") as g:
        assert json.load(f)["train_losses"] == json.load(g)["train_losses"] == [expected[s] for s in range(1, 7)]
    final, want = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert final.keys() == want.keys() and all((final[k] == want[k]).all() for k in want)


@pytest.mark.slow
def test_kill_during_export_keeps_the_previous_one_and_the_next_export_cleans_up(tmp_path):
    pytest.importorskip("torchao")
    from transformers import AutoModelForCausalLM

    ref, out = tmp_path / "uninterrupted", tmp_path / "run"
    full = _sft("none", ref, *QAT)
    _completed(full)

    proc = _sft("export", out, *QAT)  # the first export, killed while written
    _killed(proc)
    assert not (out / "quantized").exists() and (out / ".tmp-quantized").is_dir()
    _check_left_on_disk(out)

    proc = _sft("none", out, *QAT)  # the same command: resumes from checkpoint-6, exports, removes the leftover
    _completed(proc)
    assert _resumed_from(proc) == "checkpoint-6"
    _no_leftovers(out)
    exported, want = load_file(str(out / "quantized" / "model.safetensors")), load_file(
        str(ref / "quantized" / "model.safetensors"))
    assert exported.keys() == want.keys() and all((exported[k] == want[k]).all() for k in want)

    weights = out / "quantized" / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    proc = _sft("export", out, *QAT)  # replacing an export, killed mid-write: the previous one is untouched
    _killed(proc)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    model = AutoModelForCausalLM.from_pretrained(out / "quantized")
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    _check_left_on_disk(out)
