"""Causal attention without a materialized mask under ``torch.compile`` (``lowbit_skip_causal_mask``).

Eagerly, transformers hands SDPA no mask for an unpadded causal batch (``is_causal=True``: the kernel skips the
blocks above the diagonal). While Dynamo traces the model it cannot look at the data, so
``masking_utils._ignore_causal_mask_sdpa`` refuses that shortcut and ``create_causal_mask`` materializes a
``[batch, 1, seq, seq]`` boolean mask (and, with ``position_ids``, a packed-sequence overlay it cannot rule out):
the compiled model runs SDPA with ``attn_mask`` and computes every block. On the H200 (session 17's profile, 8
Llama-8B-shaped layers, 1x2048 tokens) the same cuDNN attention kernels took 0.66 ms a layer's backward through
the whole-model-compiled Trainer against 0.25 ms in per-layer-compiled layers called without a mask: attention
was 52-57 ms of a ~340-410 ms step against ~21 ms, for bf16 and every recipe alike.

The trainer knows what Dynamo does not: the batch it is about to feed has no ``attention_mask``, or one of all
ones (checked on the CPU by :class:`FullAttentionMaskCollator` before the batch reaches the device: dropped under
the stock loss, kept and the batch marked as a :class:`FullMaskBatch` under trl's ``SFTTrainer``, whose loss reads
it), and no ``position_ids`` (so no packing), and the model is a decoder-only text model with full
causal attention in every layer (:func:`plain_causal_model`). Within :func:`plain_causal` the ``"sdpa"`` mask
function then returns ``None`` for the mask of a fresh forward (query length = key length, offsets 0, no local
window, and no padding mask or, for a marked batch, one the collator saw all ones): the mask that transformers
itself skips eagerly. Everything else goes to transformers' ``sdpa_mask`` unchanged, and outside the context the
function is transformers' own. The attention computed is the same (a causal mask of all-True rows below the
diagonal); only the kernel's path differs, so results can differ in the last bits.

Eagerly, with no cache (``use_cache=False``), transformers also checks the position ids the model made for packed
sequences with a ``bool()`` of a device tensor: one host sync a forward, after which the GPU idles until the host has
launched the next kernels. Within the context that check answers "not packed" without reading the device (the batch
has no ``position_ids``, so the model's own are one sequence a row): the same answer, no sync.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping

import torch

# decoder-only text models whose layers all use full causal attention and whose mask is create_causal_mask's
# with no model-specific overlay (no image-token or block overlays, no sliding windows: checked on the config too)
PLAIN_CAUSAL_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# read inside the traced forward, so Dynamo guards on them (one graph per value): whether the context is on, and
# whether it vouches for a padding mask of all ones (a FullMaskBatch) as well as for no padding mask
_active = False
_mask_all_ones = False
_installed = None  # transformers' sdpa mask function, once ours replaced it
_installed_packed = None  # transformers' packed-sequence check, once ours replaced it


def plain_causal_model(model) -> str | None:
    """Why ``model``'s masks cannot be skipped (one line), or ``None`` when they can: its type is in
    ``PLAIN_CAUSAL_MODEL_TYPES``, it attends with ``"sdpa"``, and no layer uses a sliding window."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    if getattr(config, "model_type", None) not in PLAIN_CAUSAL_MODEL_TYPES:
        return (f"model_type {getattr(config, 'model_type', None)!r} is not one of "
                f"{sorted(PLAIN_CAUSAL_MODEL_TYPES)}")
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attn_implementation is {getattr(config, '_attn_implementation', None)!r}, not 'sdpa'"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window={window}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"layer_types {sorted(set(layer_types))} are not all 'full_attention'"
    return None


class FullMaskBatch(dict):
    """A batch whose ``attention_mask`` :class:`FullAttentionMaskCollator` saw all ones on the CPU, kept for a loss
    that reads it (trl's ``SFTTrainer`` counts tokens with it). The type is the mark: ``DataLoader``'s pinning,
    accelerate's ``send_to_device`` and the ``Trainer``'s ``_prepare_inputs`` rebuild a mapping as its own type, so
    it reaches ``training_step`` on the device as a ``FullMaskBatch``, with no extra key for the model to refuse."""


def batch_is_plain_causal(inputs) -> bool:
    """Whether a batch (the dict a ``Trainer`` feeds the model) leaves the causal mask plain: no ``position_ids``
    (packed sequences) and no ``attention_mask`` (the collator drops one of all ones) or a :class:`FullMaskBatch`
    (the collator saw it all ones)."""
    return (isinstance(inputs, Mapping) and "position_ids" not in inputs
            and ("attention_mask" not in inputs or isinstance(inputs, FullMaskBatch)))


def _skippable(kwargs) -> bool:
    """A plain causal mask over a fresh forward: no padding mask (or one the context vouches is all ones), no
    local window, offsets the Python int 0 (a cache's tensor offsets, as a static cache's, are not), query length =
    key length > 1 (ints, or the same symbolic length under dynamic shapes)."""
    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    # allow_is_causal_skip is not consulted: traced, transformers sets it False for the packed-sequence overlay it
    # derives from the model's own position_ids, which is what the trainer rules out (no position_ids in the batch)
    return ((kwargs.get("attention_mask") is None or _mask_all_ones) and kwargs.get("local_size") is None
            and all(type(kwargs.get(k, 0)) is int and kwargs.get(k, 0) == 0 for k in ("q_offset", "kv_offset"))
            and isinstance(q, (int, torch.SymInt)) and isinstance(kv, (int, torch.SymInt)) and q == kv and q > 1)


