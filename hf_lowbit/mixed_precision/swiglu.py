"""A Llama-style MLP as one low-bit autograd function (``MixedPrecisionConfig.fused_swiglu``, ``lowbit_fused_swiglu``).

``down(silu(gate(x)) * up(x))`` with all three linears low-bit: per linear (:class:`MixedPrecisionLinear`), the
SwiGLU between them is plain torch that Inductor fuses with the row quantization of its output (the down projection's
input) and, in the backward, with the row quantizations of ``dg``, ``du`` (the gate / up input gradients' operands):
looped reductions over 14,336-wide rows that ran at ~2x their traffic floor on the H200 (docs/benchmarks.md, "What
the 8x2048 layers row would still need"). Here the MLP is one ``autograd.Function`` around the
:mod:`hf_lowbit.kernels.swiglu` ops, one Triton kernel each way, whose codes go straight to the matmuls; the
kernels can also take their outputs' column absmax (``h``'s, ``dg``'s, ``du``'s), so that their weight-gradient
column codes are one read each (``quantize_t``'s ``col_amax``; :data:`COL_AMAX`, off until measured). X is
quantized once per row for gate and up, and once per column for both weight gradients.

The bits: each matmul is the per-linear path's (same ops, same operands); the SwiGLU values are rounded once from
float32 (the per-linear path's eager SiLU rounds ``silu(g)`` to the dtype before the product; compiled, Inductor
also rounds once), so the two paths agree to a step of bf16 in ``h`` / ``dg`` / ``du`` and exactly where those agree
(tests/test_swiglu_mlp.py checks it bit for bit against the per-linear path with a once-rounded SwiGLU).

:func:`fuse_swiglu_mlps` (called by :func:`~hf_lowbit.mixed_precision.convert_to_mixed_precision`) replaces every
MLP whose ``forward`` is transformers' ``LlamaMLP.forward`` (bytecode-identical: Mistral, Qwen2, ... copy it), whose
``act_fn`` is SiLU and whose three projections are low-bit linears of the config, bias-free, by a
:class:`LowBitSwiGLUMLP` holding the same submodules (same ``state_dict`` keys); others are reported skipped, with why.
At call time the module falls back to the per-linear composition where a projection is no longer a
:class:`MixedPrecisionLinear` (PEFT wrapped it) or holds FSDP2's gathered codes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..compute import compute_dtype as _compute_dtype
from ..kernels import (FORMATS, quantize_operand, quantize_t, scaled_matmul_accumulate, scaled_matmul_input_grad,
                       scaled_matmul_quantized)
from ..kernels.accumulate import scaled_mm_accumulate_
from ..kernels.swiglu import swiglu_backward_quant, swiglu_quant
from ..swap import SKIPPED, SWAPPED, SwapEntry, SwapReport
from .fsdp_all_gather import GatheredLowBitWeight
from .linear import (MixedPrecisionConfig, MixedPrecisionLinear, check_accumulators, input_grad_codes,
                     weight_operands)


# Whether the SwiGLU kernels also take their outputs' column absmax (an atomic max per column of each row block): h's
# in the forward, dg's and du's in the backward, so that the weight gradients' column codes of those are one read
# each instead of quantize_t's own absmax pass and encode pass (~3 of the 4.9 ms of column absmax a step at 8x2048 in
# the recorded profile were dg's and du's). Off until benchmarks/benchmark_swiglu.py's column tables (the atomics'
# cost against the pass they save) say otherwise
COL_AMAX = False


def _weight_grad(fmt: str, g: Tensor, g_amax: Tensor | None, xq: tuple[Tensor, Tensor], acc: Tensor | None,
                 dtype: torch.dtype) -> Tensor | None:
    """``dW = gᵀ · X`` with ``X``'s column codes ``xq``: ``g`` quantized per column (from its known absmax if
    given), added into ``acc`` by the matmul (then None) or returned in ``dtype``."""
    qg, sg = quantize_t(g, fmt, col_amax=g_amax)
    if acc is not None:
        scaled_mm_accumulate_(acc, qg, xq[0], sg, xq[1])
        return None
    return FORMATS[fmt].scaled_mm(qg, xq[0], sg, xq[1], dtype)


class _LowBitSwiGLUFn(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))``, each matmul low-bit; ``c_*``: each weight's
    :meth:`MixedPrecisionLinear.cached_operands` (or None); ``acc_*``: each weight's gradient accumulator (or None:
    :class:`FusedGradAccumulation`); ``x_codes``: keep X's and h's column codes for the weight gradients instead of X
    and h (``save_x_codes``)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, fmt: str,
                c_gate: tuple[Tensor, ...] | None, c_up: tuple[Tensor, ...] | None, c_down: tuple[Tensor, ...] | None,
                acc_gate: Tensor | None, acc_up: Tensor | None, acc_down: Tensor | None, x_codes: bool) -> Tensor:
        f = FORMATS[fmt]
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        qg, sg, tg = weight_operands(fmt, w_gate, c_gate)
        qu, su, tu = weight_operands(fmt, w_up, c_up)
        qd, sd, td = weight_operands(fmt, w_down, c_down)
        qx, sx = quantize_operand(fmt, x2, 1)  # once for gate and up
        g = f.scaled_mm(qx, qg, sx, sg, dtype)
        u = f.scaled_mm(qx, qu, sx, su, dtype)
        need = ctx.needs_input_grad
        h_amax = COL_AMAX and need[3]  # h's column absmax for the down weight's gradient
        h, qh, sh, ha = swiglu_quant(g, u, fmt, h_amax)
        ha = ha if h_amax else None
        y = f.scaled_mm(qh, qd, sh, sd, dtype)
        keep_x, keep_h = need[1] or need[2], need[3]
        xq = hq = (None, None)
        if x_codes:  # the weight gradients' column codes now, instead of X and h
            if keep_x:
                xq, keep_x = quantize_operand(fmt, x2, 0, shared=True), False
            if keep_h:
                hq, keep_h = quantize_t(h, fmt, col_amax=ha), False
        fused = (acc_gate if need[1] else None, acc_up if need[2] else None, acc_down if need[3] else None)
        # the accumulators as _MixedPrecisionLinearFn keeps its one: saved in a compiled graph, referenced eagerly
        # with their weights (not the saved ones: under saved-tensor hooks, e.g. non-reentrant checkpointing or
        # save_on_cpu, those unpack as other tensors, whose .grad is not the accumulator)
        compiling = torch.compiler.is_compiling()
        ctx.eager_accs = None if compiling else tuple(zip((w_gate, w_up, w_down), fused))
        gu = (g, u) if need[0] or need[1] or need[2] else (None, None)  # for the SwiGLU's backward, if any
        ctx.save_for_backward(x2 if keep_x else None, h if keep_h else None, ha if keep_h else None, *xq, *hq, *gu,
                              w_gate, w_up, w_down, sg, su, sd, tg, tu, td,
                              *(fused if compiling else (None, None, None)))
        ctx.flags = (fmt, dtype, x.shape, x.dtype)
        return y.reshape(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x2, h, ha, qx_c, sx_c, qh_c, sh_c, g, u, w_gate, w_up, w_down, sg, su, sd, tg, tu, td,
         acc_g, acc_u, acc_d) = ctx.saved_tensors
        if ctx.eager_accs is not None:
            acc_g, acc_u, acc_d = (a for _, a in ctx.eager_accs)
            check_accumulators([(w, a) for w, a in ctx.eager_accs if a is not None])
        fmt, dtype, x_shape, x_dtype = ctx.flags
        f = FORMATS[fmt]
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, w_down.shape[0])
        dx = dwg = dwu = dwd = None
        if need_d:  # dW_down = dYᵀ · h
            hq = (qh_c, sh_c) if qh_c is not None else quantize_t(h, fmt, col_amax=ha)
            if acc_d is not None:
                scaled_matmul_accumulate(fmt, acc_d, dy2, 0, hq[0], hq[1])
            else:
                dwd = scaled_matmul_quantized(fmt, dy2, 0, hq[0], hq[1], w_down.dtype)
        if need_x or need_g or need_u:
            td, sd = input_grad_codes(fmt, w_down, sd, td)
            dh = scaled_matmul_input_grad(fmt, dy2, td, sd, dtype)
            # dg, du and their row codes times gate's / up's row scales (the input gradient's operands); their
            # column absmax for the weight gradients
            amax = COL_AMAX and (need_g or need_u)
            dg, du, qdg, sdg, qdu, sdu, ag, au = swiglu_backward_quant(
                dh, g, u, fmt, sg.reshape(-1).float(), su.reshape(-1).float(), amax)
            ag, au = (ag, au) if amax else (None, None)
            if need_x:  # dX = q(dg·diag(s_g)) · Wg + q(du·diag(s_u)) · Wu
                tg, _ = input_grad_codes(fmt, w_gate, sg, tg)
                tu, _ = input_grad_codes(fmt, w_up, su, tu)
                ones = torch.ones(tg.shape[0], dtype=torch.float32, device=tg.device)
                dx = (f.scaled_mm(qdg, tg, sdg, ones, x_dtype) + f.scaled_mm(qdu, tu, sdu, ones, x_dtype))
                dx = dx.reshape(x_shape)
            if need_g or need_u:
                xq = (qx_c, sx_c) if qx_c is not None else quantize_operand(fmt, x2, 0, shared=True)
                if need_g:
                    dwg = _weight_grad(fmt, dg, ag, xq, acc_g, w_gate.dtype)
                if need_u:
                    dwu = _weight_grad(fmt, du, au, xq, acc_u, w_up.dtype)
        return dx, dwg, dwu, dwd, None, None, None, None, None, None, None, None


def _is_silu(act: nn.Module) -> bool:
    """torch's SiLU or transformers' (exactly: a subclass may compute something else)."""
    return type(act) is nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                    and type(act).__module__ == "transformers.activations")


class LowBitSwiGLUMLP(nn.Module):
    """A Llama-style MLP (``gate_proj``, ``up_proj``, ``down_proj``: :class:`MixedPrecisionLinear`; ``act_fn``: SiLU)
    computed by one low-bit autograd function (module docstring). Holds the original MLP's submodules under their
    names (the same parameters and ``state_dict`` keys) and its other attributes (``config``, sizes)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for name, value in vars(mlp).items():  # config, hidden_size, intermediate_size, ...
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self.train(mlp.training)
        self.fused_from = type(mlp).__name__

    def _fusable_now(self) -> bool:
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        return (all(type(m) is MixedPrecisionLinear and not isinstance(m.weight, GatheredLowBitWeight) for m in layers)
                and layers[0].lowbit_config == layers[1].lowbit_config == layers[2].lowbit_config)

    def forward(self, x: Tensor) -> Tensor:
        if not self._fusable_now():  # PEFT wrapped a projection, FSDP2 gathered codes, configs changed: per linear
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        config = self.down_proj.lowbit_config
        gate, up, down = layers
        return _LowBitSwiGLUFn.apply(x, gate.weight, up.weight, down.weight, config.format, gate.cached_operands(),
                                     up.cached_operands(), down.cached_operands(), gate.grad_acc, up.grad_acc,
                                     down.grad_acc, config.save_x_codes)

    def extra_repr(self) -> str:
        return f"fused_from={self.fused_from}, format={self.down_proj.lowbit_config.format}"


