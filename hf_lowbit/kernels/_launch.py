"""Triton launches on their operands' GPU."""

from __future__ import annotations

import functools

import torch


def on_operand_device(fn):
    """``fn``, a function that launches Triton kernels, run with its first tensor argument's CUDA device current.

    Why: Triton launches on the current CUDA device and its current stream, not on the tensors' device. A model
    spread over GPUs (``device_map="auto"``) runs a layer on ``cuda:1`` while ``cuda:0`` is current, and the kernel
    then faults or reads across devices, unordered with that device's stream (the same issue as Liger-Kernel #1303).
    Compiled code sets the device itself (Inductor's device guards), so this acts on eager calls only; a call whose
    operand is on the current device costs one ``current_device()``."""

    @functools.wraps(fn)
    def launch(*args, **kwargs):
        if not torch.compiler.is_compiling():  # (traced by Dynamo: nothing to decide here)
            for t in args:
                if isinstance(t, torch.Tensor):
                    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
                        with torch.cuda.device(t.device):
                            return fn(*args, **kwargs)
                    break
        return fn(*args, **kwargs)

    launch._hf_lowbit_on_operand_device = True
    return launch
