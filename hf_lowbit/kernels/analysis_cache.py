"""One analysis per distinct Triton launch signature when ``torch.compile`` traces user-defined Triton kernels.

Every ``triton_op`` / ``wrap_triton`` launch that AOTAutograd functionalizes or Inductor lowers makes torch
generate the kernel's TTIR and walk it to find which arguments the kernel reads and writes
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``; ``identify_mutated_tensors`` in older
releases). torch does that for each call site, two to three times (functionalization, the graph's lowering, the
kernel's IR node), with no cache: a compiled model whose decoder layers are inlined into one graph (the Trainer's
``torch_compile=True``) repeats the same analyses for every layer. Measured on the CPU (the CUDA graph of a tiny
4-layer Llama traced with a stand-in sm_90 target, AOTAutograd's trace and partition only): 168 TTIR generations,
3.6 of the 14.1 s, ~42 a layer before Inductor's own.

The result is a pure function of what torch feeds the TTIR generator: the kernel, each argument's kind (a symbolic
size becomes the constant 2, a fake tensor an empty tensor of its dtype, other values pass as they are, and Triton
specializes integers on their value), the TMA descriptor metadata, and the target. :func:`install` wraps torch's
function with a cache on exactly that key (launches with a real tensor, or an unhashable value, are not cached) and
returns a copy of the cached result, so callers may mutate theirs. Set ``HF_LOWBIT_TRITON_ANALYSIS_CACHE=0`` to
leave torch's function alone.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch

_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")  # torch >= 2.10-ish / older releases
_UNCACHEABLE = object()
_stats = {"hits": 0, "misses": 0, "uncached": 0}


def _int_key(value: int) -> tuple:
    """A non-constexpr integer as Triton specializes it: its width, whether it is 1, whether 16 divides it."""
    width = "i32" if -2**31 <= value < 2**31 else ("i64" if -2**63 <= value < 2**63 else "u64")
    return ("int", width, value == 1, value % 16 == 0)


def _arg_key(value: Any, constexpr: bool) -> Any:
    """What generate_ttir sees of one argument (``_UNCACHEABLE`` for a real tensor or an unhashable value)."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("sym",)  # generate_ttir substitutes the constant 2
    if isinstance(value, FakeTensor):
        return ("tensor", value.dtype)  # generate_ttir substitutes torch.empty(2, dtype=...)
    try:
        from torch._inductor.ir import TensorBox
    except ImportError:  # pragma: no cover - Inductor always ships with torch
        TensorBox = ()
    if isinstance(value, TensorBox):
        return ("tensor", value.dtype)
    if isinstance(value, torch.Tensor):
        return _UNCACHEABLE  # a real tensor: Triton specializes on its pointer's alignment
    if not constexpr and type(value) is int:  # a size or a stride: the TTIR depends only on its specialization
        return _int_key(value)
    if not constexpr and type(value) is float:  # a float32 scalar argument, whatever its value
        return ("float",)
    try:
        hash(value)
    except TypeError:
        return _UNCACHEABLE
    return ("value", type(value), value)  # constexprs (inlined), bools, None, dtypes: by value


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    hash(value)
    return value


def _jit_function(kernel: Any) -> Any:
    """The JITFunction of a launch: an Autotuner's ``fn`` (a JITFunction's own ``fn`` is its Python function)."""
    return kernel.fn if hasattr(kernel, "configs") else kernel


def _runtime_args(kernel: Any) -> set[str]:
    """The kernel's parameters that are not constexprs (none known if that cannot be told: all keyed by value)."""
    fn = _jit_function(kernel)
    params, names = getattr(fn, "params", None), getattr(fn, "arg_names", None)
    if params is None or names is None:
        return set()
    return {name for name, p in zip(names, params) if not getattr(p, "is_constexpr", True)}


def _key(kernel: Any, kwargs: dict, rest: tuple) -> Any:
    items = []
    runtime = _runtime_args(kernel)
    for name, value in kwargs.items():
        k = _arg_key(value, constexpr=name not in runtime)
        if k is _UNCACHEABLE:
            return _UNCACHEABLE
        items.append((name, k))
    try:
        frozen_rest = _freeze(rest)
    except TypeError:
        return _UNCACHEABLE
    import triton

    # torch wraps a launch with launch options (num_warps=...) in a fresh Autotuner of one config each call, and
    # generate_ttir merges its first config's kwargs into the arguments: key on the function and those kwargs
    fn, configs = _jit_function(kernel), getattr(kernel, "configs", None)
    try:
        config_kwargs = _freeze(dict(configs[0].kwargs)) if configs else ()
    except TypeError:
        return _UNCACHEABLE
    target = triton.runtime.driver.active.get_current_target()
    return (id(fn), config_kwargs, tuple(items), frozen_rest, repr(target))


def _cached(fn):
    cache: dict[Any, tuple[Any, Any]] = {}  # key -> (the function kept alive so its id is not reused, result)

    @functools.wraps(fn)
    def wrapper(kernel, kwargs, *rest):
        key = _key(kernel, kwargs, rest)
        if key is _UNCACHEABLE:
            _stats["uncached"] += 1
            return fn(kernel, kwargs, *rest)
        hit = cache.get(key)
        if hit is None:
            _stats["misses"] += 1
            hit = cache[key] = (_jit_function(kernel), fn(kernel, kwargs, *rest))
        else:
            _stats["hits"] += 1
        return copy.deepcopy(hit[1])

    wrapper.__wrapped_by_hf_lowbit__ = True
    wrapper.cache = cache
    return wrapper


def install() -> bool:
    """Wrap torch's per-launch kernel analysis with the cache (idempotent); whether a function was wrapped."""
    if os.environ.get("HF_LOWBIT_TRITON_ANALYSIS_CACHE", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
        from torch._higher_order_ops import triton_kernel_wrap as tkw
    except ImportError:
        return False
    done = False
    for name in _NAMES:
        fn = getattr(tkw, name, None)
        if fn is None:
            continue
        if not getattr(fn, "__wrapped_by_hf_lowbit__", False):
            setattr(tkw, name, _cached(fn))
        done = True
    return done


def stats() -> dict:
    """Hits, misses and uncached calls since the process started (for tests and the warm-up logs)."""
    return dict(_stats)
