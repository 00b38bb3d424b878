"""``LowBitAdamW``: ``torch.optim.AdamW`` whose pass over each cached low-bit weight also refreshes its cache.

With the weight cache on (``MixedPrecisionLinear.set_weight_cache``, ``LowBitTrainingArguments.lowbit_weight_cache``)
every low-bit weight is re-quantized after each optimizer step by the rows kernel, which reads the weight twice
(absmax, then encode) right after AdamW read and wrote it: ~5 ms a step for 8 Llama-8B layers on the H200
(docs/benchmarks.md, "Issue 25 at c62cf15"). Here AdamW's own pass over such a weight
(:func:`hf_lowbit.kernels.adamw.adamw_rows_`, one Triton kernel) leaves each row's absmax, and the refresh reads the
weight once (``quantize_weight(..., row_amax=...)``): 4 bytes a weight element of refresh traffic instead of 6.

Everything else is torch's: parameters that are not cached low-bit weights (embeddings, norms, the LM head, a weight
off CUDA (but under Triton's CPU interpreter), a tensorwise format, groups with ``amsgrad`` / ``maximize`` /
``capturable`` / ``differentiable``) take ``torch.optim.AdamW.step`` with the options given (``fused=True`` as the
Trainer's ``adamw_torch_fused``); the state (``step``, ``exp_avg``, ``exp_avg_sq``) is torch's, so ``state_dict`` /
``load_state_dict`` and checkpoints move between the two classes. The update is AdamW's in float32, rounded once
when stored, as torch's fused CUDA kernel computes it (bits: :mod:`hf_lowbit.kernels.adamw`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..kernels import get_format
from ..kernels.adamw import adamw_rows_

try:  # the dtype torch's AdamW keeps its step counts in (float32; float64 under a float64 default dtype)
    from torch.optim.optimizer import _get_scalar_dtype
except ImportError:  # pragma: no cover - older torch
    def _get_scalar_dtype(is_fused=None):
        return torch.float64 if torch.get_default_dtype() == torch.float64 and not is_fused else torch.float32


# Triton's CPU interpreter (the tests): the kernel runs on CPU tensors too
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _torch_step(optimizer: torch.optim.AdamW) -> None:
    """``torch.optim.AdamW.step`` without the hooks torch wraps around a class's ``step`` once an instance of it
    exists (they run around :meth:`LowBitAdamW.step` itself: the weight cache's post-step hook must see the
    weights this class updates after its kernel, not before)."""
    fn = torch.optim.AdamW.step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    fn(optimizer)


class LowBitAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, same state) that updates each cached low-bit weight with hf_lowbit's
    one-pass kernel and refreshes that weight's cache from the row absmax it leaves (the weight read once); see
    the module docstring. ``LowBitTrainingArguments(lowbit_fused_adamw=True)`` makes ``LowBitTrainer`` use it."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        # torch's fused AdamW takes GradScaler's scale and inf flag into its step (fp16 AMP); the kernel does not, so
        # GradScaler is asked to unscale the gradients and to skip a step with an inf itself, as for other optimizers
        self._step_supports_amp_scaling = False
        self._lowbit_init()

    def _lowbit_init(self) -> None:
        self._lowbit_steps: dict[Tensor, int] = {}  # this class's step count per weight it updated (host ints)
        self._lowbit_amax: dict[Tensor, Tensor] = {}  # per weight: int32 row absmax bits, reused every step
        # the weights whose cache the last step refreshed itself (the global step post-hook skips them)
        self.lowbit_refreshed: set[int] = set()

    def __getstate__(self):  # pickle / deepcopy: torch keeps defaults, state and groups; the counts go into the state
        self._sync_steps()
        return super().__getstate__()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lowbit_init()

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.AdamW) -> "LowBitAdamW":
        """The same parameter groups and options as ``optimizer`` (a ``torch.optim.AdamW`` not yet stepped, as
        ``Trainer.create_optimizer`` makes it)."""
        if not isinstance(optimizer, torch.optim.AdamW):
            raise TypeError(f"LowBitAdamW.from_optimizer: a torch.optim.AdamW, got {type(optimizer).__name__}")
        if optimizer.state:
            raise ValueError("LowBitAdamW.from_optimizer: the optimizer has state already; build LowBitAdamW before "
                             "the first step (or load its state_dict into a new LowBitAdamW)")
        import inspect

        accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
        return cls(optimizer.param_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def _owners(self) -> dict[int, list]:
        """The cached low-bit layers by ``id`` of their weight (the layers' own registry; a tied weight has several)."""
        from .linear import _CACHED_LAYERS

        owners: dict[int, list] = {}
        for layer in list(_CACHED_LAYERS):
            owners.setdefault(id(layer.weight), []).append(layer)
        return owners

    def _eligible(self, group: dict, p: Tensor, layers: list) -> bool:
        if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable") \
                or not group.get("decoupled_weight_decay", True):
            return False
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False  # set by a GradScaler that handles this optimizer's scaling itself: torch's step takes it
        g = p.grad
        return ((p.is_cuda or _INTERPRETED) and p.dim() == 2 and p.is_contiguous() and p.is_floating_point()
                and g is not None and not g.is_sparse and g.shape == p.shape and g.is_contiguous()
                and g.device == p.device
                and all(layer.weight_cache and not get_format(layer.lowbit_config.format).tensorwise
                        for layer in layers))

    def _state(self, group: dict, p: Tensor) -> tuple[dict, int]:
        """``p``'s state as torch's AdamW initializes it, and the step this update makes (counted by the caller
        once the update ran). The count is kept on the host (the kernel's bias corrections need it there); the
        state's ``step`` tensor is written from it by :meth:`state_dict`, pickling and when the weight goes back
        to torch's step."""
        state = self.state[p]
        if not state:
            fused = bool(group.get("fused")) or bool(group.get("capturable"))
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device) if fused
                             else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._lowbit_steps[p] = 0
        elif p not in self._lowbit_steps:  # taken after torch's steps or a load: its count (one host read)
            self._lowbit_steps[p] = int(state["step"].item())
        return state, self._lowbit_steps[p] + 1

    def _sync_steps(self, release: bool = False, keep: set[int] = frozenset()) -> None:
        """Write the host step counts into the state's ``step`` tensors: all of them, or with ``release`` those of
        the weights not in ``keep`` (handed back to torch's step, which counts in the tensor)."""
        for p in list(self._lowbit_steps):
            if release and id(p) in keep:
                continue
            self.state[p]["step"].fill_(self._lowbit_steps[p])
            if release:
                del self._lowbit_steps[p]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owners = self._owners()
        taken = [(group, p, owners[id(p)]) for group in self.param_groups for p in group["params"]
                 if id(p) in owners and self._eligible(group, p, owners[id(p)])]
        self.lowbit_refreshed = set()
        # a weight this class stops taking continues from its true count in torch's step
        self._sync_steps(release=True, keep={id(p) for _, p, _ in taken})
        grads = [p.grad for _, p, _ in taken]
        for _, p, _ in taken:  # torch's step skips parameters without a gradient
            p.grad = None
        try:
            _torch_step(self)
        finally:
            for (_, p, _), g in zip(taken, grads):
                p.grad = g
        for group, p, layers in taken:
            state, n = self._state(group, p)
            beta1, beta2 = group["betas"]
            amax = self._lowbit_amax.get(p)
            if amax is None or amax.shape[0] != p.shape[0] or amax.device != p.device:
                amax = self._lowbit_amax[p] = torch.empty(p.shape[0], dtype=torch.int32, device=p.device)
            adamw_rows_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], n, lr=float(group["lr"]),
                        beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                        weight_decay=group["weight_decay"], row_amax=amax)
            self._lowbit_steps[p] = n
            torch.autograd.graph.increment_version(p)  # a raw kernel's write: what an in-place op would record
            for layer in layers:  # a tied weight: every layer's cache
                layer.refresh_weight_cache(force=True, row_amax=amax)
            self.lowbit_refreshed.add(id(p))
        return loss

    def state_dict(self):
        self._sync_steps()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._lowbit_steps.clear()  # re-read from the loaded state at the next step
