"""``LoraLinear``: PEFT's LoRA layer over a separate frozen base linear (plain, NF4 or INT8).

The base layer computes ``x · Wᵀ`` however it stores ``W`` and whatever compute it was told to use
(:mod:`hf_lowbit.qlora.base`); the LoRA branch ``B(A(dropout(x))) · scaling`` runs beside it in
the same compute dtype (autocast's, else the input's), with the adapter weights kept in their own dtype
(float32 by PEFT's default). Because the two never share an ``F.linear``, INT8 compute on the base
composes with LoRA.

Registration: ``hf_lowbit/__init__.py`` calls :func:`register_with_peft` once, which adds a dispatcher
in front of PEFT's LoRA dispatchers, so
``get_peft_model``, ``PeftModel.from_pretrained``, ``load_adapter`` / ``add_adapter`` (several
adapters) pick ``LoraLinear`` for every :data:`QUANTIZED_LINEARS` module with no extra arguments.
``merge`` dequantizes the base first: ``merge_and_unload`` returns plain bf16 ``nn.Linear`` layers
holding ``dequantize(W) + ΔW``, a model stock transformers can save and load.
"""

from __future__ import annotations

import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn

from ..compute import compute_dtype
from .base import QUANTIZED_LINEARS, QuantizedBaseLinear

_PLAIN_INITS = (True, False, "gaussian")


class LoraLinear(PeftLoraLinear):
    """PEFT ``lora.Linear`` whose ``base_layer`` may be an ``Nf4Linear`` / ``Int8Linear`` (or an ``nn.Linear``).

    Supports plain LoRA (``r``, ``lora_alpha``, ``lora_dropout``, rsLoRA, several adapters, mixed-batch
    ``adapter_names``). Variants and initializations that read or rewrite the base weight during
    training (DoRA, PiSSA, OLoRA, LoftQ, …) are refused with a clear error.
    """

    # One active adapter over a base with INT8 compute: its up-projection is added in the base matmul's epilogue
    # (QuantizedBaseLinear.forward_with_lora; the layer's output written once, not three times). False: the
    # unfused form (for measuring the difference).
    fuse_into_base: bool = True

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs):
        if kwargs.get("init_lora_weights", config.init_lora_weights) not in _PLAIN_INITS:
            raise ValueError(f"hf_lowbit.LoraLinear: init_lora_weights={config.init_lora_weights!r} reads the base "
                             f"weight, which is quantized here; use one of {_PLAIN_INITS}")
        if config.lora_bias:
            raise ValueError("hf_lowbit.LoraLinear: lora_bias=True is not supported over a quantized base")
        if config.fan_in_fan_out:
            config.fan_in_fan_out = False  # the base is [out, in] like nn.Linear (PEFT does the same for nn.Linear)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module):
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        variant = super().resolve_lora_variant(config=config, **kwargs)
        if variant is not None and isinstance(self.get_base_layer(), QuantizedBaseLinear):
            raise ValueError(f"hf_lowbit.LoraLinear: LoRA variant {type(variant).__name__} (DoRA, …) is not "
                             "supported over a quantized base; use plain LoRA")
        return variant

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        """``base(x) + B(A(dropout(x))) · scaling`` with the LoRA branch in the compute dtype, like the base.

        The compute dtype is autocast's when autocast is on, else ``x``'s (:func:`compute_dtype`).
        Adapter weights keep their own dtype (float32 by PEFT's default) and are cast per call (r x
        features, cheap); their gradients arrive in that dtype. With one active adapter over an INT8-compute
        base the up-projection is added in the base matmul's epilogue (rounded once: PEFT's result to bf16
        rounding); otherwise, under autocast, this is PEFT's forward bit for bit. Without autocast PEFT casts ``x`` to
        the float32 adapters instead: float32 GEMMs, float32 ``[tokens, features]`` intermediates and a float32 copy of
        every adapted input saved for backward, a sizeable share of a bf16 QLoRA step (measured in docs/qlora.md).
        Mixed-batch ``adapter_names``, disabled or merged adapters and variants go through PEFT's forward.
        """
        if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
            return super().forward(x, *args, **kwargs)
        active = [name for name in self.active_adapters if name in self.lora_A]
        if any(self.lora_bias.get(name) for name in active):  # an adapter added later with lora_bias (add_adapter
            return super().forward(x, *args, **kwargs)  # does not pass through __init__'s refusal): PEFT adds it
        base = self.base_layer
        if self.fuse_into_base and len(active) == 1 and isinstance(base, QuantizedBaseLinear) \
                and base.fuses_lora(self.r[active[0]]):
            name = active[0]
            dropout = self.lora_dropout[name]
            return base.forward_with_lora(x, None if isinstance(dropout, nn.Identity) else dropout(x),
                                          self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])
        result = base(x)
        dtype = compute_dtype(x)
        for name in active:
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            h = F.linear(self.lora_dropout[name](x).to(dtype), a.to(dtype))
            result = result + F.linear(h, b.to(dtype)) * self.scaling[name]
        return result

    def _dequantize_base(self) -> None:
        """Swap a quantized base for a plain linear holding its dequantized weight (what merging needs)."""
        layer = self
        while isinstance(layer.base_layer, BaseTunerLayer):
            layer = layer.base_layer
        if isinstance(layer.base_layer, QuantizedBaseLinear):
            layer.base_layer = layer.base_layer.to_linear()

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge adapters into the base; a quantized base is dequantized to a plain linear first."""
        self._dequantize_base()
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def __repr__(self) -> str:
        return "hf_lowbit." + super().__repr__()


def dispatch_lowbit(target: nn.Module, adapter_name: str, config: LoraConfig, **kwargs):
    """PEFT dispatcher: a ``LoraLinear`` for a quantized base, else None (PEFT's own dispatchers decide)."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, QUANTIZED_LINEARS):
        return LoraLinear(target, adapter_name, config=config, **kwargs)
    return None


def register_with_peft() -> None:
    """Put :func:`dispatch_lowbit` in front of PEFT's LoRA dispatchers (idempotent; ``import hf_lowbit`` calls it).

    PEFT 0.21 picks the LoRA layer class in ``LoraModel._create_new_module``; a config-level
    ``LoraConfig._register_custom_module`` mapping would not survive ``save_pretrained`` /
    ``PeftModel.from_pretrained`` (the reloaded config has none), so the dispatcher is added there.
    """
    from peft.tuners.lora.model import LoraModel

    original = LoraModel._create_new_module
    if getattr(original, "_hf_lowbit", False):
        return

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        new_module = dispatch_lowbit(target, adapter_name, lora_config, **kwargs)
        return new_module if new_module is not None else original(lora_config, adapter_name, target, **kwargs)

    _create_new_module._hf_lowbit = True
    LoraModel._create_new_module = staticmethod(_create_new_module)


def resolve_all_linear(model: nn.Module, peft_config) -> None:
    """Expand ``target_modules="all-linear"`` to the model's linears *including* quantized bases.

    PEFT's own expansion only knows ``nn.Linear`` / ``Conv1D`` and would silently leave every
    quantized base without an adapter. The output embedding stays excluded, as in PEFT.
    """
    target = getattr(peft_config, "target_modules", None)
    if not (isinstance(target, str) and target.lower() == "all-linear"):
        return
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    _maybe_include_all_linear_layers(peft_config, model)
    names = set(peft_config.target_modules)
    names.update(name for name, m in model.named_modules() if isinstance(m, QUANTIZED_LINEARS))
    peft_config.target_modules = names
