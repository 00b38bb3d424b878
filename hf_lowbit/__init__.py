"""hf_lowbit: low-bit training (INT8 / FP8 mixed precision, …) for transformers, peft and accelerate."""

from . import _moved, _quiet

_quiet.install()  # before transformers imports torchao: drop its known-harmless start-up messages
_moved.install()  # old module paths (hf_lowbit.quantized_base, hf_lowbit.ops, ...) keep working until 0.2

from .args import LowBitArgumentsMixin, LowBitTrainingArguments  # noqa: E402
from .compute import compute_dtype  # noqa: E402
from .mixed_precision import (FusedGradAccumulation, LowBitAdamW, LowBitLinear, LowBitSwiGLUMLP,  # noqa: E402
                              MixedPrecisionConfig, MixedPrecisionLinear, convert_to_mixed_precision,
                              enable_fused_grad_accumulation,
                              mixed_precision_linear, refresh_weight_caches, set_weight_cache)
from .prepare import prepare_model  # noqa: E402
from .qat import (QATConfig, QATLinear, convert_qat, convert_to_qat, prepare_qat, push_quantized_to_hub,  # noqa: E402
                  save_quantized, set_fake_quant_enabled)
from .qlora import (Int8Linear, LoraLinear, Nf4Linear, QuantizedBaseConfig, convert_to_quantized_base,  # noqa: E402
                    load_quantized_model, quantize_base, register_with_peft)
from .swap import LinearFilter, SwapReport, swap_linears  # noqa: E402
from .trainer import LowBitTrainer, LowBitTrainerMixin  # noqa: E402
from .warnings import LowBitWarning, UnsupportedSetupError, check_training_setup  # noqa: E402

# PEFT picks hf_lowbit.LoraLinear for the quantized bases (get_peft_model, PeftModel.from_pretrained, …)
# through a dispatcher put in front of its own; see register_with_peft and docs/design.md.
register_with_peft()

__version__ = "0.1.0"

_TRL_NAMES = ("LowBitSFTTrainer", "LowBitSFTConfig")


def __getattr__(name):
    """``LowBitSFTTrainer`` / ``LowBitSFTConfig`` on first use: importing trl is slow and it is optional. A moved
    module's old name (``hf_lowbit.quantized_base``) is the module at its new path."""
    if name in _TRL_NAMES:
        try:
            from . import trl
        except ImportError as e:
            raise ImportError(f"hf_lowbit.{name} needs trl: pip install 'hf_lowbit[trl]' ({e})") from e
        return getattr(trl, name)
    if name in _moved.MOVED:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'hf_lowbit' has no attribute {name!r}")


__all__ = [
    "LowBitTrainer", "LowBitTrainerMixin", "LowBitTrainingArguments", "LowBitArgumentsMixin", "prepare_model",
    "compute_dtype",
    "MixedPrecisionConfig", "MixedPrecisionLinear", "LowBitLinear", "mixed_precision_linear",
    "convert_to_mixed_precision", "set_weight_cache", "refresh_weight_caches", "FusedGradAccumulation",
    "enable_fused_grad_accumulation", "LowBitAdamW", "LowBitSwiGLUMLP",
    "QATConfig", "QATLinear", "convert_to_qat", "prepare_qat", "convert_qat", "set_fake_quant_enabled",
    "save_quantized", "push_quantized_to_hub",
    "LoraLinear", "register_with_peft", "Nf4Linear", "Int8Linear", "QuantizedBaseConfig",
    "convert_to_quantized_base", "quantize_base", "load_quantized_model",
    "LinearFilter", "SwapReport", "swap_linears", "LowBitWarning", "UnsupportedSetupError", "check_training_setup",
]
