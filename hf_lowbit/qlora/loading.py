"""Checkpoint loading: :func:`load_quantized_model` builds a model whose linears are quantized as they load.

The QLoRA path for models whose bf16 weights do not fit on the device: tensor by tensor, shard by
shard, each linear's weight goes straight into its frozen quantized base (docs/qlora.md).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from .base import QUANTIZED_LINEARS, Nf4Linear, QuantizedBaseConfig, QuantizedBaseLinear
from ..swap import LinearFilter, SwapReport, swap_linears


@torch.no_grad()
def load_quantized_model(model_cls, checkpoint_dir: str, config: QuantizedBaseConfig, *, device="cpu",
                         dtype: torch.dtype = torch.bfloat16, filter: LinearFilter = LinearFilter(),
                         **model_kwargs) -> tuple[nn.Module, SwapReport]:
    """Build ``model_cls`` (e.g. ``AutoModelForCausalLM``) from the safetensors checkpoint in
    ``checkpoint_dir`` with its linears quantized *as they load*: tensor by tensor, shard by shard,
    so the full-precision model never exists on ``device`` (peak ≈ quantized model + the largest
    tensor and its quantization temporaries).

    The model is built with empty (meta) parameters; buffers (rotary tables …) are computed as usual.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(checkpoint_dir)
    with init_empty_weights(include_buffers=False):
        model = model_cls.from_config(model_config, dtype=dtype, **model_kwargs)
    report = swap_linears(model, lambda name, linear: config.make_empty(linear, device="meta"),
                          recipe="lora_base_quant (on load)",
                          target=f"{config.storage.upper()} frozen base", filter=config.filter(filter),
                          already=QUANTIZED_LINEARS)
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(checkpoint_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"load_quantized_model: no model.safetensors(.index.json) in {checkpoint_dir}")
    expected = set(model.state_dict().keys())
    loaded = set()
    for file in files:
        with safe_open(os.path.join(checkpoint_dir, file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                module_name, _, attr = key.rpartition(".")
                try:
                    module = model.get_submodule(module_name)
                except AttributeError:
                    continue  # a tensor this model class does not have (e.g. an unused head)
                tensor = f.get_tensor(key)
                if isinstance(module, QuantizedBaseLinear) and attr == "weight":
                    module.load_weight(tensor.to(dtype))
                    loaded.update(k for k in expected if k.startswith(module_name + ".") and not k.endswith(".bias"))
                elif attr in module._parameters:
                    module._parameters[attr] = nn.Parameter(tensor.to(dtype) if tensor.is_floating_point() else tensor,
                                                            requires_grad=False)
                    loaded.add(key)
                elif attr in module._buffers:
                    module._buffers[attr] = tensor
                    loaded.add(key)
                del tensor
    if getattr(model_config, "tie_word_embeddings", False):
        model.tie_weights()
        loaded.update(k for k in expected if k.endswith("lm_head.weight"))
    on_meta = {n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta}
    missing = sorted(k for k in expected - loaded if k in on_meta)
    if missing:
        raise ValueError(f"load_quantized_model: {checkpoint_dir} lacks {len(missing)} tensors the model needs, "
                         f"e.g. {missing[:5]}")
    model.to(device)
    for module in model.modules():
        if isinstance(module, Nf4Linear):
            module.set_compute(module.compute)
    return model, report


__all__ = ["load_quantized_model"]
