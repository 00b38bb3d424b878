"""The compute dtype every low-bit layer (mixed precision, quantized bases, LoRA, QAT) computes in."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a layer computes in: autocast's when it is on for ``x``'s device, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


__all__ = ["compute_dtype"]
