"""hf_lowbit: low-bit training (INT8 / FP8 mixed precision, …) for transformers, peft and accelerate."""

from . import _quiet

_quiet.install()  # before transformers imports torchao: drop its known-harmless start-up messages

from .args import LowBitArgumentsMixin, LowBitTrainingArguments  # noqa: E402
from .compute import compute_dtype  # noqa: E402
from .mixed_precision import (LowBitLinear, MixedPrecisionConfig, MixedPrecisionLinear,  # noqa: E402
                              convert_to_mixed_precision, mixed_precision_linear, refresh_weight_caches,
                              set_weight_cache)
from .lora import LoraLinear, register_with_peft  # noqa: E402
from .prepare import prepare_model  # noqa: E402
from .export import push_quantized_to_hub, save_quantized
from .loading import load_quantized_model
from .qat import QATConfig, QATLinear, convert_qat, convert_to_qat, prepare_qat, set_fake_quant_enabled
from .quantized_base import Int8Linear, Nf4Linear, QuantizedBaseConfig, convert_to_quantized_base, quantize_base
from .swap import LinearFilter, SwapReport, swap_linears
from .trainer import LowBitTrainer, LowBitTrainerMixin
from .validation import LowBitWarning, UnsupportedSetupError, check_training_setup

# PEFT picks hf_lowbit.LoraLinear for the quantized bases (get_peft_model, PeftModel.from_pretrained, …)
# through a dispatcher put in front of its own; see register_with_peft and docs/design.md.
register_with_peft()

__version__ = "0.1.0"

_TRL_NAMES = ("LowBitSFTTrainer", "LowBitSFTConfig")


def __getattr__(name):
    """``LowBitSFTTrainer`` / ``LowBitSFTConfig`` on first use: importing trl is slow and it is optional."""
    if name in _TRL_NAMES:
        try:
            from . import trl_trainer
        except ImportError as e:
            raise ImportError(f"hf_lowbit.{name} needs trl: pip install 'hf_lowbit[trl]' ({e})") from e
        return getattr(trl_trainer, name)
    raise AttributeError(f"module 'hf_lowbit' has no attribute {name!r}")


__all__ = [
    "LowBitTrainer", "LowBitTrainerMixin", "LowBitTrainingArguments", "LowBitArgumentsMixin", "prepare_model",
    "compute_dtype",
    "MixedPrecisionConfig", "MixedPrecisionLinear", "LowBitLinear", "mixed_precision_linear",
    "convert_to_mixed_precision", "set_weight_cache", "refresh_weight_caches",
    "QATConfig", "QATLinear", "convert_to_qat", "prepare_qat", "convert_qat", "set_fake_quant_enabled",
    "save_quantized", "push_quantized_to_hub",
    "LoraLinear", "register_with_peft", "Nf4Linear", "Int8Linear", "QuantizedBaseConfig",
    "convert_to_quantized_base", "quantize_base", "load_quantized_model",
    "LinearFilter", "SwapReport", "swap_linears", "LowBitWarning", "UnsupportedSetupError", "check_training_setup",
]
