"""``LowBitAdamW``: ``torch.optim.AdamW`` whose large parameters take one Triton pass each, which for a cached
low-bit weight also refreshes its cache.

Two costs it goes after (issue 25; docs/benchmarks.md, "Issue 25 at 6b81e90" and after):

* torch's fused AdamW spent 10.5 ms a step on 8 Llama-8B layers and their embeddings (2.0 B bf16 parameters) on
  the H200: ~2.7 TB/s of its least traffic (14 bytes an element), 22% of a 1x2048 step in every recipe. Every
  parameter of at least ``kernel_min_numel`` elements (default 2**20: the weights, embeddings, the LM head; not
  norms, biases or LoRA adapters, whose launches would cost more than they move) is updated by
  :func:`hf_lowbit.kernels.adamw.adamw_rows_` instead: one elementwise pass, 16-byte accesses.
* With the weight cache on (``MixedPrecisionLinear.set_weight_cache``, ``LowBitTrainingArguments.lowbit_weight_cache``)
  every low-bit weight is re-quantized after each step by the rows kernel, which reads the weight twice (absmax,
  then encode) right after AdamW read and wrote it: ~5 ms a step for those 8 layers. For a cached weight scaled per
  row the kernel's pass also leaves each row's absmax, and the refresh reads the weight once
  (``quantize_weight(..., row_amax=...)``): 4 bytes a weight element of refresh traffic instead of 6.

Everything else is torch's: the other parameters (small ones, a weight off CUDA (but under Triton's CPU
interpreter), a tensor subclass such as FSDP2's ``DTensor``, groups with ``amsgrad`` / ``maximize`` / ``capturable``
/ ``differentiable``) take ``torch.optim.AdamW.step`` with the options given (``fused=True`` as the Trainer's
``adamw_torch_fused``); the state (``step``, ``exp_avg``, ``exp_avg_sq``) is torch's, so ``state_dict`` /
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
# what the kernel computes exactly as torch's fused AdamW does (in float32); float64 stays torch's
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _torch_step(optimizer: torch.optim.AdamW) -> None:
    """``torch.optim.AdamW.step`` without the hooks torch wraps around a class's ``step`` once an instance of it
    exists (they run around :meth:`LowBitAdamW.step` itself: the weight cache's post-step hook must see the
    weights this class updates after its kernel, not before)."""
    fn = torch.optim.AdamW.step
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    fn(optimizer)


def _pieces(t: Tensor) -> list[Tensor]:
    """A contiguous tensor as the kernel's ``[R, K]`` operands (the update is elementwise: any split of the same
    elements will do): rows of 1024 elements, and the rest, if any, as one more row."""
    flat = t.view(-1)
    whole = flat.numel() - flat.numel() % 1024
    return [x for x in (flat[:whole].view(-1, 1024), flat[whole:].view(1, -1)) if x.numel()]


class LowBitAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, same state) that updates each parameter of at least
    ``kernel_min_numel`` elements, and each cached low-bit weight scaled per row whatever its size, with hf_lowbit's
    one-pass kernel, and refreshes such a weight's cache from the row absmax that pass leaves (the weight read
    once); see the module docstring. ``kernel_min_numel=None``: the cached weights only.
    ``LowBitTrainingArguments(lowbit_fused_adamw=True)`` makes ``LowBitTrainer`` use it."""

    def __init__(self, params, *args, kernel_min_numel: int | None = 1 << 20, **kwargs):
        if kernel_min_numel is not None and (isinstance(kernel_min_numel, bool) or not isinstance(kernel_min_numel, int)
                                             or kernel_min_numel < 0):
            raise ValueError(f"LowBitAdamW: kernel_min_numel must be an int >= 0 or None, got {kernel_min_numel!r}")
        super().__init__(params, *args, **kwargs)
        self.kernel_min_numel = kernel_min_numel
        # torch's fused AdamW takes GradScaler's scale and inf flag into its step (fp16 AMP); the kernel does not, so
        # GradScaler is asked to unscale the gradients and to skip a step with an inf itself, as for other optimizers
        self._step_supports_amp_scaling = False
        self._lowbit_init()

    def _lowbit_init(self) -> None:
        self._lowbit_steps: dict[Tensor, int] = {}  # this class's step count per parameter it updated (host ints)
        self._lowbit_amax: dict[Tensor, Tensor] = {}  # per cached weight: int32 row absmax bits, reused every step
        self._lowbit_views: dict[Tensor, tuple] = {}  # per other parameter: its and its moments' kernel operands
        # the weights whose cache the last step refreshed itself (the global step post-hook skips them)
        self.lowbit_refreshed: set[int] = set()

    def __getstate__(self):  # pickle / deepcopy: torch keeps defaults, state and groups; the counts go into the state
        self._sync_steps()
        return {**super().__getstate__(), "kernel_min_numel": self.kernel_min_numel}

    def __setstate__(self, state):
        super().__setstate__(state)  # (torch's: the dict's entries become attributes)
        self.__dict__.setdefault("kernel_min_numel", None)  # pickled before it existed: the cached weights only
        self._lowbit_init()

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.AdamW, **kwargs) -> "LowBitAdamW":
        """The same parameter groups and options as ``optimizer`` (a ``torch.optim.AdamW`` not yet stepped, as
        ``Trainer.create_optimizer`` makes it); ``kwargs``: this class's own (``kernel_min_numel``)."""
        if not isinstance(optimizer, torch.optim.AdamW):
            raise TypeError(f"LowBitAdamW.from_optimizer: a torch.optim.AdamW, got {type(optimizer).__name__}")
        if optimizer.state:
            raise ValueError("LowBitAdamW.from_optimizer: the optimizer has state already; build LowBitAdamW before "
                             "the first step (or load its state_dict into a new LowBitAdamW)")
        import inspect

        accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
        return cls(optimizer.param_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted}, **kwargs)

    def _owners(self) -> dict[int, list]:
        """The cached low-bit layers by ``id`` of their weight (the layers' own registry; a tied weight has several)."""
        from .linear import _CACHED_LAYERS

        owners: dict[int, list] = {}
        for layer in list(_CACHED_LAYERS):
            owners.setdefault(id(layer.weight), []).append(layer)
        return owners

    def _takes(self, group: dict, p: Tensor, layers: list) -> tuple[bool, bool]:
        """``(the kernel updates p, its pass refreshes p's cache)``: ``p`` a cached weight scaled per row (in every
        layer that holds it), or at least ``kernel_min_numel`` elements; a plain dense tensor on CUDA (or under the
        interpreter) with a gradient of its shape, both contiguous; the group's options the kernel's."""
        if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable") \
                or not group.get("decoupled_weight_decay", True):
            return False, False
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False, False  # set by a GradScaler that handles this optimizer's scaling itself: torch's step
        g = p.grad
        if not (type(p) in (torch.Tensor, torch.nn.Parameter) and (p.is_cuda or _INTERPRETED) and p.dim() >= 1
                and p.is_contiguous() and p.dtype in _KERNEL_DTYPES and g is not None and type(g) is torch.Tensor
                and not g.is_sparse and g.shape == p.shape and g.is_contiguous() and g.device == p.device
                and g.dtype in _KERNEL_DTYPES):
            return False, False  # (float64 too: the kernel computes in float32, torch's step in float64)
        st = self.state.get(p)
        if st and not all(isinstance(st.get(k), torch.Tensor) and st[k].shape == p.shape and st[k].is_contiguous()
                          and st[k].device == p.device and st[k].dtype in _KERNEL_DTYPES
                          for k in ("exp_avg", "exp_avg_sq")):
            return False, False  # a loaded state in another layout: torch's step takes it as it is
        cached = bool(layers) and p.dim() == 2 and all(
            layer.weight_cache and not get_format(layer.lowbit_config.format).tensorwise for layer in layers)
        large = self.kernel_min_numel is not None and p.numel() >= self.kernel_min_numel
        return cached or large, cached

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

    def _views(self, p: Tensor, state: dict) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """:func:`_pieces` of ``p`` and its moments, kept while they are the same tensors (the optimizer's own
        host time a step is mostly such bookkeeping: ~46 us a parameter in Python)."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        key = (p.data_ptr(), m.data_ptr(), v.data_ptr(), p.shape, p.dtype, m.dtype, v.dtype)
        cached = self._lowbit_views.get(p)
        if cached is None or cached[0] != key:
            cached = self._lowbit_views[p] = (key, _pieces(p), _pieces(m), _pieces(v))
        return cached[1:]

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
        taken = []  # (group, p, its cached layers or None)
        idle = set()  # no gradient this step: nobody's step counts it (its host count kept: no re-read later)
        for group in self.param_groups:
            for p in group["params"]:
                kernel, cached = self._takes(group, p, owners.get(id(p), []))
                if kernel:
                    taken.append((group, p, owners[id(p)] if cached else None))
                elif p.grad is None:
                    idle.add(id(p))
        self.lowbit_refreshed = set()
        # a parameter this class stops taking continues from its true count in torch's step
        self._sync_steps(release=True, keep={id(p) for _, p, _ in taken} | idle)
        kept = {id(p) for _, p, layers in taken if layers is None}
        for p in [p for p in self._lowbit_views if id(p) not in kept]:  # nor keep its tensors (a moved model's) alive
            del self._lowbit_views[p]
        grads = [p.grad for _, p, _ in taken]
        for _, p, _ in taken:  # torch's step skips parameters without a gradient
            p.grad = None
        try:
            _torch_step(self)
        finally:
            for (_, p, _), g in zip(taken, grads):
                p.grad = g
        hyper = {}  # per group, read once (a tensor lr would otherwise sync the host for every parameter)
        for group, p, layers in taken:
            state, n = self._state(group, p)
            if id(group) not in hyper:
                (beta1, beta2), lr = group["betas"], float(group["lr"])
                hyper[id(group)] = dict(lr=lr, beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                                        weight_decay=group["weight_decay"])
            # (each launch on the parameter's GPU: hf_lowbit.kernels._launch, for a model spread over GPUs)
            if layers is not None:  # a cached weight: its rows are the cache's, their absmax the refresh's
                amax = self._lowbit_amax.get(p)
                if amax is None or amax.shape[0] != p.shape[0] or amax.device != p.device:
                    amax = self._lowbit_amax[p] = torch.empty(p.shape[0], dtype=torch.int32, device=p.device)
                adamw_rows_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], n, row_amax=amax, **hyper[id(group)])
            else:
                ps, ms, vs = self._views(p, state)
                for pp, gp, mp, vp in zip(ps, _pieces(p.grad), ms, vs):
                    adamw_rows_(pp, gp, mp, vp, n, **hyper[id(group)])
            self._lowbit_steps[p] = n
            torch.autograd.graph.increment_version(p)  # a raw kernel's write: what an in-place op would record
            if layers is not None:
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
        self._lowbit_views.clear()  # (they would keep the replaced moments alive until then)
