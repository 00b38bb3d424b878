"""``LowBitSFTTrainer`` / ``LowBitSFTConfig``: trl's ``SFTTrainer`` with the low-bit behaviour.

Needs trl (``pip install hf_lowbit[trl]``); ``from trl import ...`` here is the library (imports are absolute:
this module is ``hf_lowbit.trl``, named after what it adapts). ``SFTTrainer`` wraps the model in PEFT in its own
``__init__``: the mixin swaps the modules first and hands it the swapped model with ``peft_config`` (its
``"all-linear"`` resolved to include the quantized bases), so ``get_peft_model`` runs once, over our bases
(``hf_lowbit.LoraLinear``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig, SFTTrainer

from .args import LowBitArgumentsMixin
from .trainer import LowBitTrainerMixin


@dataclass
class LowBitSFTConfig(LowBitArgumentsMixin, SFTConfig):
    """``trl.SFTConfig`` with the low-bit switches of ``LowBitArgumentsMixin``."""

    def _validate_lowbit(self) -> None:
        # first: whatever use_liger_kernel says, SFTTrainer's own fused LM head bypasses a fake-quantized head
        for name, what in (("qat_include_lm_head", "the fake quantization"),
                           ("lowbit_include_lm_head", "the LM head's low-bit matmuls")):
            if getattr(self, name) is True:
                raise ValueError(f"LowBitSFTConfig.{name}=True is not supported: SFTTrainer's fused LM head "
                                 f"multiplies by lm_head.weight directly, bypassing {what}")
        super()._validate_lowbit()


class LowBitSFTTrainer(LowBitTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` whose model is prepared when it is constructed (see ``LowBitTrainerMixin``)."""

    lowbit_args_class = LowBitSFTConfig


__all__ = ["LowBitSFTConfig", "LowBitSFTTrainer"]
