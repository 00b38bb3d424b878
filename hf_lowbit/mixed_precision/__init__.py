"""Recipe: INT8 / FP8 mixed precision (``int8_mixed_precision`` / ``fp8_mixed_precision`` /
``fp8_tensorwise_mixed_precision``).

Weights, optimizer state and everything else stay in their precision; each trainable ``nn.Linear``'s three
matmuls (``Y = X·Wᵀ``, ``dX = dY·W``, ``dW = dYᵀ·X``) quantize both operands row-wise along the reduction dim
(``fp8_tensorwise``: one scale per operand) and multiply in the format's kernel (docs/design.md, "INT8 / FP8 mixed
precision").

* config: :class:`MixedPrecisionConfig`: the format (a record of :mod:`hf_lowbit.kernels.formats`), which
  matmuls are low-bit, the weight cache, stochastic rounding; ``filter(base)`` adds the format's alignment.
* convert: :func:`convert_to_mixed_precision` ``(model, config, filter) -> SwapReport``, in place (:mod:`.convert`).
* module: :class:`MixedPrecisionLinear` (alias ``LowBitLinear``) and its ``autograd.Function``
  (:func:`mixed_precision_linear`); :func:`set_weight_cache`, :func:`refresh_weight_caches`.
* saves: what ``nn.Linear`` saves. The layer shares the original ``weight`` / ``bias`` and its cached codes
  are non-persistent buffers, so ``state_dict`` keys and tensors are unchanged and checkpoints load into
  stock transformers.
* gradient accumulation (``lowbit_fused_grad_accum``): :mod:`.grad_accum`, each weight's ``.grad`` added into by its
  weight-gradient matmul (:class:`FusedGradAccumulation`).
* the optimizer (``lowbit_fused_adamw``): :mod:`.adamw`, :class:`LowBitAdamW`, AdamW in one Triton pass for each
  large parameter, a pass that leaves a cached weight's row absmax, so that the cache refresh reads it once.
* the MLP (``lowbit_fused_swiglu``): :mod:`.swiglu`, :class:`LowBitSwiGLUMLP`, a Llama-style MLP as one autograd
  function whose SwiGLU and its row codes are one Triton kernel each way.
* FSDP2 (``lowbit_fsdp_lowbit_all_gather``): :mod:`.fsdp_all_gather`, the weight that FSDP2 all-gathers as
  codes + row scales and the layer computes with.

Imports: :mod:`hf_lowbit.kernels` and the core (``swap``, ``compute``, ``warnings``).
"""

from .adamw import LowBitAdamW
from .fsdp_all_gather import GatheredLowBitWeight, LowBitAllGatherWeight
from .grad_accum import FusedGradAccumulation, enable_fused_grad_accumulation
from .convert import convert_to_mixed_precision
from .linear import (LowBitLinear, MixedPrecisionConfig, MixedPrecisionLinear, mixed_precision_linear,
                     refresh_weight_caches, set_weight_cache)
from .swiglu import LowBitSwiGLUMLP, fuse_swiglu_mlps

__all__ = ["MixedPrecisionConfig", "MixedPrecisionLinear", "LowBitLinear", "mixed_precision_linear",
           "convert_to_mixed_precision", "set_weight_cache", "refresh_weight_caches", "LowBitAllGatherWeight",
           "GatheredLowBitWeight", "FusedGradAccumulation", "enable_fused_grad_accumulation", "LowBitAdamW",
           "LowBitSwiGLUMLP", "fuse_swiglu_mlps"]
