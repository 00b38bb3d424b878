"""Low-bit FSDP2 all-gather for INT8/FP8 mixed precision (opt-in: ``lowbit_fsdp_lowbit_all_gather``).

Plain FSDP2 all-gathers each ``MixedPrecisionLinear`` weight in the policy's ``param_dtype`` (bf16: 2 bytes
a weight) and the forward then quantizes the gathered weight row-wise. Here the weight's sharded parameter
is wrapped in :class:`LowBitAllGatherWeight`, whose FSDP2 extension hooks quantize the *local shard* before
the all-gather and hand the layer the gathered codes:

* ``fsdp_pre_all_gather``: FSDP2 shards dim 0, so a rank holds whole output rows of ``W [N, K]`` and its
  per-row scales are exactly the unsharded weight's. The shard, cast to ``param_dtype`` as FSDP2 would cast
  it, is quantized by ``hf_lowbit.kernels.quantize_operand(fmt, w, 1)`` (the forward's own quantization), and
  the codes (int8 / float8 e4m3) and float32 row scales are all-gathered: 1 + 4/K bytes a weight. FSDP2
  moves inputs of mixed dtypes as bytes (``uint8`` views), so both formats travel bit for bit.
* ``fsdp_post_all_gather``: a :class:`GatheredLowBitWeight` (outer shape ``[N, K]``, dtype ``param_dtype``)
  over the gathered ``(q, s)``; ``MixedPrecisionLinear.forward`` passes them to the autograd Function as its
  ``cached`` weight (the input gradient transposes ``q`` in the backward). The Function returns the weight
  gradient in the outer dtype, so FSDP2 reduce-scatters it onto the high-precision shard as usual.

The forward and both gradients are therefore bit-identical to FSDP2's default path (tests/_fsdp2_lowbit_all_gather.py).

Not covered, refused with a message naming the flag: weights split unevenly across ranks (``N`` not a
multiple of the shard count; those fall back to the ``param_dtype`` gather with a ``LowBitWarning``; on a
single rank, where FSDP2 gathers nothing and reads only the first input, every weight takes that path), layers
with ``output`` or ``grad_input`` off (they need the weight itself), the layer's weight cache,
``torch.compile`` of the layer (the gathered subclass is not traceable), FSDP2's ``reshard_after_forward=<int>``.
Not measured on GPUs. ``state_dict()`` holds plain tensors (a state-dict hook unwraps the wrapper).
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..kernels import quantize_operand
from ..warnings import LowBitWarning

FLAG = "lowbit_fsdp_lowbit_all_gather"

aten = torch.ops.aten
# ops whose results keep the wrapper: what FSDP2 applies while sharding, padding, moving and loading the
# parameter. Everything else (the optimizer's arithmetic, zeros_like for its state, reductions) returns
# plain tensors, so optimizer state never holds the wrapper.
_KEEP_WRAPPER = {aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
                 aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
                 aten.split_with_sizes.default, aten.clone.default, aten.detach.default, aten.alias.default}
_WARNED_UNEVEN: set[tuple] = set()


def _wrapper_new(cls, t: Tensor):
    return Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                         dtype=t.dtype, layout=t.layout, device=t.device,
                                         requires_grad=t.requires_grad)


class LowBitAllGatherWeight(Tensor):
    """A high-precision weight (what the optimizer updates) that FSDP2 all-gathers quantized row-wise.

    A wrapper subclass over ``_tensor`` with its dtype; ops unwrap, and the sharding ops in
    ``_KEEP_WRAPPER`` re-wrap. ``fmt``: ``"int8"`` or ``"fp8"``."""

    @staticmethod
    def __new__(cls, tensor: Tensor, fmt: str):
        return _wrapper_new(cls, tensor)

    def __init__(self, tensor: Tensor, fmt: str):
        self._tensor = tensor
        self._fmt = fmt

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fmt = next(a._fmt for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPER:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, fmt), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"fmt": self._fmt}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return LowBitAllGatherWeight(inner["_tensor"], meta["fmt"])

    def __repr__(self):
        return f"LowBitAllGatherWeight({self._fmt}, {self._tensor!r})"

    def __deepcopy__(self, memo):
        """``copy.deepcopy`` of a model (Tensor's own clones storage, which a wrapper does not have)."""
        if id(self) not in memo:
            new = LowBitAllGatherWeight(self._tensor.clone(), self._fmt)
            memo[id(self)] = (nn.Parameter(new, requires_grad=self.requires_grad) if getattr(self, "_is_param", False)
                              else new.requires_grad_(self.requires_grad))
        return memo[id(self)]

    @property
    def data(self):
        return Tensor.data.__get__(self)

    @data.setter
    def data(self, new: Tensor) -> None:
        """``param.data = t`` (accelerate's FSDP2 prepare upcasts trainable bf16 parameters to float32 this way)
        replaces the outer tensor's metadata only; the held tensor, a Python attribute, must follow or the
        wrapper would report float32 while holding (and FSDP2 sharding, the optimizer updating) the bf16 one."""
        if not isinstance(new, LowBitAllGatherWeight):
            new = LowBitAllGatherWeight(new.detach(), self._fmt)
        Tensor.data.__set__(self, new)
        self._tensor = new._tensor

    def data_ptr(self) -> int:
        """The held tensor's (a wrapper has no storage of its own: 0 for every weight). accelerate's FSDP2
        ``prepare`` maps the optimizer's parameters to the sharded ones by ``data_ptr()``; with 0 everywhere all
        wrapped weights collapsed onto one and the others were never updated."""
        return self._tensor.data_ptr()

    # FSDP2's extension hooks (torch 2.11 and 2.13 call the 5-argument form: _fsdp_param.FSDPParam.all_gather_inputs)
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        w = self._tensor
        param_dtype = mp_policy.param_dtype or w.dtype
        shards = mesh.size()
        if shards == 1:  # FSDP2 gathers nothing on one rank and reads only the first input: the weight as is
            return (w.to(param_dtype),), None
        if outer_size[0] % shards:  # FSDP2 demands padded-shard-sized inputs then: scales [rows] cannot be
            key = (tuple(outer_size), shards)
            if key not in _WARNED_UNEVEN:
                _WARNED_UNEVEN.add(key)
                warnings.warn(f"{FLAG}: a weight of {tuple(outer_size)} does not split evenly over {shards} "
                              f"ranks; it is all-gathered in {param_dtype} as without the flag", LowBitWarning)
            rows = -(-outer_size[0] // shards)
            padded = w.new_zeros((rows, *w.shape[1:]), dtype=param_dtype)
            padded[:w.shape[0]].copy_(w)
            return (padded,), None
        q, s = quantize_operand(self._fmt, w.to(param_dtype), 1)
        return (q, s.float()), (self._fmt,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if metadata is None:  # the uneven fallback: the gathered high-precision weight itself
            (w,) = outputs
            return None if out is not None else (w, (w,))
        if out is not None:  # FSDP2 refilled the same output storages that `out` views: nothing to rebuild
            return None
        q, s = outputs
        return GatheredLowBitWeight(q, s, param_dtype, metadata[0]), (q, s)


class GatheredLowBitWeight(Tensor):
    """The all-gathered weight as the layer consumes it: codes ``q [N, K]`` and row scales ``s [N]`` under
    an outer ``[N, K]`` tensor of the compute dtype (the dtype its gradient has). Only ``MixedPrecisionLinear``
    reads it (its ``q``/``s``); any other op on it raises, rather than silently computing on codes."""

    @staticmethod
    def __new__(cls, q: Tensor, s: Tensor, dtype: torch.dtype, fmt: str, requires_grad: bool = False):
        return Tensor._make_wrapper_subclass(cls, q.size(), strides=q.stride(), dtype=dtype, device=q.device,
                                             requires_grad=requires_grad)

    def __init__(self, q: Tensor, s: Tensor, dtype: torch.dtype, fmt: str, requires_grad: bool = False):
        self.q, self.s, self.fmt = q, s, fmt

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default):  # FSDP2 / nn.Parameter
            t = args[0]
            return cls(t.q, t.s, t.dtype, t.fmt)
        raise NotImplementedError(f"{FLAG}: {func} on an all-gathered low-bit weight (only MixedPrecisionLinear's "
                                  "forward reads it); switch the flag off for this use")

    def __repr__(self):
        return f"GatheredLowBitWeight({self.fmt}, shape={tuple(self.shape)}, dtype={self.dtype})"


def gathered_operands(w: GatheredLowBitWeight) -> tuple:
    """The ``cached`` operand of ``_MixedPrecisionLinearFn`` for a gathered weight: ``(q, s, None)`` (the
    backward transposes ``q``). Refused under ``torch.compile``, which cannot trace the wrapper yet."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{FLAG}: torch.compile of a layer whose weight FSDP2 gathers in low bits is not "
                           "supported; switch the flag off or compile without it")
    return w.q, w.s, None


def _unwrap_state_dict(module, state_dict, prefix, local_metadata):
    """State-dict hook: ``weight`` as a plain tensor (a DTensor over a plain local shard under FSDP2)."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    v = state_dict.get(key)
    if isinstance(v, DTensor) and isinstance(v._local_tensor, LowBitAllGatherWeight):
        state_dict[key] = DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements,
                                             shape=v.shape, stride=v.stride())
    elif isinstance(v, LowBitAllGatherWeight):
        state_dict[key] = v._tensor
    return state_dict


def lowbit_all_gather_enabled(module: nn.Module) -> bool:
    """Whether ``module.weight`` is (sharded or not) a :class:`LowBitAllGatherWeight`."""
    from torch.distributed.tensor import DTensor

    w = getattr(module, "weight", None)
    w = w._local_tensor if isinstance(w, DTensor) else w
    return isinstance(w, LowBitAllGatherWeight)


__all__ = ["FLAG", "GatheredLowBitWeight", "LowBitAllGatherWeight", "gathered_operands", "lowbit_all_gather_enabled"]
