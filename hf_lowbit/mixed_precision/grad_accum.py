"""Gradient accumulation fused into the weight-gradient matmul (issue 25).

With ``gradient_accumulation_steps > 1`` autograd writes every micro-batch's weight gradient to a fresh tensor and
adds it into ``.grad`` with a separate kernel: per weight element and micro-batch the matmul writes 2 bytes (bf16)
and the add reads 4 and writes 2. On the H200 that add was ~20 ms of each optimizer step of 8 Llama-8B-shaped layers
at 1x2048 tokens and accumulation 8 (docs/benchmarks.md), in every recipe. :class:`FusedGradAccumulation` gives each
low-bit linear a persistent accumulator that *is* its weight's ``.grad``; the weight-gradient matmul adds into it in
its epilogue (``hf_lowbit::scaled_mm_accumulate_``: 4 bytes an element, one rounding) and returns nothing to
autograd for the weight. Megatron-LM calls this ``gradient_accumulation_fusion``.

The contract, which :meth:`FusedGradAccumulation.prepare` keeps: before each micro-batch's backward, every covered
weight's ``.grad`` is its accumulator; a ``.grad`` of None (``zero_grad()``'s default) starts a new accumulation from
zeros (so a layer that gets no gradient in a step holds zeros, as after ``zero_grad(set_to_none=False)``), one set
by anything else is copied in. ``LowBitTrainer`` calls it per micro-batch (with ``lowbit_fused_grad_accum=True``:
off by default, as on the H200 it has not yet beaten autograd's add; docs/benchmarks.md); a custom loop must too (an
optimizer step over a covered weight whose ``.grad`` is not its accumulator raises, naming this). Not under DDP /
FSDP / DeepSpeed / DataParallel, whose hooks or replicas take each gradient from autograd.

What differs from autograd's accumulation, by design: a covered weight gets zeros, not None, in a step where no
gradient reaches it (AdamW's momentum and weight decay then still move it, as after ``zero_grad(set_to_none=False)``:
mind mixture-of-experts layers whose experts may see no tokens); every backward through a covered layer adds into
its ``.grad``, also ``torch.autograd.grad(loss, inputs)`` and ``backward(inputs=[x])``, which leave ``.grad`` alone
otherwise; hooks registered on the weight with ``register_hook`` are called with None (post-accumulate-grad hooks
still run), and ``torch.autograd.grad(loss, weight)`` finds the weight unused. ``lowbit_dual_grad_quant`` is not
used where a weight gradient is accumulated so. Eagerly, a backward whose weight's ``.grad`` is not its accumulator
raises; compiled, only the optimizer-step check below can tell.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from .linear import MixedPrecisionLinear

# Every covered layer, whichever handle covered it and whether that handle is still referenced (a layer keeps its
# accumulator until close(), so a dropped handle must not drop the check).
_COVERED: "weakref.WeakSet[MixedPrecisionLinear]" = weakref.WeakSet()
_STEP_HOOK = None


def _check_before_step(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook: refuse a step whose covered weights' ``.grad`` is not the accumulator their
    matmuls wrote into (their gradient would be lost, or stale)."""
    if not _COVERED:
        return
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for layer in list(_COVERED):
        w = layer.weight
        if id(w) in params and w.requires_grad and layer.grad_acc is not None and w.grad is not layer.grad_acc:
            raise RuntimeError(
                f"fused gradient accumulation: the .grad of a low-bit linear's weight {tuple(w.shape)} is not the "
                "accumulator its matmul adds into (zero_grad() set it to None, or something replaced it): call "
                "FusedGradAccumulation.prepare() before every micro-batch (LowBitTrainer does), or close() the handle")


class FusedGradAccumulation:
    """The low-bit linears of ``model`` whose weight gradients accumulate in their matmul (see the module doc).

    Covered: :class:`MixedPrecisionLinear` layers whose weight trains, whose weight-gradient matmul is low-bit, and
    whose weight Parameter appears once in the model (a tied weight also gets gradients through autograd, which
    would have to land in the same tensor in order). A layer called more than once in a forward is fine (each call
    adds its product). ``layers`` lists them; :meth:`close` gives them back to autograd. Make one handle per model
    and keep it: a second one over the same layers is refused."""

    def __init__(self, model: nn.Module):
        global _STEP_HOOK
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        self.layers = [m for m in model.modules() if isinstance(m, MixedPrecisionLinear)
                       and m.weight.requires_grad and m.lowbit_config.grad_weight and uses.get(id(m.weight)) == 1
                       and m.weight.device.type != "meta"]
        taken = [name for name, m in model.named_modules() if m in self.layers and m.grad_acc is not None]
        if taken:
            raise ValueError(f"FusedGradAccumulation: {len(taken)} linears (first {taken[0]!r}) are covered by "
                             "another handle already; close() it first, or keep using it")
        for layer in self.layers:
            layer.grad_acc = self._accumulator(layer.weight)
            _COVERED.add(layer)
        if _STEP_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _STEP_HOOK = register_optimizer_step_pre_hook(_check_before_step)

    @staticmethod
    def _accumulator(w: Tensor) -> Tensor:
        acc = torch.zeros_like(w, memory_format=torch.contiguous_format)
        if acc.is_cuda:  # CUDA graphs write into it where it is: a static input, never copied in
            torch._dynamo.mark_static_address(acc)
        return acc

    def prepare(self) -> None:
        """Make every covered weight's ``.grad`` its accumulator, before a micro-batch's forward and backward: a
        ``.grad`` of None starts from zeros (one ``_foreach_zero_`` launch for all of them), another tensor is copied
        in; an accumulator whose weight changed dtype, device or shape is reallocated; a weight frozen since
        (``requires_grad_(False)``) is left alone."""
        fresh = []
        for layer in self.layers:
            w, acc = layer.weight, layer.grad_acc
            if not w.requires_grad:
                continue
            if acc is None or acc.shape != w.shape or acc.dtype != w.dtype or acc.device != w.device:
                acc = layer.grad_acc = self._accumulator(w)
            if w.grad is acc:
                continue
            if w.grad is None:
                fresh.append(acc)
            else:
                acc.copy_(w.grad)
            w.grad = acc
        if fresh:
            torch._foreach_zero_(fresh)

    def close(self) -> None:
        """Stop: the layers return their weight gradients to autograd again; each ``.grad`` keeps its current value
        (the accumulator becomes an ordinary ``.grad``, which the next ``zero_grad()`` frees)."""
        for layer in self.layers:
            layer.grad_acc = None
            _COVERED.discard(layer)
        self.layers = []


def enable_fused_grad_accumulation(model: nn.Module) -> FusedGradAccumulation:
    """Cover ``model``'s low-bit linears (see :class:`FusedGradAccumulation`) and return the handle: call this once,
    then the handle's :meth:`~FusedGradAccumulation.prepare` before each micro-batch, and its
    :meth:`~FusedGradAccumulation.close` when training ends."""
    return FusedGradAccumulation(model)