def install() -> None:
    """Put :func:`_sdpa_mask` in front of transformers' ``"sdpa"`` mask function and
    :func:`_find_packed_sequence_indices` in front of its packed-sequence check (once; idempotent)."""
    global _installed, _installed_packed
    from transformers import masking_utils

    if _installed is None:
        _installed = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
        masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = _sdpa_mask
    if _installed_packed is None and hasattr(masking_utils, "find_packed_sequence_indices"):
        _installed_packed = masking_utils.find_packed_sequence_indices  # called through the module's globals
        masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices


def _sdpa_mask(*args, **kwargs):
    if _active and not args and _skippable(kwargs):
        return None  # SDPA then runs with is_causal=True, as it does eagerly
    return _installed(*args, **kwargs)


def _find_packed_sequence_indices(position_ids):
    if _active:  # the caller vouches for no packing: what transformers' check finds eagerly, without its host sync
        return None
    return _installed_packed(position_ids)


@contextlib.contextmanager
def plain_causal(enabled: bool = True, mask_all_ones: bool = False):
    """While active (and ``enabled``), the ``"sdpa"`` mask function returns ``None`` for a plain causal mask, and
    transformers' packed-sequence check ``None`` without reading the device: the caller vouches that the forward's
    batch has no padding and no packing (:func:`batch_is_plain_causal`) and that the model is one
    :func:`plain_causal_model` accepts. That holds for every mask built while the context is on, whatever the
    attention implementation: a second forward inside it (a custom loss's) must not carry packed ``position_ids``.
    ``mask_all_ones``: the batch carries an ``attention_mask`` the caller knows is all ones (a
    :class:`FullMaskBatch`), which the function then ignores."""
    global _active, _mask_all_ones
    if not enabled:
        yield
        return
    install()
    before = _active, _mask_all_ones
    _active, _mask_all_ones = True, mask_all_ones
    try:
        yield
    finally:
        _active, _mask_all_ones = before


def plain_causal_for(inputs, enabled: bool = True):
    """:func:`plain_causal` for the forward of the batch ``inputs``: on where it is plain
    (:func:`batch_is_plain_causal`) and ``enabled`` (the model qualifies), vouching for its mask where it is a
    :class:`FullMaskBatch`."""
    return plain_causal(enabled and batch_is_plain_causal(inputs), mask_all_ones=isinstance(inputs, FullMaskBatch))


def collator_mode(trainer_cls) -> str | None:
    """What :class:`FullAttentionMaskCollator` may do for ``trainer_cls``'s loss: ``"drop"`` an all-ones
    ``attention_mask`` under the stock ``Trainer.compute_loss`` (which never reads it), ``"mark"`` (keep it, the
    batch a :class:`FullMaskBatch`) under trl's ``SFTTrainer.compute_loss`` (which reads it for its token count and
    forwards only that batch), ``None`` under any other loss: it may read the mask or run another forward, on
    another batch, inside the same step, where the mark would vouch for masks it never saw (batches with no mask
    at all still skip it)."""
    from transformers import Trainer

    fn = getattr(trainer_cls, "compute_loss", None)
    if fn is Trainer.compute_loss:
        return "drop"
    sft = getattr(sys.modules.get("trl.trainer.sft_trainer"), "SFTTrainer", None)
    return "mark" if sft is not None and fn is sft.compute_loss else None


def dispatches_batches(accelerator, dataset) -> bool:
    """Whether accelerate will dispatch ``dataset``'s batches (process 0 loads one per process and concatenates
    them, as ``type(batches[0])`` with ``batches[0]``'s keys, then slices): a batch marked or stripped of its mask
    would then stand for others that were not. On more than one process with ``dispatch_batches=True``, or unset
    with an ``IterableDataset`` (accelerate's default there)."""
    if getattr(accelerator, "num_processes", 1) <= 1:
        return False
    dispatch = getattr(getattr(accelerator, "dataloader_config", None), "dispatch_batches", None)
    return dispatch is True or (dispatch is None and isinstance(dataset, torch.utils.data.IterableDataset))


class FullAttentionMaskCollator:
    """A data collator wrapper for the batches whose ``attention_mask`` is all ones on the CPU (no padding: for the
    causal LMs of ``PLAIN_CAUSAL_MODEL_TYPES`` the same forward as no mask), so the trainer can skip the
    materialized mask without reading the mask on the device (a host sync a micro-batch). ``drop=True`` (the stock
    loss) removes such a mask; ``drop=False`` (trl's ``SFTTrainer``, whose loss reads it) keeps it and returns the
    batch as a :class:`FullMaskBatch` (:func:`collator_mode`). A batch with ``position_ids`` (packed) or any
    padding is returned as is. The trainer puts it only into the data loaders it builds (not into
    ``trainer.data_collator``, which trl inspects) and not where accelerate dispatches batches
    (:func:`dispatches_batches`). A module-level class, so DataLoader workers can pickle it."""

    def __init__(self, collator, drop: bool = True):
        self.collator = collator
        self.drop = drop

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if (isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and "position_ids" not in batch
                and bool(mask.all())):
            if self.drop:
                return {k: v for k, v in batch.items() if k != "attention_mask"}  # a BatchEncoding becomes a dict
            return FullMaskBatch(batch)
        return batch

    def __getattr__(self, name):  # the wrapped collator's attributes (trl reads some of its collators')
        if name in ("collator", "drop"):
            raise AttributeError(name)
        return getattr(self.collator, name)
