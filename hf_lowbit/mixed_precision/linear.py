"""Low-bit mixed-precision training (INT8 or FP8): weights stay high precision, big matmuls go low-bit.

Each of a linear layer's three matmuls quantizes both operands dynamically, row-wise along the
reduction dim (symmetric absmax scaling: /127 to int8, /448 to float8 e4m3), multiplies them on
low-bit tensor cores (int32 / fp32 accumulation) and scales back to the compute dtype:

* forward      ``Y  = X · Wᵀ``   X per token, W per output channel
* grad input   ``dX = dY · W``   dY per token with W's row scales folded in, W's forward codes (transposed)
* grad weight  ``dW = dYᵀ · X``  dY and X per feature, across tokens

(``dual_grad_quant``: dY's two quantizations from one op, ``hf_lowbit::quantize_dual``, the same bits.)

Each can be switched off (it then runs in the compute dtype). The quantization is plain PyTorch
inside an ``autograd.Function`` that ``torch.compile`` traces (no ``allow_in_graph``), so Inductor
fuses it; the matmul is the format's op (``hf_lowbit::int8_scaled_mm``, a ``triton_op``; FP8: ``torch._scaled_mm``).

The recipe: :class:`MixedPrecisionConfig` (knows its format's alignment), the layer and its ``autograd.Function``
(:mod:`.convert` swaps eligible ``nn.Linear`` for :class:`MixedPrecisionLinear` and returns the swap report).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compute import compute_dtype as _compute_dtype  # the name the Function body below uses
from ..kernels import (FORMATS, get_format, quantize_operand, quantize_weight, quantize_weight_t,
                       scaled_matmul_accumulate, scaled_matmul_grads, scaled_matmul_input_grad,
                       scaled_matmul_quantized)
from ..swap import LinearFilter
from .fsdp_all_gather import GatheredLowBitWeight, gathered_operands


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """The number format (``"int8"``, ``"fp8"`` or ``"fp8_tensorwise"``) and which of the three matmuls use it."""

    format: str = "int8"
    output: bool = True
    grad_input: bool = True
    grad_weight: bool = True
    weight_cache: bool = False  # quantize each weight once per change, not per call (see MixedPrecisionLinear)
    # stochastic rounding of the backward's operands: dY in both gradient matmuls and X in the weight gradient
    # (the quantities whose rounding bias accumulates into the weights); the forward rounds to nearest
    stochastic_rounding: bool = False
    # dY's two quantizations (per token for dX, per feature for dW) from one op, hf_lowbit::quantize_dual: two reads
    # of dY instead of three, the same bits; where both gradient matmuls are low-bit and both gradients are needed
    # (else the split path). Off: on the H200 the op was 0.95x (INT8) / 0.86x (FP8) the default pair's speed at
    # 2048 tokens (a flip would have to let stochastic_rounding=True fall back instead of raising)
    dual_grad_quant: bool = False
    # X's column codes (per input feature, across tokens: the weight gradient's operand) made in the forward and kept
    # for the backward instead of X: 1 byte an element alive between them instead of 2 (issue 25's memory target),
    # the same bits. Where the weight gradient is low-bit, needed, and rounded to nearest (else X is kept)
    save_x_codes: bool = False
    # also swap the model's output embedding (LM head): the logits' matmul and both its gradients in the format; it is
    # excluded by default because the logits' precision is the risk (not yet measured for speed and loss at scale)
    include_lm_head: bool = False
    # a Llama-style MLP (gate / up / down low-bit linears around a SiLU-gated product) as one autograd function
    # whose SwiGLU and its row codes are one Triton kernel each way (hf_lowbit::swiglu_quant, swiglu_backward_quant;
    # LowBitSwiGLUMLP): Inductor's fusion of them ran at ~2x its traffic floor over 14,336-wide rows on the H200.
    # Row-scaled formats, nearest rounding, all three matmuls low-bit; off until measured (benchmark_swiglu.py)
    fused_swiglu: bool = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"MixedPrecisionConfig.format must be one of {sorted(FORMATS)}, got {self.format!r}")
        if self.stochastic_rounding and self.format != "int8":
            raise ValueError(f"MixedPrecisionConfig.stochastic_rounding is implemented for format='int8', "
                             f"not {self.format!r}")
        if self.dual_grad_quant and self.stochastic_rounding:
            raise ValueError("MixedPrecisionConfig.dual_grad_quant=True with stochastic_rounding=True: "
                             "hf_lowbit::quantize_dual rounds to nearest only; switch one off")
        if self.save_x_codes and self.stochastic_rounding:
            raise ValueError("MixedPrecisionConfig.save_x_codes=True with stochastic_rounding=True: the codes kept "
                             "from the forward round to nearest; switch one off")
        if self.fused_swiglu and (self.stochastic_rounding or FORMATS[self.format].tensorwise
                                  or not (self.output and self.grad_input and self.grad_weight)):
            raise ValueError(f"MixedPrecisionConfig.fused_swiglu=True needs a format scaled per row (int8, fp8; got "
                             f"{self.format!r}), nearest rounding and all three matmuls low-bit (output, grad_input, "
                             "grad_weight)")

    @property
    def recipe(self) -> str:
        """The recipe's name (its ``LowBitTrainingArguments`` field), e.g. ``"int8_mixed_precision"``."""
        return f"{self.format}_mixed_precision"

    def filter(self, base: LinearFilter) -> LinearFilter:
        """``base`` plus the format's shape rule: in and out features multiples of its kernel's alignment."""
        return replace(base, multiple_of=get_format(self.format).alignment)


