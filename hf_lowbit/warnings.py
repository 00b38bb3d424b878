"""``LowBitWarning``, and the checks of a training setup against what low-bit recipes need to be fast and stable.

Any layer may warn with ``LowBitWarning``, so this module imports only the formats registry. One function,
explicit arguments, warnings only: the recipes stay correct in every setup these checks flag, but may be
slower than bf16 or, for 8-bit optimizers, unstable.
"""

from __future__ import annotations

import warnings

import torch

from .kernels.formats import FORMATS


class LowBitWarning(UserWarning):
    """A setup in which a low-bit recipe is correct but likely slow or unstable."""


class UnsupportedSetupError(ValueError):
    """A recipe asked for in a (distributed) setup it cannot run in; the message names the setting and what to use
    instead (``hf-lowbit-sft`` prints it as one line and exits with status 2)."""


# Optimizers tested with INT8 mixed precision. 8-bit optimizers diverged with it in the seed's tests.
OPTIMIZER_ALLOWLIST = frozenset({
    "adamw_torch", "adamw_torch_fused", "adamw_hf", "adafactor", "sgd", "adagrad", "rmsprop",
})
# Below this many tokens per micro-batch, without gradient accumulation, quantization costs about what the
# low-bit matmuls save (H200, 8 Llama-8B layers at 2048 tokens: 0.97x bf16; with accumulation, where the
# weight cache pays, 1.15x; docs/benchmarks.md "Regimes").
MIN_TOKENS_FOR_SPEEDUP = 4 * 2048
# a mixed-precision recipe's name (its arguments field, MixedPrecisionConfig.recipe) -> its format's record
_RECIPE_FORMATS = {f"{name}_mixed_precision": fmt for name, fmt in FORMATS.items()}


def check_training_setup(*, recipes: list[str], device: torch.device | str, compiled: bool,
                         packed: bool | None, optimizer: str, tokens_per_step: int | None,
                         grad_accum: int = 1, emit: bool = True) -> list[str]:
    """Return (and, with ``emit``, ``warnings.warn``) what in this setup works against the recipes.

    ``packed``: whether every training sequence has one length (None: unknown);
    ``tokens_per_step``: tokens in one micro-batch on one device (None: unknown); ``grad_accum``:
    micro-batches per optimizer step.
    """
    if not recipes:
        return []
    names = "+".join(recipes)
    device = torch.device(device)
    found = []
    # the compute capability whose tensor cores the recipes' formats use (INT8: Ampere; FP8 e4m3: Ada/Hopper)
    fmt = max((_RECIPE_FORMATS.get(r, FORMATS["int8"]) for r in recipes), key=lambda f: f.min_capability)
    need, cores = fmt.min_capability, fmt.tensor_cores
    if device.type != "cuda":
        found.append(f"{names} on {device.type}: results are correct but not faster than bf16; the speedup "
                     f"needs an NVIDIA GPU with {cores} tensor cores (sm_{need[0]}{need[1]} or newer).")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < need:
            found.append(f"{names} on a GPU of compute capability {major}.{minor}: the speedup needs "
                         f"{cores} tensor cores, sm_{need[0]}{need[1]} or newer.")
    if not compiled:
        found.append(f"{names} without torch_compile=True: quantization runs as separate eager kernels and "
                     "training will be slower than bf16. Set torch_compile=True.")
    if packed is False:
        found.append(f"{names} with sequences of varying length: every new shape recompiles and re-autotunes. "
                     "Pack the data into fixed-length blocks (scripts/sft.py does by default).")
    if optimizer not in OPTIMIZER_ALLOWLIST:
        found.append(f"optim={optimizer!r} has not been validated with {names} (8-bit optimizers diverged with "
                     f"INT8 mixed precision); validated: {', '.join(sorted(OPTIMIZER_ALLOWLIST))}.")
    if tokens_per_step is not None and tokens_per_step < MIN_TOKENS_FOR_SPEEDUP and grad_accum == 1:
        found.append(f"{tokens_per_step} tokens per micro-batch without gradient accumulation: {names} pays from "
                     f"about {MIN_TOKENS_FOR_SPEEDUP} (per_device_train_batch_size x sequence length), or with "
                     "gradient_accumulation_steps > 1 (each weight is then quantized once per optimizer step); "
                     "below that expect about bf16's speed.")
    if emit:
        for msg in found:
            warnings.warn(msg, LowBitWarning, stacklevel=2)
    return found
