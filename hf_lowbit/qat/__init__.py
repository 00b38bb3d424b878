"""Recipe: quantization-aware training (``qat_scheme``), and the export that plain transformers loads.

Fake-quantize during fine-tuning, convert with torchao, save a checkpoint ``from_pretrained`` loads
(docs/qat.md).

* config: :class:`QATConfig`: a scheme of :data:`QAT_SCHEMES` (``"8da4w"``, ``"int4_weight_only"`` for ExecuTorch /
  CPU; ``"int4_tinygemm"``, ``"fp8_rowwise"`` for NVIDIA GPUs) and the weight group size (:data:`PER_CHANNEL`, -1: one
  scale per weight row); ``filter(base)`` requires the group to divide ``in_features`` (per channel: no rule; row-wise
  FP8: features multiples of 16) and drops the size floor;
  :func:`cuda_capability_problem` says why a GPU cannot run a scheme's converted kernels.
* convert: :func:`convert_to_qat` ``(model, config, filter) -> SwapReport``, in place (:func:`prepare_qat`: the
  same from an exclude list); :class:`FakeQuantScheduleCallback` delays fake quant N steps; after training
  :func:`convert_qat` turns the fake-quantized layers into torchao's quantized weights.
* module: :class:`QATLinear` and its ``autograd.Function`` (:func:`qat_linear`; straight-through gradients).
* saves: while training, what ``nn.Linear`` saves (same parameters and keys); :func:`save_quantized`
  (:mod:`.export`) writes the converted model: ``model.safetensors`` with torchao's tensor-subclass metadata, a
  ``TorchAoConfig`` in ``config.json``, the tokenizer and a model card, swapped in atomically;
  :func:`push_quantized_to_hub` uploads exactly those files.
* serve: :func:`prepare_for_serving` (:mod:`.serving`, torch and transformers only: a serving script can copy the
  file) unwraps the loaded export's torchao weights to plain tensors rebuilt in the graph and returns ``generate``'s
  compile config with Dynamo's nn-module guards skipped: less host work per decoded token (docs/qat.md § Serving);
  :func:`defer_stop_check` lets ``generate`` on CUDA prepare the next token while the GPU computes this one.

Imports: :mod:`hf_lowbit.kernels` and the core.
"""

from .linear import (PER_CHANNEL, QAT_SCHEMES, FakeQuantScheduleCallback, QATConfig, QATLinear, QATScheme, convert_qat,
                     convert_to_qat, cuda_capability_problem, fake_quant_enabled_at, get_scheme, prepare_qat,
                     qat_linear, set_fake_quant_enabled)
from .export import merge_lora, push_quantized_to_hub, save_quantized
from .serving import (defer_stop_check, deferred_stop_check, has_deferred_stop_check, prepare_for_serving,
                      serving_compile_config, unwrap_quantized_weights)

__all__ = ["QAT_SCHEMES", "PER_CHANNEL", "QATScheme", "QATConfig", "QATLinear", "qat_linear", "convert_to_qat",
           "prepare_qat", "convert_qat", "cuda_capability_problem", "set_fake_quant_enabled", "fake_quant_enabled_at",
           "FakeQuantScheduleCallback", "get_scheme",
           "save_quantized", "push_quantized_to_hub", "merge_lora",
           "defer_stop_check", "deferred_stop_check", "has_deferred_stop_check", "prepare_for_serving",
           "serving_compile_config", "unwrap_quantized_weights"]
