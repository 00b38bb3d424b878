"""Triton launches on their operands' GPU."""

from __future__ import annotations

import functools

import torch


def on_operand_device(fn):
    """``fn``, a function that launches Triton kernels, run with the CUDA device of its first CUDA tensor argument
    (positional, then keyword) current.

    Why: Triton launches on the current CUDA device and its current stream, not on the tensors' device. A model
    spread over GPUs (``device_map="auto"``) runs a layer on ``cuda:1`` while ``cuda:0`` is current, and the kernel
    then faults or reads across devices, unordered with that device's stream (the same issue as Liger-Kernel #1303).
    Code Dynamo traces skips the check (Inductor sets the device of what it compiles); where a ``triton_op``'s body
    is traced on fake tensors (torch 2.11 does so outside Dynamo's flag) it may switch the device while tracing,
    which records nothing; with fewer than two GPUs it does nothing (one cached ``device_count()`` a launch)."""

    @functools.wraps(fn)
    def launch(*args, **kwargs):
        if not torch.compiler.is_compiling():  # (traced by Dynamo: nothing to decide here)
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    if (t.device.index is not None and torch.cuda.device_count() > 1  # (cached: one GPU, no switch)
                            and t.device.index != torch.cuda.current_device()):
                        with torch.cuda.device(t.device):
                            return fn(*args, **kwargs)
                    break
        return fn(*args, **kwargs)

    launch._hf_lowbit_on_operand_device = True
    return launch
