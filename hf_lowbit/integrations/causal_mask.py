"""Causal attention without a materialized mask under ``torch.compile`` (``lowbit_skip_causal_mask``).

Eagerly, transformers hands SDPA no mask for an unpadded causal batch (``is_causal=True``: the kernel skips the
blocks above the diagonal). While Dynamo traces the model it cannot look at the data, so
``masking_utils._ignore_causal_mask_sdpa`` refuses that shortcut and ``create_causal_mask`` materializes a
``[batch, 1, seq, seq]`` boolean mask (and, with ``position_ids``, a packed-sequence overlay it cannot rule out):
the compiled model runs SDPA with ``attn_mask`` and computes every block. On the H200 (session 17's profile, 8
Llama-8B-shaped layers, 1x2048 tokens) the same cuDNN attention kernels took 0.66 ms a layer's backward through
the whole-model-compiled Trainer against 0.25 ms in per-layer-compiled layers called without a mask: attention
was 52-57 ms of a ~340-410 ms step against ~21 ms, for bf16 and every recipe alike.

The trainer knows what Dynamo does not: the batch it is about to feed has no ``attention_mask`` (or one of all
ones, dropped on the CPU by :class:`DropFullAttentionMask` before it reaches the device) and no ``position_ids``
(so no packing), and the model is a decoder-only text model with full causal attention in every layer
(:func:`plain_causal_model`). Within :func:`plain_causal` the ``"sdpa"`` mask function then returns ``None``
for the first layer's mask of a fresh forward (no padding mask, query length = key length, offsets 0): the
mask that transformers itself skips eagerly. Everything else goes to transformers' ``sdpa_mask`` unchanged, and
outside the context the function is transformers' own. The attention computed is the same (a causal mask of
all-True rows below the diagonal); only the kernel's path differs, so results can differ in the last bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

# decoder-only text models whose layers all use full causal attention and whose mask is create_causal_mask's
# with no model-specific overlay (no image-token or block overlays, no sliding windows: checked on the config too)
PLAIN_CAUSAL_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

_active = False  # read inside the traced forward: Dynamo guards on it (one graph per value)
_installed = None  # transformers' sdpa mask function, once ours replaced it


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


def batch_is_plain_causal(inputs) -> bool:
    """Whether a batch (the dict a ``Trainer`` feeds the model) leaves the causal mask plain: no ``position_ids``
    (packed sequences) and no ``attention_mask`` (``DropFullAttentionMask`` removes one of all ones)."""
    return isinstance(inputs, Mapping) and "attention_mask" not in inputs and "position_ids" not in inputs


def _skippable(kwargs) -> bool:
    """A plain causal mask over a fresh forward: no padding mask, no local window, offsets the Python int 0 (a
    cache's tensor offsets, as a static cache's, are not), query length = key length > 1 (ints, or the same
    symbolic length under dynamic shapes)."""
    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    return (kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and all(type(kwargs.get(k, 0)) is int and kwargs.get(k, 0) == 0 for k in ("q_offset", "kv_offset"))
            and isinstance(q, (int, torch.SymInt)) and isinstance(kv, (int, torch.SymInt)) and q == kv and q > 1)


def install() -> None:
    """Put :func:`_sdpa_mask` in front of transformers' ``"sdpa"`` mask function (once; idempotent)."""
    global _installed
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if _installed is None:
        _installed = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = _sdpa_mask


def _sdpa_mask(*args, **kwargs):
    if _active and not args and _skippable(kwargs):
        return None  # SDPA then runs with is_causal=True, as it does eagerly
    return _installed(*args, **kwargs)


@contextlib.contextmanager
def plain_causal(enabled: bool = True):
    """While active (and ``enabled``), the ``"sdpa"`` mask function returns ``None`` for a plain causal mask:
    the caller vouches that the forward's batch has no padding and no packing (:func:`batch_is_plain_causal`)
    and that the model is one :func:`plain_causal_model` accepts."""
    global _active
    if not enabled:
        yield
        return
    install()
    before, _active = _active, True
    try:
        yield
    finally:
        _active = before


class DropFullAttentionMask:
    """A data collator wrapper: the batch of ``collator`` without its ``attention_mask`` where that mask is all
    ones on the CPU (no padding: for the causal LMs of ``PLAIN_CAUSAL_MODEL_TYPES`` the same forward), so the
    trainer can skip the materialized mask without reading the mask on the device (a host sync a micro-batch).
    A module-level class, so DataLoader workers can pickle it."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if (isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and "position_ids" not in batch
                and bool(mask.all())):
            batch = {k: v for k, v in batch.items() if k != "attention_mask"}  # a BatchEncoding becomes a dict
        return batch

    def __getattr__(self, name):  # the wrapped collator's attributes (trl reads some of its collators')
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)
