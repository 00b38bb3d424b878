"""Distributed-training plumbing for FSDP2 (docs/distributed.md): what torch's ``fully_shard`` can and
cannot shard, and rebuilding a full model from a sharded one for the QAT export.

* :func:`fsdp2_shards_integer_params`: whether this torch's FSDP2 shards integer parameters (the
  NF4/INT8 codes of quantized bases): torch >= 2.13.
* :func:`prepare_integer_params_for_fsdp2`: where it cannot, hold the quantized bases' codes in a
  floating-point carrier of the FSDP2 policy's ``param_dtype`` (same bytes), which old ``fully_shard``
  shards and gathers bit for bit; ``LowBitTrainer`` calls it before accelerate shards the model.
* :func:`keep_integer_params_unsharded`: the fallback for integer parameters no carrier can hold: leave
  those modules whole on every rank (the FSDP plugin's ``ignored_modules``), with a ``LowBitWarning``.
* :func:`enable_lowbit_all_gather`: FSDP2 all-gathers the INT8/FP8 layers' weights as codes + row scales (the
  weight and the hooks: :mod:`hf_lowbit.mixed_precision.fsdp_all_gather`); :func:`prepare_lowbit_all_gather` is
  ``LowBitTrainer``'s call of it for ``lowbit_fsdp_lowbit_all_gather``, before accelerate shards the model.
* :func:`deepspeed_zero_stage` / :func:`check_deepspeed`: the ZeRO stage of a DeepSpeed run and the recipes
  refused under it (one line naming the setting and FSDP2, at ``LowBitTrainer`` construction).
* :func:`unsharded_copy`: a CPU copy of a (sharded) model holding a gathered full state dict, with the
  same recipe swaps; ``LowBitTrainer.save_quantized`` converts and writes it on rank 0.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
from torch import nn

from ..args import LowBitArgumentsMixin
from ..kernels import get_format
from ..mixed_precision import MixedPrecisionLinear
from ..mixed_precision.fsdp_all_gather import FLAG, LowBitAllGatherWeight, _unwrap_state_dict, lowbit_all_gather_enabled
from ..prepare import apply_recipes
from ..qlora.base import QuantizedBaseLinear
from ..warnings import LowBitWarning, UnsupportedSetupError

# torch's FSDP2 before 2.13 creates every sharded parameter with requires_grad=True first, which integer
# tensors cannot have ("only Tensors of floating point dtype can require gradients"; seen with 2.11)
FSDP2_INTEGER_PARAMS_SINCE = "2.13"


def fsdp2_shards_integer_params(torch_version: str = torch.__version__) -> bool:
    """Whether ``fully_shard`` of this torch can shard integer parameters (NF4/INT8 base codes)."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch_version) >= FSDP2_INTEGER_PARAMS_SINCE


def carrier_dtype(fsdp_plugin) -> torch.dtype:
    """The floating-point dtype that integer codes are held in for torch < 2.13's ``fully_shard``: the
    policy's ``param_dtype`` (that FSDP2 casts every other dtype to, in 2.11 integer ones included; a
    parameter already of it is gathered as is), bf16 without a policy (then nothing is cast)."""
    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    return getattr(policy, "param_dtype", None) or torch.bfloat16


def prepare_integer_params_for_fsdp2(fsdp_plugin, model, device,
                                     torch_version: str = torch.__version__) -> tuple[list[str], list[str]]:
    """Make the quantized bases shardable by this torch's FSDP2 (call before it shards ``model``).

    torch >= 2.13 shards integer parameters as they are: nothing to do. Older torch (2.11, the GPU image)
    cannot (see ``FSDP2_INTEGER_PARAMS_SINCE``) and would also cast them to ``param_dtype``; there each
    quantized base holds its codes in :func:`carrier_dtype` (:meth:`QuantizedBaseLinear.hold_codes_as`):
    sharded, all-gathered at 1 byte per int8 code (0.5 per NF4 weight), bit-identical. Modules no carrier
    can hold stay whole (:func:`keep_integer_params_unsharded`). Returns (carried, kept whole) module names."""
    if fsdp2_shards_integer_params(torch_version):
        return [], []
    carrier = carrier_dtype(fsdp_plugin)
    carried = [n for n, m in model.named_modules() if isinstance(m, QuantizedBaseLinear) and _has_integer_params(m)
               and m.hold_codes_as(carrier)]
    return carried, keep_integer_params_unsharded(fsdp_plugin, model, device, torch_version)


