"""``prepare_model``: apply the recipes that ``LowBitTrainingArguments`` switch on, in one place.

``LowBitTrainer`` calls this when it is constructed; custom training loops call it themselves,
before ``accelerator.prepare`` / ``torch.compile`` / ``fully_shard``.

Every recipe has one shape: a config that knows its own constraints (``config.filter(base)`` adds
alignment, group or block rules to the base filter) and ``convert(model, config, filter) -> SwapReport``.
:func:`apply_recipes` builds the one base filter from the arguments (:func:`base_filter`), the
``(convert, config)`` pairs they switch on (:func:`recipes_from_args`) and calls them in order.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from torch import nn

from .args import MIXED_PRECISION_RECIPES, LowBitArgumentsMixin
from .mixed_precision import MixedPrecisionConfig, convert_to_mixed_precision
from .qat import QATConfig, convert_to_qat
from .qlora import QuantizedBaseConfig, convert_to_quantized_base
from .swap import LinearFilter, SwapReport

logger = logging.getLogger("hf_lowbit")


def base_filter(args: LowBitArgumentsMixin) -> LinearFilter:
    """The one filter the arguments describe; each recipe's config adds its own shape rules to it."""
    return LinearFilter(exclude=tuple(args.lowbit_exclude_modules), min_features=args.lowbit_min_features)


def recipes_from_args(args: LowBitArgumentsMixin, adapters: bool = False) -> list[tuple[Callable, object]]:
    """``(convert, config)`` of every recipe ``args`` switch on, in the order they are applied (``adapters``: LoRA
    will be attached, which an unset ``lowbit_fused_swiglu`` resolves by).

    The QLoRA base goes first: it is stored quantized and computes as the mixed-precision switches ask
    (INT8 only, no weight gradient: the base is frozen), so the mixed-precision pass then leaves it alone.
    """
    recipes: list[tuple[Callable, object]] = []
    if args.lora_base_quant:
        compute = (MixedPrecisionConfig(format="int8", output=args.lowbit_output, grad_input=args.lowbit_grad_input,
                                        grad_weight=False) if args.int8_mixed_precision else None)
        recipes.append((convert_to_quantized_base, QuantizedBaseConfig(
            args.lora_base_quant, compute=compute, int8_cache=args.lora_base_int8_cache)))
    # unset: MixedPrecisionConfig's defaults (off), never with stochastic rounding (which they cannot serve)
    dual, x_codes = (getattr(MixedPrecisionConfig, f) and not args.lowbit_stochastic_rounding if v is None else v
                     for f, v in (("dual_grad_quant", args.lowbit_dual_grad_quant),
                                  ("save_x_codes", args.lowbit_save_x_codes)))
    for recipe in args.lowbit_recipes:
        recipes.append((convert_to_mixed_precision, MixedPrecisionConfig(
            format=MIXED_PRECISION_RECIPES[recipe], output=args.lowbit_output, grad_input=args.lowbit_grad_input,
            grad_weight=args.lowbit_grad_weight,
            # None (automatic) is LowBitTrainer's to decide: it knows the gradient accumulation
            weight_cache=bool(args.lowbit_weight_cache), stochastic_rounding=args.lowbit_stochastic_rounding,
            dual_grad_quant=dual, save_x_codes=x_codes, include_lm_head=args.lowbit_include_lm_head,
            fused_swiglu=args.resolved_fused_swiglu(adapters))))
    if args.qat_scheme is not None:
        recipes.append((convert_to_qat, QATConfig(
            scheme=args.qat_scheme, group_size=args.qat_group_size, include_lm_head=args.qat_include_lm_head,
            fake_quant_enabled=args.qat_fake_quant_after_n_steps == 0)))
    return recipes


def apply_recipes(model: nn.Module, args: LowBitArgumentsMixin, peft_config=None,
                  attach_peft: bool = True) -> tuple[nn.Module, list[SwapReport]]:
    """Swap modules as ``args`` asks and attach ``peft_config`` (if any); return the model and reports.

    ``attach_peft=False`` leaves ``get_peft_model`` to the caller (trl's trainers call it themselves, with
    their own handling around it) and only resolves ``"all-linear"`` against the swapped model.
    """
    if not isinstance(args, LowBitArgumentsMixin):
        raise TypeError(f"args must be LowBitTrainingArguments (or another LowBitArgumentsMixin class), "
                        f"got {type(args).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if args.lora_base_quant and peft_config is None:
        raise ValueError(f"LowBitTrainingArguments.lora_base_quant={args.lora_base_quant!r} freezes and quantizes "
                         "the base linears, which then cannot train: pass peft_config=LoraConfig(...) too")
    linear_filter = base_filter(args)
    reports = []
    for convert, config in recipes_from_args(args, adapters=peft_config is not None):
        report = convert(model, config, linear_filter)
        if isinstance(config, QATConfig) and not report.swapped and not any(
                e.reason.startswith("already") for e in report.entries):
            rule = ("lower qat_group_size (it must divide in_features; -1: per channel, any in_features), or "
                    if not config.per_channel else
                    f"its kernel needs in and out features that are multiples of {config.spec.alignment}, or "
                    if config.spec.alignment > 1 else "")
            raise ValueError(f"qat_scheme={args.qat_scheme!r}: no linear can be fake-quantized:\n{report.summary()}\n"
                             f"{rule}check lowbit_exclude_modules")
        reports.append(report)
    if peft_config is not None:  # after the swap: LoRA wraps the low-bit base layers
        from peft import get_peft_model

        from .qlora.lora import resolve_all_linear

        resolve_all_linear(model, peft_config)  # PEFT's "all-linear" does not know quantized bases
        if attach_peft:
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


def prepare_model(model: nn.Module, args: LowBitArgumentsMixin, peft_config=None) -> nn.Module:
    """Return ``model`` prepared for low-bit training as ``args`` describe (maybe a ``PeftModel``).

    Modules are swapped in place; parameters are shared, not copied, and ``state_dict`` keys do not
    change. Prints a report of what was swapped and why the rest was not.
    """
    model, reports = apply_recipes(model, args, peft_config)
    log_reports(reports)
    return model
