"""The command line's first hour: an honest, short --help, a quiet start, user mistakes that end in one
line naming the --flag or the file and line (exit status 2, no traceback), data checked before the
model loads, the hf-lowbit-sft entry point, QLoRA's one-line report."""

import json
import os
import subprocess
import sys

import pytest

from hf_lowbit.data import ARITHMETIC_CHARS, build_char_tokenizer
from hf_lowbit.cli.sft import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "scripts", "sft.py")


def _user_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def tokenizer_only_dir(tmp_path_factory):
    """A directory with a tokenizer and no model: a run that loaded the model before the data would fail on it."""
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(ARITHMETIC_CHARS).save_pretrained(d)
    return str(d)


def test_flag_mistakes_name_the_flag(capsys):
    err = _user_error(capsys, ["--int8_mixed_precision", "--fp8_mixed_precision"])
    assert "--int8_mixed_precision and --fp8_mixed_precision are both True" in err
    assert "LowBitTrainingArguments" not in err
    assert "--max_steps must be > 0, or -1" in _user_error(capsys, ["--max_steps", "-5"])
    assert "--max_steps" in _user_error(capsys, ["--max_steps", "0"])
    assert "--per_device_train_batch_size must be >= 1" in _user_error(capsys, ["--per_device_train_batch_size", "0"])
    assert "--qat_scheme='int3' is not a QAT scheme" in _user_error(capsys, ["--qat_scheme", "int3"])
    assert "--lora_r must be >= 1" in _user_error(capsys, ["--lora_r", "0"])
    assert "--block_size must be >= 2" in _user_error(capsys, ["--block_size", "1"])
    assert "--streaming needs --max_steps" in _user_error(
        capsys, ["--model_name_or_path", "m", "--dataset", "d.jsonl", "--streaming"])
    assert "--dataset and --token_files" in _user_error(
        capsys, ["--model_name_or_path", "m", "--dataset", "d.jsonl", "--token_files", "t"])
    assert "--model_name_or_path needs --dataset" in _user_error(capsys, ["--model_name_or_path", "m"])


def test_data_mistakes_name_file_and_line_before_the_model_loads(capsys, tmp_path, tokenizer_only_dir):
    common = ["--model_name_or_path", tokenizer_only_dir, "--output_dir", str(tmp_path / "o"), "--max_steps", "1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    err = _user_error(capsys, common + ["--dataset", str(bad)])
    assert "bad.jsonl, line 2: invalid JSON" in err
    records = tmp_path / "rec.jsonl"  # line 101: a record of no known format (after 100 good ones)
    records.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) for i in range(100))
                       + '\n{"question": "?"}\n')
    assert "rec.jsonl, line 101: unrecognised record with keys ['question']" in _user_error(
        capsys, common + ["--dataset", str(records)])
    assert "rec.jsonl, line 101" in _user_error(capsys, common + ["--dataset", str(records), "--streaming"])
    assert "no such file" in _user_error(capsys, common + ["--dataset", str(tmp_path / "missing.jsonl")])
    tokens = tmp_path / "t.bin"
    tokens.write_bytes(b"\x01\x00\x02")
    assert "t.bin: 3 bytes is not a whole number of uint16 tokens" in _user_error(
        capsys, common + ["--token_files", str(tokens)])
    # good data, then the missing model: the one-line error names the flag
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"{i}+{i}={2 * i}"}) for i in range(200)))
    err = _user_error(capsys, common + ["--dataset", str(good), "--block_size", "16"])
    assert f"--model_name_or_path {tokenizer_only_dir!r}: no model could be loaded" in err


def test_help_is_short_honest_and_quiet(sft_help):
    proc = sft_help
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert len(out.splitlines()) < 393  # 359 before fp8_tensorwise_mixed_precision (5 lines), 364 with it, 370 with
    # lowbit_include_lm_head (6), 376 with lowbit_skip_causal_mask (6: its --no_ form too), 381 with
    # lowbit_fused_grad_accum (5), 386 with lowbit_fused_adamw (5), 391 with lowbit_fused_swiglu (5), 390 with both
    # levers on by default (their help shortened)
    # the low-bit flags come first, before any TrainingArguments flag
    options = out[out.index("low-bit recipes (hf_lowbit):"):]
    assert options.index("--int8_mixed_precision") < options.index("--model_name_or_path") < options.index("--learning_rate")
    int8 = options[options.index("--int8_mixed_precision"):options.index("--fp8_mixed_precision")]
    assert "(default: False)" in int8
    assert "(default: trainer_output)" in options and "(default: -1)" in options  # output_dir, max_steps
    assert "--output_dir runs/sft-default --int8_mixed_precision --max_steps 1000" in out  # the embedded run, apart
    assert "--adam_beta1" not in out and "--help_all" in out
    # a quiet start: no torchao extension failures, no register_constant deprecation, no warnings
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr, proc.stderr
    full = subprocess.run([sys.executable, SFT, "--help_all"], capture_output=True, text=True, timeout=300)
    assert full.returncode == 0 and "--adam_beta1" in full.stdout


def test_console_script_entry_point():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert '[project.scripts]\nhf-lowbit-sft = "hf_lowbit.cli.sft:cli"' in text  # (no tomllib on Python 3.10)
    exe = os.path.join(os.path.dirname(sys.executable), "hf-lowbit-sft")
    if os.path.exists(exe):  # installed by `pip install -e .` (make test on a fresh machine)
        proc = subprocess.run([exe, "--max_steps", "-5"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.strip().endswith("got -5") and "Traceback" not in proc.stderr


def test_qlora_with_int8_compute_reports_in_one_line(capsys):
    from peft import LoraConfig

    from conftest import tiny_model
    from hf_lowbit import LowBitTrainingArguments, prepare_model

    args = LowBitTrainingArguments(output_dir="unused", lora_base_quant="nf4", int8_mixed_precision=True,
                                   lowbit_min_features=16)
    prepare_model(tiny_model(), args, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    out = capsys.readouterr().out
    assert "[hf_lowbit] lora_base_quant: 14 modules swapped" in out
    lines = [line for line in out.splitlines() if "int8_mixed_precision" in line]
    assert len(lines) == 1 and "0 modules swapped" not in out
    assert "nothing further to swap; 14 modules are already" in lines[0]
