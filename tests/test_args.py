"""LowBitTrainingArguments: validation errors name the field; every field is a CLI flag."""

import pytest
from transformers import HfArgumentParser

from hf_lowbit import LowBitTrainingArguments


@pytest.mark.parametrize("kw,match", [
    (dict(lowbit_min_features=0), "lowbit_min_features"),
    (dict(lowbit_min_features="big"), "lowbit_min_features"),
    (dict(lowbit_exclude_modules=["lm_head", ""]), "lowbit_exclude_modules"),
    (dict(int8_mixed_precision="yes"), "int8_mixed_precision"),
    (dict(int8_mixed_precision=True, fp8_mixed_precision=True), "choose one"),
    (dict(int8_mixed_precision=True, lowbit_output=False, lowbit_grad_input=False, lowbit_grad_weight=False),
     "quantizes nothing"),
    (dict(qat_scheme="8da4w", lora_base_quant="nf4"), "qat_scheme='8da4w' with lora_base_quant='nf4'"),
])
def test_bad_arguments_name_the_field(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LowBitTrainingArguments(output_dir="unused", report_to="none", **kw)


def test_cli_flags():
    parser = HfArgumentParser(LowBitTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(args=[
        "--output_dir", "o", "--int8_mixed_precision", "--no_lowbit_grad_weight",
        "--lowbit_exclude_modules", "lm_head", "*.gate_proj", "--lowbit_min_features", "256", "--report_to", "none"])
    assert args.int8_mixed_precision and not args.lowbit_grad_weight and args.lowbit_output
    assert args.lowbit_exclude_modules == ["lm_head", "*.gate_proj"] and args.lowbit_min_features == 256
    assert args.lowbit_recipes == ["int8_mixed_precision"]
    help_text = parser.format_help()
    for flag in ("--int8_mixed_precision", "--lowbit_grad_input", "--lowbit_exclude_modules"):
        assert flag in help_text


def test_string_exclude_becomes_list():
    args = LowBitTrainingArguments(output_dir="unused", report_to="none", lowbit_exclude_modules="lm_head")
    assert args.lowbit_exclude_modules == ["lm_head"]
