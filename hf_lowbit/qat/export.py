"""Export a QAT model as a checkpoint that stock transformers + torchao load: :func:`save_quantized`.

The model is converted (:func:`hf_lowbit.qat.convert_qat`: torchao tensor subclasses, e.g.
``IntxUnpackedToInt8Tensor`` for 8da4w, ``Int4TilePackedTo4dTensor`` for int4_tinygemm, ``Float8Tensor`` for
fp8_rowwise; all three are on torchao's safetensors allow-list), given a ``TorchAoConfig`` quantization config and an
``hf_quantizer`` so that ``save_pretrained`` flattens the subclasses into ``model.safetensors`` with
torchao's metadata, and written with the tokenizer files and a model card into ``.tmp-<name>`` beside
``path``, swapped in only when everything is written (:mod:`hf_lowbit.atomic`; the next export removes what
a killed one left there). Loading needs
only ``AutoModelForCausalLM.from_pretrained(path)`` (transformers >= 5 with torchao installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import types

from torch import nn

from .. import atomic
from .linear import QATConfig, QATLinear, _torchao_fake_quantized_types, convert_qat

MODEL_CARD = """---
library_name: transformers
tags:
- torchao
- quantized
- qat
- hf_lowbit
---

# {name}

Quantization-aware fine-tuned with hf_lowbit and converted to torchao's
**{scheme}** scheme: {description}, {granularity}.

- made for: {runtime}
- quantization_config: `TorchAoConfig(quant_type={base_config})` (in `config.json`); weights: `{tensor_type}`
- quantized linears: {n_converted}; kept in {dtype}: {kept}
- weights: `model.safetensors` with torchao tensor-subclass metadata

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{name}")   # needs torchao
```
{serving}"""


def save_quantized(model: nn.Module, path: str, config: QATConfig, tokenizer=None, *,
                   safe_serialization: bool = True) -> list[str]:
    """Convert ``model`` (prepared with :func:`prepare_qat`) and write a loadable quantized checkpoint to ``path``.

    ``model`` is converted in place (it then computes with torchao's quantized weights, as the
    saved checkpoint does); a PEFT model is merged and unloaded first (LoRA folded into the base).
    ``path`` must not exist or be an empty directory, or a checkpoint directory written by this function
    before (replaced as a whole, in one step: a process killed at any moment leaves the old or the new
    export). Returns the names of the files written.
    """
    from transformers import TorchAoConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    if not safe_serialization:
        raise ValueError("save_quantized writes safetensors only (torchao tensor subclasses flattened with metadata)")
    model = merge_lora(model)
    converted = convert_qat(model, config) if _has_qat_layers(model) else []
    if not converted and not getattr(model, "hf_quantizer", None):
        raise ValueError("save_quantized: the model has no QAT layers to convert; prepare it with "
                         "hf_lowbit.qat.prepare_qat (or LowBitTrainingArguments(qat_scheme=...)) first")
    if converted:
        kept = [n for n, m in model.named_modules() if type(m) is nn.Linear and n not in set(converted)]
        qconfig = TorchAoConfig(quant_type=config.base_config(), modules_to_not_convert=[re.escape(n) for n in kept])
        model.config.quantization_config = qconfig
        model.hf_quantizer = AutoHfQuantizer.from_config(qconfig, pre_quantized=True)
    else:
        kept = []

    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path) and not _is_export(path):
        raise FileExistsError(f"save_quantized: {path} exists and is neither empty nor an earlier save_quantized "
                              "output; choose a new path")
    tmp = atomic.staging_dir(path)  # .tmp-<name> beside path; renamed to path only when complete
    atomic.clear(tmp, tmp + ".old")  # left by a save_quantized killed before it finished
    os.makedirs(tmp)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        name = os.path.basename(path)
        spec = config.spec
        dtype = str(getattr(model, "dtype", "")).replace("torch.", "")
        with open(os.path.join(tmp, "README.md"), "w") as f:
            granularity = ("per channel: one scale per weight row" if config.per_channel else
                           f"weight group size {config.group_size}")
            f.write(MODEL_CARD.format(name=name, scheme=spec.name, description=config.description,
                                      granularity=granularity, runtime=spec.runtime, tensor_type=spec.tensor_type,
                                      base_config=type(config.base_config()).__name__,
                                      n_converted=len(converted), dtype=dtype,
                                      kept=", ".join(f"`{k}`" for k in kept) or "none",
                                      serving=f"\n## Serving\n\n{spec.serving.replace('{name}', name)}\n"
                                      if spec.serving else ""))
        atomic.replace_dir(tmp, path)  # an earlier export is swapped out in one step where the OS can
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    model.push_to_hub = types.MethodType(
        lambda self, repo_id, **kw: push_quantized_to_hub(path, repo_id, **kw), model)
    return sorted(os.listdir(path))


def push_quantized_to_hub(path: str, repo_id: str, *, token=None, private: bool | None = None,
                          commit_message: str = "Upload QAT-quantized model (hf_lowbit)", revision=None):
    """Upload exactly the files of the :func:`save_quantized` output at ``path`` to the Hub repo ``repo_id``.

    After ``save_quantized``, the converted model's ``push_to_hub(repo_id, ...)`` calls this with its
    export directory, so model card and tokenizer files go up with the weights.
    """
    from huggingface_hub import HfApi

    if not _is_export(path):
        raise ValueError(f"push_quantized_to_hub: {path} is not a save_quantized output")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=path, commit_message=commit_message, revision=revision)


def _is_export(path: str) -> bool:
    """Whether ``path`` holds a checkpoint with a torchao quantization_config (an earlier export)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("quantization_config", {}).get("quant_method") == "torchao"
    except (OSError, ValueError, AttributeError):
        return False


def merge_lora(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper, LoRA merged into the base weights first."""
    try:
        from peft import PeftModel
    except ImportError:
        return model
    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model


def _has_qat_layers(model: nn.Module) -> bool:
    return any(isinstance(m, (QATLinear, *_torchao_fake_quantized_types())) for m in model.modules())


__all__ = ["save_quantized", "push_quantized_to_hub", "merge_lora"]
