"""Serving an export through transformers' compiled ``generate`` with less host work per decoded token.

    model = AutoModelForCausalLM.from_pretrained(export_dir, device_map="cuda")
    compile_config = prepare_for_serving(model)   # also: model.generate defers its stop check (below)
    model.generate(ids, cache_implementation="static", compile_config=compile_config, ...)

Two costs a torchao tensor-subclass weight adds to every compiled call (issue 26, docs/qat.md § Serving), and what
removes them:

* AOTAutograd's runtime wrapper flattens each subclass input (``__tensor_flatten__``, its inner tensors) on every
  call: :func:`unwrap_quantized_weights` registers the inner tensors as the module's parameters (plain tensors)
  and rebuilds the quantized weight inside the compiled graph, so the wrapper sees plain tensors. Unlike
  ``torchao.utils.unwrap_tensor_subclass`` it rebuilds each weight in one function that Dynamo puts in the graph
  whole (``torch._dynamo.allow_in_graph``), so any torchao weight whose inner tensors are plain unwraps:
  ``Float8Tensor`` too, whose rebuild Dynamo cannot trace through torchao's (its ``act_quant_kwargs`` dataclass
  is no graph constant).
* Dynamo checks its guards before every call; the model's modules and parameters make most of them (more after
  unwrapping: the parametrizations). :func:`serving_compile_config` skips the guards on ``nn.Module`` state
  (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``); those on the inputs (ids, cache, positions: shapes,
  dtypes) stay.

And one cost every model pays, quantized or not: ``generate`` reads its stopping flag on the host after each
token (one device sync), so the host's Python and launches for the next token wait for the GPU's work instead of
running beside it (on the H200 the deferral below hid 1.5-1.8 ms a token at 32 Llama-8B layers). transformers (5.17,
the version tested) has the fix, ``DeferredStopCheck`` (the flag copied asynchronously and read one token late; a
token decoded past an EOS is undone), but turns it on for Apple's MPS only, pending measurements on CUDA.
:func:`defer_stop_check` turns it on for one model's ``generate`` on CUDA too (:func:`deferred_stop_check`: for a
block of code); :func:`prepare_for_serving` does by default. Measured on the H200 (32 Llama-8B-shaped layers,
compiled path, batch 1): bf16 1.28x the tokens/s, an int4 export on hf_lowbit's kernels 1.72x, the same tokens
(docs/qat.md § Serving).

Unsafe in one way, as the name says: once compiled, the model's modules must not change (no new weights, no
``train()``, no swapped layers); call ``torch._dynamo.reset()`` before compiling again after a change. That holds
for serving a loaded checkpoint.

Needs torch >= 2.8 (the guard filter; tested with 2.11, the H200 image's, and 2.13, on the CPU) and nothing from
the rest of hf_lowbit: this file imports only torch (and transformers' ``CompileConfig`` and generation loop when
asked for them), so it can be copied next to a serving script.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["defer_stop_check", "deferred_stop_check", "guard_filter", "has_deferred_stop_check", "prepare_for_serving",
           "serving_compile_config", "unwrap_quantized_weights"]


def guard_filter():
    """``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` (torch >= 2.8), or a RuntimeError that says so."""
    fn = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.compiler.skip_guard_on_all_nn_modules_unsafe "
                           "(guard filtering needs torch >= 2.8)")
    return fn


def serving_compile_config(backend: str = "inductor", cudagraphs: bool = True):
    """transformers' ``CompileConfig`` for ``generate`` with the nn-module guards skipped.

    ``torch.compile`` takes ``mode`` or ``options``, not both, and the guard filter goes in ``options``; so
    ``mode="reduce-overhead"`` (transformers' default) is written as the option it sets, ``triton.cudagraphs``
    (``cudagraphs=False``: Inductor's default mode). A backend other than Inductor gets the filter alone."""
    from transformers import CompileConfig

    options = {"guard_filter_fn": guard_filter()}
    if backend == "inductor" and cudagraphs:
        options["triton.cudagraphs"] = True
    return CompileConfig(backend=backend, mode=None, options=options)


class _Rebuild(nn.Module):
    """A parametrization: a torchao weight kept as its plain inner tensors, rebuilt by one in-graph call."""

    def right_inverse(self, weight: torch.Tensor) -> list[torch.Tensor]:
        names, meta = weight.__tensor_flatten__()
        cls = type(weight)

        def rebuild(*tensors):  # metadata in the closure: Dynamo sees tensors in, a tensor out
            return cls.__tensor_unflatten__(dict(zip(names, tensors)), meta, None, None)

        self.rebuild = torch._dynamo.allow_in_graph(rebuild)
        self.weight_type = cls.__name__
        return [getattr(weight, n) for n in names]

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.rebuild(*tensors)


def _unwrappable(weight) -> bool:
    """A tensor-subclass weight whose ``__tensor_flatten__`` gives plain tensors (torchao's quantized weights)."""
    if not isinstance(weight, torch.Tensor) or type(weight) in (torch.Tensor, nn.Parameter):
        return False
    flatten = getattr(weight, "__tensor_flatten__", None)
    if flatten is None or not hasattr(type(weight), "__tensor_unflatten__"):
        return False
    names, _ = flatten()
    return all(type(getattr(weight, n)) in (torch.Tensor, nn.Parameter) for n in names)


def unwrap_quantized_weights(model: nn.Module) -> dict[str, str]:
    """Each ``nn.Linear`` / ``nn.Embedding`` whose weight is a tensor subclass (torchao's quantized weights) keeps
    the weight's plain inner tensors as parameters (``parametrizations.weight.original0..``, no grad) and rebuilds
    the same weight from them on access: eagerly the same tensor type and values, compiled one graph op. In place;
    returns ``{module name: weight type}`` of the weights unwrapped. A subclass whose inner tensors are
    subclasses again, or a module already parametrized, is left as it is."""
    done = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or parametrize.is_parametrized(module, "weight"):
            continue
        weight = module.weight
        if not _unwrappable(weight):
            continue
        weight.requires_grad_(False)  # integer inner tensors cannot be parameters that need grad
        parametrize.register_parametrization(module, "weight", _Rebuild())
        for p in module.parametrizations.weight.parameters():
            p.requires_grad_(False)
        done[name] = type(weight).__name__
    return done


_INSTALL = threading.Lock()


def _cuda_flag() -> contextvars.ContextVar:
    """The flag under which transformers' ``DeferredStopCheck.is_supported`` accepts CUDA, installing that
    extension first: upstream's own rule (the device must be MPS, then cache conditions) applied as if a CUDA
    device were MPS, so its other conditions stay its own. One per process: the flag lives on the installed
    function, so a second copy of this file (a serving script's, beside hf_lowbit's) finds and shares it."""
    import transformers
    from transformers.generation import utils as generation

    if not has_deferred_stop_check():
        raise RuntimeError(f"defer_stop_check: transformers {transformers.__version__} has no "
                           "DeferredStopCheck.is_supported in generate's loop (transformers 5.17 has it): "
                           "upgrade transformers, or serve without defer_stop_check")
    cls = generation.DeferredStopCheck
    with _INSTALL:  # two threads installing at once would each make a flag, one of them never read
        upstream = cls.__dict__["is_supported"].__func__
        flag = getattr(upstream, "_hf_lowbit_cuda_flag", None)
        if flag is not None:
            return flag
        flag = contextvars.ContextVar("hf_lowbit_defer_stop_check_on_cuda", default=False)

        @functools.wraps(upstream)
        def is_supported(device, *args, **kwargs):  # upstream's other arguments passed on as they come
            if flag.get() and torch.device(device).type == "cuda":
                device = torch.device("mps")  # only the device test differs from upstream's rule
            return upstream(device, *args, **kwargs)

        is_supported._hf_lowbit_cuda_flag = flag
        cls.is_supported = staticmethod(is_supported)
        return flag


@contextlib.contextmanager
def deferred_stop_check():
    """Within the block, ``generate`` on CUDA reads its stopping flag one token late (transformers'
    ``DeferredStopCheck``) instead of waiting for the GPU after every token: the host prepares token t+1 while
    the GPU computes token t. The decoding is unchanged, so a call returns the tokens it returns without the
    deferral (transformers undoes the token decoded past a stop); what changes: a sequence stopped by an EOS costs
    one ``forward`` more (one more random draw when sampling, so later unseeded sampling differs), and a streamer
    gets each token one step late. Any ``generate`` in the block defers, another model's called from inside too
    (an assistant model excepted, by upstream's rule). The flag is a context variable: threads started inside the
    block (a ``Thread(target=model.generate)`` streaming pattern, an executor) do not see it; wrap the model
    instead (:func:`defer_stop_check`), whose ``generate`` sets it in whichever thread runs it."""
    flag = _cuda_flag()
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


class _DeferredGenerate:
    """A model's ``generate`` run under :func:`deferred_stop_check`: the model's own (an instance-level one it
    had, else its class's), looked up through the model it holds, so a deep copy of the model gets a wrapper of
    its copy and the model still pickles (a closure over the bound method would do neither)."""

    _hf_lowbit_deferred = True

    def __init__(self, model: nn.Module, inner=None):
        self.model, self.inner = model, inner

    def __call__(self, *args, **kwargs):
        generate = self.inner if self.inner is not None else functools.partial(type(self.model).generate, self.model)
        with deferred_stop_check():
            return generate(*args, **kwargs)


def defer_stop_check(model: nn.Module) -> nn.Module:
    """``model.generate`` (this model's, not its class's) runs under :func:`deferred_stop_check`; returns the model.
    Calling it again changes nothing. Needs transformers with ``DeferredStopCheck`` (5.17 has it): else a
    RuntimeError now, not at the first ``generate``."""
    _cuda_flag()
    if getattr(model.generate, "_hf_lowbit_deferred", False):
        return model
    model.generate = _DeferredGenerate(model, vars(model).get("generate"))
    return model


def has_deferred_stop_check() -> bool:
    """Whether this transformers has the ``DeferredStopCheck`` that :func:`defer_stop_check` turns on (5.17 has)."""
    from transformers.generation import utils as generation

    cls = getattr(generation, "DeferredStopCheck", None)
    return cls is not None and isinstance(cls.__dict__.get("is_supported"), staticmethod)


def prepare_for_serving(model: nn.Module, backend: str = "inductor", cudagraphs: bool = True,
                        defer_stop: bool | None = None):
    """:func:`unwrap_quantized_weights` on ``model`` (in place), and the ``CompileConfig`` of
    :func:`serving_compile_config` to pass to ``generate`` (with ``cache_implementation="static"``).

    ``defer_stop``: :func:`defer_stop_check` on the model too. None (the default): where transformers has it
    (5.17 has; else a warning says what is left out); True: required (a RuntimeError without it); False: not."""
    config = serving_compile_config(backend, cudagraphs)  # first: a torch without the filter changes nothing
    if defer_stop is None:
        defer_stop = has_deferred_stop_check()
        if not defer_stop:
            import warnings

            import transformers

            warnings.warn(f"prepare_for_serving: transformers {transformers.__version__} has no DeferredStopCheck, so "
                          "generate waits for the GPU after every token (with transformers 5.17 the next token is "
                          "prepared meanwhile: defer_stop_check; pass defer_stop=False to silence this)", stacklevel=2)
    if defer_stop:
        defer_stop_check(model)
    unwrap_quantized_weights(model)
    return config
