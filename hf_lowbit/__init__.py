"""hf_lowbit: low-bit training (INT8 / FP8 mixed precision, …) for transformers, peft and accelerate."""

from . import _quiet

_quiet.install()  # before transformers imports torchao: drop its known-harmless start-up messages

from .args import LowBitTrainingArguments  # noqa: E402
from .mixed_precision import LowBitLinear, MixedPrecisionConfig, mixed_precision_linear
from .lora import LoraLinear
from .prepare import prepare_model
from .export import push_quantized_to_hub, save_quantized
from .qat import QATConfig, QATLinear, convert_qat, prepare_qat, set_fake_quant_enabled
from .quantized_base import Int8Linear, Nf4Linear, QuantizedBaseConfig, load_quantized_model, quantize_base
from .swap import LinearFilter, SwapReport, swap_linears
from .trainer import LowBitTrainer
from .validation import LowBitWarning, check_training_setup

__version__ = "0.1.0"

__all__ = [
    "LowBitTrainer", "LowBitTrainingArguments", "prepare_model",
    "MixedPrecisionConfig", "LowBitLinear", "mixed_precision_linear",
    "QATConfig", "QATLinear", "prepare_qat", "convert_qat", "set_fake_quant_enabled", "save_quantized",
    "push_quantized_to_hub",
    "LoraLinear", "Nf4Linear", "Int8Linear", "QuantizedBaseConfig", "quantize_base", "load_quantized_model",
    "LinearFilter", "SwapReport", "swap_linears", "LowBitWarning", "check_training_setup",
]
