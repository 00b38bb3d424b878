"""Silence start-up noise that is known to be harmless, and only that.

transformers imports torchao (when installed) while importing its model code. On a machine without
the GPU or Python build torchao's optional extensions target, torchao logs "Failed to load
.../_C_mxfp8...so" / "_C_cutlass_90a...so" (the kernels of recipes hf_lowbit does not use there), and
torchao's Enum registrations make torch warn that ``register_constant()`` is deprecated. Both are
dropped by a logging filter matched on those messages; every other torchao or torch message passes.
On a CUDA machine the load failures are kept: there they may matter.
"""

from __future__ import annotations

import logging

_HARMLESS_PYTREE = "Calling register_constant() on Enum subclasses is deprecated"
_installed = False


class _DropKnownHarmless(logging.Filter):
    def __init__(self, drop_extension_failures: bool):
        super().__init__()
        self.drop_extension_failures = drop_extension_failures

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a record that cannot format itself is not ours to judge
            return True
        if _HARMLESS_PYTREE in msg:
            return False
        if self.drop_extension_failures and msg.startswith("Failed to load") and "torchao" in msg and ".so" in msg:
            return False
        return True


def install() -> None:
    """Add the filter to the torchao and torch pytree loggers (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch

    filt = _DropKnownHarmless(drop_extension_failures=not torch.cuda.is_available())
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(filt)
