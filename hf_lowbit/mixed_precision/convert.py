"""The mixed-precision recipe's convert: :func:`convert_to_mixed_precision` swaps eligible ``nn.Linear`` for
:class:`~hf_lowbit.mixed_precision.linear.MixedPrecisionLinear` and, with ``fused_swiglu``, Llama-style MLPs for
:class:`~hf_lowbit.mixed_precision.swiglu.LowBitSwiGLUMLP` (a module of its own: the MLP builds on the layer)."""

from __future__ import annotations

from torch import nn

from ..swap import LinearFilter, SwapReport, including_output_embeddings, swap_linears
from .linear import MixedPrecisionConfig, MixedPrecisionLinear
from .swiglu import fuse_swiglu_mlps


def convert_to_mixed_precision(model: nn.Module, config: MixedPrecisionConfig,
                               filter: LinearFilter = LinearFilter()) -> SwapReport:
    """Replace each eligible ``nn.Linear`` of ``model`` by a :class:`MixedPrecisionLinear`, in place.

    ``filter`` gets the format's alignment (:meth:`MixedPrecisionConfig.filter`). Layers that are
    mixed precision already, and frozen quantized bases given INT8 compute by the QLoRA recipe, are
    reported as such and left alone. ``config.weight_cache`` switches the swapped layers' weight cache on.
    ``config.include_lm_head``: the output embedding too, patterns that name it dropped
    (:func:`~hf_lowbit.swap.including_output_embeddings`, as QAT's); a tied head keeps the input embedding's
    Parameter (the swap shares parameters), so both gradients still accumulate into it. ``config.fused_swiglu``: then
    each Llama-style MLP of three swapped linears becomes a :class:`~hf_lowbit.mixed_precision.swiglu.LowBitSwiGLUMLP`
    (the report lists each MLP, fused or skipped with why).
    """
    def make(name, linear):
        layer = MixedPrecisionLinear.from_linear(linear, config)
        if config.weight_cache:
            layer.set_weight_cache(True)
        return layer

    linear_filter = config.filter(filter)
    if config.include_lm_head:
        linear_filter = including_output_embeddings(model, linear_filter)
    report = swap_linears(model, make, recipe=config.recipe, target=f"{config.format.upper()} matmuls",
                          filter=linear_filter, already=_low_bit_already)
    if config.fused_swiglu:
        fuse_swiglu_mlps(model, config, report)
    return report


def _low_bit_already(module: nn.Module) -> bool:
    """A mixed-precision layer, or a module told to compute by one of our configs: a QLoRA base with INT8 compute
    (its ``compute``; recognised by the config, so this recipe needs no import of the QLoRA one, which uses it)."""
    return isinstance(module, MixedPrecisionLinear) or isinstance(getattr(module, "compute", None),
                                                                  MixedPrecisionConfig)