def weight_operands(fmt: str, weight: Tensor,
                    cached: tuple[Tensor, ...] | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The forward's operand of ``weight``: ``(codes [N, K], row scales [N], codes transposed [K, N] or None)``, from
    the cache (:func:`hf_lowbit.kernels.quantize_weight`'s three; FSDP2's gathered codes have no transposed ones) or
    quantized now (the transposed codes then re-encoded from the scales in the backward: :func:`input_grad_codes`)."""
    if cached is not None:
        return cached
    return (*quantize_operand(fmt, weight, 1), None)


def input_grad_codes(fmt: str, weight: Tensor, w_scale: Tensor, qw_t: Tensor | None,
                     gathered: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The input gradient's operand of ``weight``: its forward codes transposed ``[K, N]`` and their row scales, as
    kept (``qw_t``), from FSDP2's gathered codes ``[N, K]``, or re-encoded from the forward's scales (one read of the
    weight, no absmax pass)."""
    if gathered is not None:
        return gathered.T.contiguous(), w_scale
    if qw_t is None:
        return quantize_weight_t(fmt, weight, w_scale)
    return qw_t, w_scale


def check_accumulators(eager_acc) -> None:
    """Eagerly, before a backward adds weight gradients into their accumulators: each weight's ``.grad`` must still be
    its accumulator (``zero_grad()`` sets it to None; :class:`FusedGradAccumulation` re-attaches it)."""
    for param, acc in eager_acc or ():
        if param.grad is not acc:
            raise RuntimeError(
                f"fused gradient accumulation: the .grad of a low-bit linear's weight {tuple(param.shape)} is not "
                "the accumulator its matmul adds into (zero_grad() set it to None, or something replaced it): call "
                "FusedGradAccumulation.prepare() before every micro-batch's backward (LowBitTrainer does)")


class _MixedPrecisionLinearFn(torch.autograd.Function):
    """The three matmuls; ``cached`` (or None): the weight already quantized
    (:func:`hf_lowbit.kernels.quantize_weight`: codes and scales per output row, the codes transposed), used
    instead of quantizing ``weight`` on every call.

    The input gradient uses the forward's quantization of the weight, its row scales folded into ``dY``
    (:func:`hf_lowbit.kernels.scaled_matmul_input_grad`): one absmax pass over the weight per step instead of
    two, and without the cache the backward only re-encodes the weight transposed with the saved scales. ``dual``:
    both gradients' quantizations of ``dY`` from one op (:func:`hf_lowbit.kernels.scaled_matmul_grads`).
    ``x_codes``: ``X``'s column codes made here and saved for the weight gradient instead of ``X``. ``grad_acc``
    (or None): the weight's gradient accumulator (its ``.grad``, :class:`FusedGradAccumulation`): the weight
    gradient is added into it by the matmul's epilogue and none is returned to autograd."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, fmt: str, output: bool,
                grad_input: bool, grad_weight: bool, cached: tuple[Tensor, ...] | None, sr: bool,
                dual: bool, x_codes: bool, grad_acc: Tensor | None = None) -> Tensor:
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        qw = w_scale = qw_t = None
        if cached is not None:  # qw_t None: FSDP2's low-bit all-gather, whose codes the backward transposes
            qw, w_scale, qw_t = cached
        if output:
            qw, w_scale, qw_t = weight_operands(fmt, weight, cached)
            y = scaled_matmul_quantized(fmt, x2, 1, qw, w_scale, dtype)
        else:
            y = x2.to(dtype) @ weight.to(dtype).T
        if bias is not None:
            y = y + bias.to(dtype)
        # x is only needed for the weight gradient: a frozen weight (LoRA over this layer) does not keep it alive.
        # The input gradient gets the weight's scales and transposed codes, or gathered codes to transpose
        # (FSDP2 re-gathers them for the backward: no transposed copy alive from forward to backward), or
        # neither: it re-encodes the weight from the scales (per-call codes are not kept either)
        gathered = qw if cached is not None and qw_t is None else None
        # the weight gradient's X: as is, or already quantized per input feature ([K, M] codes + K scales: what
        # scaled_matmul would make of it in the backward, made here so that X itself need not stay alive)
        keep_x = ctx.needs_input_grad[1]
        qx_t = sx = None
        if keep_x and x_codes and grad_weight and not sr:
            qx_t, sx = quantize_operand(fmt, x2, 0, shared=True)
            keep_x = False
        fused = grad_acc is not None and grad_weight and ctx.needs_input_grad[1]
        # the accumulator: saved in a compiled graph (an input the backward mutates); eagerly a plain reference, as
        # saving it would make a second call of this layer in the same forward fail autograd's version check (the
        # first backward to run bumps it), with the weight, whose .grad the backward checks is the accumulator
        compiling = torch.compiler.is_compiling()
        ctx.eager_acc = (weight, grad_acc) if fused and not compiling else None
        ctx.save_for_backward(x if keep_x else None, weight,
                              *((w_scale, qw_t, gathered) if grad_input else (None, None, None)), qx_t, sx,
                              grad_acc if fused and compiling else None)
        ctx.flags = (fmt, grad_input, grad_weight, None if bias is None else bias.dtype, dtype, x.shape, x.dtype, sr,
                     dual)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, w_scale, qw_t, gathered, qx_t, sx, grad_acc = ctx.saved_tensors
        if ctx.eager_acc is not None:
            check_accumulators([ctx.eager_acc])
            grad_acc = ctx.eager_acc[1]
        fmt, grad_input, grad_weight, bias_dtype, dtype, x_shape, x_dtype, sr, dual = ctx.flags
        g2 = grad_out.reshape(-1, weight.shape[0])
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        xq = x2 if qx_t is None else (qx_t, sx)  # the weight gradient's second operand, raw or quantized
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if grad_input:  # dX[M, K] = q(dY·diag(s))[M, N] · Wq[N, K], Wq taken as its transpose [K, N]
                qw_t, w_scale = input_grad_codes(fmt, weight, w_scale, qw_t, gathered)
                # dY quantized for dX and dW in one op (never with stochastic rounding: the config refuses it);
                # not where dW is accumulated in place (the split path's matmul does that)
                if dual and grad_weight and ctx.needs_input_grad[1] and grad_acc is None:
                    dx, dw = scaled_matmul_grads(fmt, g2, qw_t, w_scale, xq, x_dtype, weight.dtype)
                else:
                    dx = scaled_matmul_input_grad(fmt, g2, qw_t, w_scale, x_dtype, stochastic=sr)
            else:
                dx = (g2.to(dtype) @ weight.to(dtype)).to(x_dtype)
            dx = dx.reshape(x_shape)
        if ctx.needs_input_grad[1] and dw is None:
            if grad_acc is not None:  # added into .grad by the matmul (FusedGradAccumulation): none returned
                qx, sx = (qx_t, sx) if qx_t is not None else quantize_operand(fmt, x2, 0, sr, shared=True)
                scaled_matmul_accumulate(fmt, grad_acc, g2, 0, qx, sx, sr)
            elif grad_weight and qx_t is not None:  # X's codes from the forward (the bits scaled_matmul would make)
                dw = scaled_matmul_quantized(fmt, g2, 0, qx_t, sx, weight.dtype)
            elif grad_weight:  # dW[N, K] = dYᵀ[N, M] · X[M, K]: reduce over tokens; X's codes shared by siblings
                qx, sx = quantize_operand(fmt, x2, 0, sr, shared=True)
                dw = scaled_matmul_quantized(fmt, g2, 0, qx, sx, weight.dtype, sr)
            else:
                dw = (g2.to(dtype).T @ x2.to(dtype)).to(weight.dtype)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def mixed_precision_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                           config: MixedPrecisionConfig = MixedPrecisionConfig(),
                           cached_weight: tuple[Tensor, ...] | None = None, grad_acc: Tensor | None = None) -> Tensor:
    """``F.linear`` with the matmuls selected by ``config`` in its low-bit format.

    ``cached_weight``: ``weight`` already quantized by :func:`hf_lowbit.kernels.quantize_weight` (the caller
    keeps it current; :class:`MixedPrecisionLinear` does). ``grad_acc``: a tensor shaped like ``weight`` that the
    low-bit weight gradient is added into in place instead of being returned to autograd (``weight.grad`` then
    gets nothing from this call: :class:`FusedGradAccumulation` makes ``grad_acc`` the weight's ``.grad``)."""
    if not (config.output or config.grad_input or config.grad_weight):
        return F.linear(x, weight, bias)
    return _MixedPrecisionLinearFn.apply(x, weight, bias, config.format, config.output, config.grad_input,
                                         config.grad_weight, cached_weight, config.stochastic_rounding,
                                         config.dual_grad_quant, config.save_x_codes, grad_acc)


# Layers whose weight cache is on: refreshed after every optimizer step (see _refresh_after_step).
_CACHED_LAYERS: "weakref.WeakSet[MixedPrecisionLinear]" = weakref.WeakSet()
_STEP_HOOK = None


def _refresh_after_step(optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: every weight the optimizer holds gets its low-bit copies
    recomputed once, here, instead of on every micro-batch (the cached copies are then current for every
    forward that follows, compiled or not). Unconditionally: fused optimizers (``AdamW(fused=True)``,
    the Trainer's ``adamw_torch_fused``) update parameters without bumping their version counter. Weights whose
    cache the optimizer refreshed itself (:class:`~hf_lowbit.mixed_precision.LowBitAdamW`: ``lowbit_refreshed``)
    are left alone."""
    if _CACHED_LAYERS:
        done = getattr(optimizer, "lowbit_refreshed", ())
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for layer in list(_CACHED_LAYERS):
            if id(layer.weight) in params and id(layer.weight) not in done:
                layer.refresh_weight_cache(force=True)


class MixedPrecisionLinear(nn.Linear):
    """A trainable ``nn.Linear`` whose matmuls run in INT8 or FP8; same parameters, same ``state_dict`` keys.
    (Called ``LowBitLinear`` before; that name stays an alias.)

    With the weight cache on (:meth:`set_weight_cache`, ``MixedPrecisionConfig.weight_cache`` or
    ``LowBitTrainingArguments.lowbit_weight_cache``) the weight is quantized once per change instead of twice
    per micro-batch: its codes in both layouts live in non-persistent buffers (+2 bytes per weight element) and
    are recomputed whenever the weight's version counter, storage, dtype or device changed, and
    unconditionally after each optimizer step that holds the weight (a global optimizer hook: fused
    optimizers do not bump version counters; a deep or unpickled copy of the layer is covered too), on
    ``load_state_dict``, at each eager forward, and by
    :func:`refresh_weight_caches` (which ``LowBitTrainer`` calls before every step; a compiled custom loop
    that modifies weights outside an optimizer or ``load_state_dict`` must call it too).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config: MixedPrecisionConfig = MixedPrecisionConfig()):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lowbit_config = config
        self.weight_cache = False
        self._cache_key = None
        for name in _CACHE_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self.grad_acc: Tensor | None = None  # set by FusedGradAccumulation: the weight's .grad, added into in place

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MixedPrecisionConfig) -> "MixedPrecisionLinear":
        """Wrap ``linear``'s own parameters (shared, not copied), so optimizers and ties still hold."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def set_weight_cache(self, enabled: bool) -> None:
        """Switch the weight cache on (quantizing the weight now) or off (freeing the copies)."""
        self.weight_cache = bool(enabled) and (self.lowbit_config.output or self.lowbit_config.grad_input)
        self._cache_key = None
        if not self.weight_cache:
            for name in _CACHE_BUFFERS:
                setattr(self, name, None)
            _CACHED_LAYERS.discard(self)
            return
        self._register_cache()
        self.refresh_weight_cache()

    def _register_cache(self) -> None:
        """Into the registry the global optimizer post-step hook refreshes (the hook installed once a process)."""
        global _STEP_HOOK
        _CACHED_LAYERS.add(self)
        if _STEP_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _STEP_HOOK = register_optimizer_step_post_hook(_refresh_after_step)

    def __setstate__(self, state):
        # a copy (copy.deepcopy, unpickling) of a cached layer is refreshed after optimizer steps as the original is:
        # a compiled loop's forward does not refresh, so a copy left out of the registry would compute with the
        # codes of its weight before the step
        super().__setstate__(state)
        if getattr(self, "weight_cache", False):
            self._register_cache()

    def _weight_key(self) -> tuple:
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))

    @torch.no_grad()
    def refresh_weight_cache(self, force: bool = False, row_amax: Tensor | None = None) -> bool:
        """Recompute the cached low-bit weight if the weight changed since (by its version counter, storage,
        dtype, device) or a module cast changed the cache buffers' dtypes (``force``: regardless, e.g. after an
        optimizer step); return whether it did. ``row_amax``: the weight's row absmax as it is now (int32 float
        bits, from :func:`hf_lowbit.kernels.adamw.adamw_rows_`): the refresh reads the weight once."""
        if not self.weight_cache or self.weight.device.type == "meta":
            return False
        key = self._weight_key()
        intact = self._cache_intact()
        if key == self._cache_key and intact and not force:
            return False
        w, fmt = self.weight.detach(), self.lowbit_config.format
        current = tuple(getattr(self, name) for name in _CACHE_BUFFERS)
        # rewritten in place only if still of the right kind (else reallocated)
        reuse = intact and all(t.device == w.device for t in current) and current[0].shape == w.shape
        out = quantize_weight(fmt, w, out=current if reuse else None, row_amax=row_amax)
        for name, t in zip(_CACHE_BUFFERS, out):
            setattr(self, name, t)
        self._cache_key = key
        return True

    def _cache_intact(self) -> bool:
        """Whether the cache buffers exist with their dtypes: ``Module.to(dtype)`` / ``.bfloat16()`` cast
        floating-point buffers too (the FP8 codes, the float32 scales), even where the weight itself is left as
        it was (then its key is unchanged); computing with, or writing into, such buffers would use codes held
        as floats or scales rounded to bf16."""
        code = get_format(self.lowbit_config.format).dtype
        bufs = tuple(getattr(self, name) for name in _CACHE_BUFFERS)
        return all(t is not None for t in bufs) and tuple(t.dtype for t in bufs) == (code, torch.float32, code)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._cache_key = None
        self.refresh_weight_cache()

    def cached_operands(self) -> tuple[Tensor, ...] | None:
        """The weight already quantized, for this call: FSDP2's gathered codes + row scales (no transposed codes), the
        weight cache's three buffers (refreshed first when eager), or None (quantized by the call)."""
        if isinstance(self.weight, GatheredLowBitWeight):  # FSDP2 gathered it as codes + row scales
            return gathered_operands(self.weight)             # (hf_lowbit.mixed_precision.fsdp_all_gather)
        if self.weight_cache:
            if not torch.compiler.is_compiling():
                self.refresh_weight_cache()
            return tuple(getattr(self, name) for name in _CACHE_BUFFERS)
        return None

    def forward(self, x: Tensor) -> Tensor:
        return mixed_precision_linear(x, self.weight, self.bias, self.lowbit_config, self.cached_operands(),
                                      self.grad_acc)

    def extra_repr(self) -> str:
        c = self.lowbit_config
        on = [n for n, v in (("output", c.output), ("grad_input", c.grad_input),
                             ("grad_weight", c.grad_weight)) if v]
        cache = "".join(f", {name}" for name, flag in (("weight_cache", self.weight_cache),
                                                       ("stochastic_rounding", c.stochastic_rounding),
                                                       ("dual_grad_quant", c.dual_grad_quant),
                                                       ("save_x_codes", c.save_x_codes),
                                                       ("fused_grad_accum", self.grad_acc is not None)) if flag)
        return f"{super().extra_repr()}, {c.format}={'+'.join(on) or 'off'}{cache}"


LowBitLinear = MixedPrecisionLinear  # the earlier name

_CACHE_BUFFERS = ("_wq", "_wq_scale", "_wq_t")  # quantize_weight's (q, scale, q transposed)


def set_weight_cache(model: nn.Module, enabled: bool) -> int:
    """Switch the weight cache of every :class:`MixedPrecisionLinear` in ``model``; return how many."""
    layers = [m for m in model.modules() if isinstance(m, MixedPrecisionLinear)]
    for m in layers:
        m.set_weight_cache(enabled)
    return len(layers)


def refresh_weight_caches(model: nn.Module) -> int:
    """Recompute every stale cached low-bit weight of ``model`` (cheap when none changed); return how many."""
    return sum(m.refresh_weight_cache() for m in model.modules() if isinstance(m, MixedPrecisionLinear))
