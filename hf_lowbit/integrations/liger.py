"""Liger Kernel beside the low-bit swaps: which modules each owns, and the one place they conflict.

``use_liger_kernel=True`` is ``TrainingArguments``' own flag; transformers (5.17) applies it at the start of
``Trainer.train()`` through ``transformers.integrations.liger.apply_liger_kernel`` →
``liger_kernel.transformers._apply_liger_kernel_to_instance``. For a Llama-style model Liger patches
*forwards*, never linears:

* RMSNorm modules and the SwiGLU MLP get Liger's ``forward`` bound on the instance. The MLP's new forward
  still calls its own ``gate_proj`` / ``up_proj`` / ``down_proj``, so INT8/FP8 linears and QLoRA bases there
  keep computing; Liger only fuses the SiLU-and-multiply between them.
* RoPE: the modeling module's ``apply_rotary_pos_emb`` function is replaced (attention projections untouched).
* Fused linear cross-entropy (FLCE) replaces the causal LM's ``forward``: it multiplies the last hidden states
  by ``lm_head.weight`` itself, chunk by chunk, so the LM head's module ``forward`` never runs.

So the two compose when the LM head is a plain ``nn.Linear``, which every recipe leaves it (the output
embedding is not swapped) except QAT's ``qat_include_lm_head`` and ``lowbit_include_lm_head`` (both refused with
FLCE in the arguments); a LoRA adapter on the head would be bypassed the same way. ``LowBitTrainerMixin`` applies
Liger itself at the end of its ``__init__`` (after our swaps and after the base class — trl's ``SFTTrainer`` turns
FLCE off there), so ``trainer.model`` shows the result and ``trainer.lowbit_reports`` ends with
:func:`liger_report`; ``train()`` applying it again changes nothing.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

from ..args import FLCE_OFF, fused_cross_entropy_requested
from ..swap import PATCHED, SwapEntry, SwapReport, _shape
from ..warnings import LowBitWarning


def _unwrap(model: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` inside a ``PeftModel`` (what transformers hands to Liger)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _from_liger(fn) -> bool:
    return (getattr(fn, "__module__", None) or "").startswith("liger_kernel")


def fused_head_active(model: nn.Module) -> bool:
    """Whether Liger's fused linear cross-entropy has replaced the model's ``forward``."""
    return _from_liger(getattr(_unwrap(model).forward, "__func__", None))


def liger_report(model: nn.Module) -> SwapReport:
    """What Liger owns in ``model`` (names relative to the ``PreTrainedModel``, as in the recipes' reports)."""
    base = _unwrap(model)
    report = SwapReport(recipe="liger")
    modeling = sys.modules.get(type(base).__module__)
    rope = modeling is not None and _from_liger(getattr(modeling, "apply_rotary_pos_emb", None))
    for name, m in base.named_modules():
        liger = m._get_name()
        if liger.startswith("Liger"):  # Liger binds _get_name on the instances it patches (or built the class)
            projections = sorted({type(c).__name__ for n, c in m.named_children() if n.endswith("_proj")})
            why = (f"{liger}: Liger's fused SiLU-and-multiply between its own projections ({', '.join(projections)})"
                   if projections else f"{liger}: Liger's kernel")
            report.entries.append(SwapEntry(name, type(m).__name__, _shape(m), PATCHED, why))
        elif rope and name.endswith("self_attn"):
            report.entries.append(SwapEntry(name, type(m).__name__, (), PATCHED,
                                            "rotary embedding by Liger's RoPE kernel (projections as above)"))
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is not None and fused_head_active(base):
        name = next(n for n, m in base.named_modules() if m is head)
        report.entries.append(SwapEntry(name, type(head).__name__, _shape(head), PATCHED,
                                        "Liger's fused linear cross-entropy reads its weight directly (LM head + loss "
                                        "in one kernel, no logits); kept in the compute dtype"))
    return report


def check_fused_head(model: nn.Module) -> None:
    """Refuse an LM head that Liger's fused linear cross-entropy would bypass (it reads ``lm_head.weight``)."""
    base = _unwrap(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not fused_head_active(base):
        return
    inner = getattr(getattr(head, "modules_to_save", None), "default", head)  # PEFT modules_to_save: Liger unwraps it
    if type(inner) is nn.Linear:
        return
    what = ("a LoRA adapter on the LM head (peft_config targets it): it would never train"
            if hasattr(inner, "lora_A") else
            "a fake-quantized LM head (qat_include_lm_head=True): the fake quantization would never apply"
            if type(inner).__name__ == "QATLinear" else
            f"an LM head of type {type(inner).__name__}: its own forward would never run")
    raise ValueError(f"use_liger_kernel=True with {what}. Liger's fused linear cross-entropy multiplies the hidden "
                     f"states by lm_head.weight directly. Pass {FLCE_OFF} (Liger's other kernels still apply) "
                     "or leave the LM head a plain nn.Linear")


def apply_liger(model: nn.Module, kernel_config: dict | None) -> SwapReport:
    """Apply Liger as ``Trainer.train()`` will (same function, same config), check the LM head, report."""
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, kernel_config)
    check_fused_head(model)
    report = liger_report(model)
    if not report.entries:
        model_type = getattr(getattr(_unwrap(model), "config", None), "model_type", None)
        warnings.warn(f"use_liger_kernel=True: Liger patched nothing in this {model_type!r} model "
                      "(no Liger kernels for its type, or all switched off in liger_kernel_config)",
                      LowBitWarning, stacklevel=3)
    return report


__all__ = ["apply_liger", "check_fused_head", "fused_cross_entropy_requested", "fused_head_active", "liger_report"]
