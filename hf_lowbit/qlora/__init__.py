"""Recipe: QLoRA bases (``lora_base_quant``), LoRA over them, and loading a checkpoint straight into them.

A frozen base linear stores its weight quantized in its own module; LoRA wraps it from outside; INT8 compute
is a switch on it. Storage and compute stay separate concerns (docs/qlora.md).

* config: :class:`QuantizedBaseConfig`: the storage (``"nf4"`` or ``"int8"``), optional INT8 compute (a
  ``MixedPrecisionConfig`` of format ``"int8"``), the NF4 base's INT8 cache; ``filter(base)`` adds NF4's
  64-element block.
* convert: :func:`convert_to_quantized_base` ``(model, config, filter) -> SwapReport``, in place (alias
  ``quantize_base``); :func:`load_quantized_model` builds a model from a safetensors checkpoint with its
  linears quantized as they load (:mod:`.loading`).
* module: :class:`Nf4Linear`, :class:`Int8Linear` (:mod:`.base`); :class:`LoraLinear` (:mod:`.lora`), the
  PEFT LoRA layer over them, which PEFT picks through the dispatcher :func:`register_with_peft` puts in front
  of its own (``import hf_lowbit`` calls it).
* saves: the codes and scales under the base's own keys (``…q_proj.qweight``, ``…qscale``, ``…scale_factor``,
  ``…scale_mean``; ``Int8Linear``: ``qweight``, ``scale``); a trainer saves the PEFT adapter only, and
  ``merge_and_unload`` dequantizes into plain ``nn.Linear`` layers that stock transformers saves and loads.

Imports: :mod:`hf_lowbit.kernels`, the core, and ``hf_lowbit.mixed_precision``'s config (type only).
"""

from .base import (BASE_STORAGES, QUANTIZED_LINEARS, Int8Linear, Nf4Linear, QuantizedBaseConfig, QuantizedBaseLinear,
                   QuantizedLinear, convert_to_quantized_base, quantize_base)
from .loading import load_quantized_model
from .lora import LoraLinear, dispatch_lowbit, register_with_peft, resolve_all_linear

__all__ = ["BASE_STORAGES", "QUANTIZED_LINEARS", "Int8Linear", "Nf4Linear", "QuantizedBaseConfig",
           "QuantizedBaseLinear", "QuantizedLinear", "convert_to_quantized_base", "quantize_base",
           "load_quantized_model", "LoraLinear", "dispatch_lowbit", "register_with_peft", "resolve_all_linear"]