def _has_integer_params(module) -> bool:
    return any(not (p.is_floating_point() or p.is_complex()) for p in module.parameters(recurse=False))


def keep_integer_params_unsharded(fsdp_plugin, model, device, torch_version: str = torch.__version__) -> list[str]:
    """Leave the modules that hold integer parameters out of FSDP2 sharding where this torch cannot shard
    them (< 2.13) and no carrier holds them (:func:`prepare_integer_params_for_fsdp2` runs first): they stay
    whole on every rank, on ``device``, as accelerate does for bitsandbytes' uint8 weights. Sets
    ``fsdp_plugin.ignored_modules``; returns the module names."""
    if fsdp2_shards_integer_params(torch_version):
        return []
    names = [n for n, m in model.named_modules() if _has_integer_params(m)]
    if not names:
        return []
    pattern = "|".join(re.escape(n) for n in names)
    ignored = fsdp_plugin.ignored_modules
    if ignored is None or isinstance(ignored, str):  # accelerate moves regex-matched modules to the device
        fsdp_plugin.ignored_modules = pattern if ignored is None else f"(?:{ignored})|{pattern}"
    else:
        fsdp_plugin.ignored_modules = [*ignored, *(model.get_submodule(n).to(device) for n in names)]
    warnings.warn(f"torch {torch_version}'s FSDP2 cannot shard integer parameters (torch >= 2.13 can): the "
                  f"{len(names)} modules holding them stay whole on every rank (e.g. {names[0]}); "
                  "adapters and everything else are sharded.", LowBitWarning, stacklevel=2)
    return names


def enable_lowbit_all_gather(model: nn.Module) -> list[str]:
    """Let FSDP2 all-gather every :class:`~hf_lowbit.MixedPrecisionLinear` weight of ``model`` as INT8/FP8
    codes + row scales instead of in ``param_dtype`` (see :mod:`hf_lowbit.mixed_precision.fsdp_all_gather`). Call it
    **before** ``fully_shard`` and before creating the optimizer (each weight becomes a new ``nn.Parameter`` over the
    same storage); ``LowBitTrainer`` does with ``lowbit_fsdp_lowbit_all_gather=True``. Returns the names of
    the layers switched; raises ``ValueError`` (naming the flag) for a layer that cannot take it."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, MixedPrecisionLinear) or lowbit_all_gather_enabled(m):
            continue
        c = m.lowbit_config
        problem = ("is already sharded (call it before fully_shard)" if type(m.weight) is not nn.Parameter
                   else "has output or grad_input off (the gathered codes replace the weight in both)"
                   if not (c.output and c.grad_input)
                   else "has its weight cache on (the gathered codes replace it)" if m.weight_cache
                   else f"computes in {c.format!r}, one scale per tensor (each rank's shard would get its own)"
                   if get_format(c.format).tensorwise
                   else "shares its weight with another module" if counts[id(m.weight)] > 1 else None)
        if problem:
            raise ValueError(f"{FLAG}: {name or type(m).__name__} {problem}")
        w = m.weight
        m.weight = nn.Parameter(LowBitAllGatherWeight(w.data, c.format), requires_grad=w.requires_grad)
        m._register_state_dict_hook(_unwrap_state_dict)
        done.append(name)
    return done


def prepare_lowbit_all_gather(args: LowBitArgumentsMixin, model, fsdp_plugin) -> list[str]:
    """``lowbit_fsdp_lowbit_all_gather``: switch the INT8/FP8 layers of ``model`` to the low-bit all-gather (call
    before accelerate shards it). Refused, with the flag's name, unless the run is FSDP2 (``fsdp_plugin`` of
    ``fsdp_version`` 2); returns the layers switched."""
    if not args.lowbit_fsdp_lowbit_all_gather:
        return []
    if fsdp_plugin is None or getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        raise ValueError(f"{type(args).__name__}.lowbit_fsdp_lowbit_all_gather=True needs FSDP2 (an accelerate "
                         "config with fsdp_version: 2, e.g. accelerate_configs/fsdp2.yaml); this run is not sharded "
                         "by it")
    names = enable_lowbit_all_gather(model)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[hf_lowbit] lowbit_fsdp_lowbit_all_gather: {len(names)} layers all-gather their weights as "
              "low-bit codes + row scales", flush=True)
    return names


def deepspeed_zero_stage(args) -> int | None:
    """The ZeRO stage of a DeepSpeed run, None without DeepSpeed. ``TrainingArguments`` builds the plugin both
    from ``deepspeed=<config>`` and from an ``accelerate launch`` DeepSpeed config (``ACCELERATE_USE_DEEPSPEED``)."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        return None
    stage = plugin.hf_ds_config.get_value("zero_optimization.stage")
    return int(stage) if stage not in (None, "auto") else int(plugin.zero_stage)


