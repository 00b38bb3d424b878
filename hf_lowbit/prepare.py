"""``prepare_model``: apply the recipes that ``LowBitTrainingArguments`` switch on, in one place.

``LowBitTrainer`` calls this when it is constructed; custom training loops call it themselves,
before ``accelerator.prepare`` / ``torch.compile`` / ``fully_shard``.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from .args import MIXED_PRECISION_RECIPES, LowBitTrainingArguments
from .mixed_precision import LowBitLinear, MixedPrecisionConfig
from .ops.formats import get_format
from .qat import QATConfig, prepare_qat
from .quantized_base import QUANTIZED_LINEARS, QuantizedBaseConfig, quantize_base
from .swap import LinearFilter, SwapReport, swap_linears

logger = logging.getLogger("hf_lowbit")



def apply_recipes(model: nn.Module, args: LowBitTrainingArguments, peft_config=None) -> tuple[nn.Module, list[SwapReport]]:
    """Swap modules as ``args`` asks and attach ``peft_config`` (if any); return the model and reports."""
    if not isinstance(args, LowBitTrainingArguments):
        raise TypeError(f"args must be LowBitTrainingArguments, got {type(args).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    reports = []
    if args.lora_base_quant:  # first: the frozen base is stored quantized and computes as the recipes ask
        if peft_config is None:
            raise ValueError(f"LowBitTrainingArguments.lora_base_quant={args.lora_base_quant!r} freezes and quantizes "
                             "the base linears, which then cannot train: pass peft_config=LoraConfig(...) too")
        compute = (MixedPrecisionConfig(format="int8", output=args.lowbit_output, grad_input=args.lowbit_grad_input,
                                        grad_weight=False) if args.int8_mixed_precision else None)
        config = QuantizedBaseConfig(args.lora_base_quant, compute=compute, int8_cache=args.lora_base_int8_cache)
        reports.append(quantize_base(model, config, LinearFilter(exclude=tuple(args.lowbit_exclude_modules),
                                                                 min_features=args.lowbit_min_features)))
    for recipe in args.lowbit_recipes:
        fmt = MIXED_PRECISION_RECIPES[recipe]
        align = get_format(fmt).alignment
        config = MixedPrecisionConfig(format=fmt, output=args.lowbit_output, grad_input=args.lowbit_grad_input,
                                      grad_weight=args.lowbit_grad_weight)
        linear_filter = LinearFilter(exclude=tuple(args.lowbit_exclude_modules),
                                     min_features=args.lowbit_min_features, multiple_of=align)
        already = (LowBitLinear,) + (QUANTIZED_LINEARS if args.lora_base_quant else ())  # bases set up above
        reports.append(swap_linears(
            model, lambda name, linear: LowBitLinear.from_linear(linear, config), recipe=recipe,
            target=f"{fmt.upper()} matmuls", filter=linear_filter, already=already))
    if args.qat_scheme is not None:
        config = QATConfig(scheme=args.qat_scheme, group_size=args.qat_group_size)
        report = prepare_qat(model, config, exclude=tuple(args.lowbit_exclude_modules),
                             include_lm_head=args.qat_include_lm_head,
                             enabled=args.qat_fake_quant_after_n_steps == 0)
        if not report.swapped and not any(e.reason.startswith("already") for e in report.entries):
            raise ValueError(f"qat_scheme={args.qat_scheme!r}: no linear can be fake-quantized:\n{report.summary()}\n"
                             "lower qat_group_size (it must divide in_features) or check lowbit_exclude_modules")
        reports.append(report)
    if peft_config is not None:  # after the swap: LoRA wraps the low-bit base layers
        from peft import get_peft_model

        from .lora import resolve_all_linear

        resolve_all_linear(model, peft_config)  # PEFT's "all-linear" does not know quantized bases
        model = get_peft_model(model, peft_config)
    return model, reports


def log_reports(reports: list[SwapReport]) -> None:
    """Print each report's summary on the main process and log every entry at INFO."""
    main = int(os.environ.get("RANK", "0")) == 0
    for report in reports:
        if main:
            print(report.summary(), flush=True)
        for e in report.entries:
            logger.info("%s %s %s %s: %s", report.recipe, e.action, e.name, e.shape, e.reason)


def prepare_model(model: nn.Module, args: LowBitTrainingArguments, peft_config=None) -> nn.Module:
    """Return ``model`` prepared for low-bit training as ``args`` describe (maybe a ``PeftModel``).

    Modules are swapped in place; parameters are shared, not copied, and ``state_dict`` keys do not
    change. Prints a report of what was swapped and why the rest was not.
    """
    model, reports = apply_recipes(model, args, peft_config)
    log_reports(reports)
    return model