def _unfusable(mlp: nn.Module, config: MixedPrecisionConfig) -> str | None:
    """Why ``mlp`` cannot be a :class:`LowBitSwiGLUMLP` under ``config``, or None."""
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "transformers' LlamaMLP is not importable (its forward is the one this fuses)"
    ours, theirs = LlamaMLP.forward.__code__, type(mlp).forward.__code__
    if (ours.co_code, ours.co_names, ours.co_consts) != (theirs.co_code, theirs.co_names, theirs.co_consts):
        return "its forward is not LlamaMLP's down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if "forward" in vars(mlp):  # set on the instance (a hook: accelerate's, a patch): LowBitSwiGLUMLP would copy it
        return "its forward is overridden on the instance (a hook or patch), not LlamaMLP's"
    if not _is_silu(mlp.act_fn):
        return f"act_fn is {type(mlp.act_fn).__name__}, not SiLU"
    for name in ("gate_proj", "up_proj", "down_proj"):
        m = getattr(mlp, name)
        if type(m) is not MixedPrecisionLinear:
            return f"{name} is a {type(m).__name__}, not a low-bit linear (excluded or skipped above)"
        if m.bias is not None:
            return f"{name} has a bias"
        if m.lowbit_config != config:
            return f"{name} has another low-bit config ({m.lowbit_config.format})"
    return None


def fuse_swiglu_mlps(model: nn.Module, config: MixedPrecisionConfig, report: SwapReport) -> int:
    """Replace each Llama-style MLP of ``model`` whose projections ``config`` made low-bit by a
    :class:`LowBitSwiGLUMLP`, in place; record each MLP met in ``report`` (fused, or skipped with why); return how
    many were fused."""
    fused = 0
    for name, mlp in list(model.named_modules()):
        if isinstance(mlp, LowBitSwiGLUMLP) or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj",
                                                                                   "act_fn")):
            continue
        why = _unfusable(mlp, config)
        if why:
            report.entries.append(SwapEntry(name, type(mlp).__name__, (), SKIPPED, f"SwiGLU not fused: {why}"))
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, LowBitSwiGLUMLP(mlp))
        report.entries.append(SwapEntry(name, type(mlp).__name__, (), SWAPPED,
                                        f"LowBitSwiGLUMLP: {config.format.upper()} projections, the SwiGLU and its "
                                        "row codes one Triton kernel each way"))
        fused += 1
    return fused