def check_deepspeed(args) -> None:
    """Refuse, before the model is touched, what cannot run under DeepSpeed (docs/distributed.md "DeepSpeed",
    decided from runs on 2 CPU processes): under ZeRO-3 the QLoRA bases and the QAT export. ZeRO-3 turns every
    weight into an empty placeholder as the model is built (``zero.Init``) and gathers it only inside forward and
    backward hooks, so there is no weight to quantize into NF4/INT8 codes when the trainer swaps the linears, and
    ``save_quantized`` has no way to rebuild the whole model on one rank. ZeRO-1/2 shard optimizer state and
    gradients only: every recipe runs there."""
    stage = deepspeed_zero_stage(args)
    if stage is None or stage < 3:
        return
    cls, setting = type(args).__name__, "DeepSpeed ZeRO-3 (zero_optimization.stage 3)"
    alternative = ("shard with FSDP2 (accelerate_configs/fsdp2.yaml) or use ZeRO-2 "
                   "(accelerate_configs/deepspeed_zero2.yaml)")
    if args.lora_base_quant:
        raise UnsupportedSetupError(
            f"{cls}.lora_base_quant={args.lora_base_quant!r} under {setting}: ZeRO-3 partitions every weight into an "
            f"empty placeholder as the model is built, leaving none to quantize into the base's codes; {alternative}")
    if args.qat_scheme is not None:
        raise UnsupportedSetupError(
            f"{cls}.qat_scheme={args.qat_scheme!r} under {setting}: save_quantized cannot rebuild the model from "
            f"ZeRO-3's partitions to export it; {alternative}")


def unsharded_copy(model, state: dict, args: LowBitArgumentsMixin):
    """A CPU copy of ``model`` (a transformers model, maybe FSDP2-sharded) holding the full ``state``."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard's subclass -> the model's
    copy = cls._from_config(model.config, torch_dtype=next(iter(state.values())).dtype)
    apply_recipes(copy, args)  # the same swaps, so module types and state-dict keys match
    copy.load_state_dict(state)
    return copy


__all__ = ["carrier_dtype", "check_deepspeed", "deepspeed_zero_stage", "enable_lowbit_all_gather",
           "fsdp2_shards_integer_params", "keep_integer_params_unsharded", "prepare_integer_params_for_fsdp2",
           "prepare_lowbit_all_gather", "unsharded_copy"]
