"""Low-bit mixed-precision training (INT8 or FP8): weights stay high precision, big matmuls go low-bit.

Each of a linear layer's three matmuls quantizes both operands dynamically, row-wise along the
reduction dim (symmetric absmax scaling: /127 to int8, /448 to float8 e4m3), multiplies them on
low-bit tensor cores (int32 / fp32 accumulation) and scales back to the compute dtype:

* forward      ``Y  = X · Wᵀ``   X per token, W per output channel
* grad input   ``dX = dY · W``   dY per token, W per input channel
* grad weight  ``dW = dYᵀ · X``  dY and X per feature, across tokens

Each can be switched off (it then runs in the compute dtype). The quantization is plain PyTorch
inside an ``autograd.Function`` that ``torch.compile`` traces (no ``allow_in_graph``), so Inductor
fuses it; the matmul is the format's custom op (``hf_lowbit::int8_scaled_mm`` / ``fp8_scaled_mm``).

The recipe: :class:`MixedPrecisionConfig` (knows its format's alignment), :func:`convert_to_mixed_precision`
(swaps eligible ``nn.Linear`` for :class:`MixedPrecisionLinear`, returns the swap report), the layer
and its ``autograd.Function``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .compute import compute_dtype as _compute_dtype  # the name the Function body below uses
from .ops import FORMATS, get_format, scaled_matmul
from .quantized_base import QUANTIZED_LINEARS
from .swap import LinearFilter, SwapReport, swap_linears


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """The number format (``"int8"`` or ``"fp8"``) and which of the three matmuls use it."""

    format: str = "int8"
    output: bool = True
    grad_input: bool = True
    grad_weight: bool = True

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"MixedPrecisionConfig.format must be one of {sorted(FORMATS)}, got {self.format!r}")

    @property
    def recipe(self) -> str:
        """The recipe's name (its ``LowBitTrainingArguments`` field), e.g. ``"int8_mixed_precision"``."""
        return f"{self.format}_mixed_precision"

    def filter(self, base: LinearFilter) -> LinearFilter:
        """``base`` plus the format's shape rule: in and out features multiples of its kernel's alignment."""
        return replace(base, multiple_of=get_format(self.format).alignment)


class _MixedPrecisionLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, fmt: str, output: bool,
                grad_input: bool, grad_weight: bool) -> Tensor:
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if output:
            y = scaled_matmul(fmt, x2, 1, weight, 1, dtype)
        else:
            y = x2.to(dtype) @ weight.to(dtype).T
        if bias is not None:
            y = y + bias.to(dtype)
        # x is only needed for the weight gradient: a frozen weight (LoRA over this layer) does not keep it alive
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.flags = (fmt, grad_input, grad_weight, None if bias is None else bias.dtype, dtype, x.shape, x.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        fmt, grad_input, grad_weight, bias_dtype, dtype, x_shape, x_dtype = ctx.flags
        g2 = grad_out.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if grad_input:  # dX[M, K] = dY[M, N] · W[N, K]: reduce over N
                dx = scaled_matmul(fmt, g2, 1, weight, 0, x_dtype)
            else:
                dx = (g2.to(dtype) @ weight.to(dtype)).to(x_dtype)
            dx = dx.reshape(x_shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if grad_weight:  # dW[N, K] = dYᵀ[N, M] · X[M, K]: reduce over tokens
                dw = scaled_matmul(fmt, g2, 0, x2, 0, weight.dtype)
            else:
                dw = (g2.to(dtype).T @ x2.to(dtype)).to(weight.dtype)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, dw, db, None, None, None, None


def mixed_precision_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                           config: MixedPrecisionConfig = MixedPrecisionConfig()) -> Tensor:
    """``F.linear`` with the matmuls selected by ``config`` in its low-bit format."""
    if not (config.output or config.grad_input or config.grad_weight):
        return F.linear(x, weight, bias)
    return _MixedPrecisionLinearFn.apply(x, weight, bias, config.format, config.output, config.grad_input,
                                         config.grad_weight)


class MixedPrecisionLinear(nn.Linear):
    """A trainable ``nn.Linear`` whose matmuls run in INT8 or FP8; same parameters, same ``state_dict`` keys.

    (Called ``LowBitLinear`` before; that name stays an alias.)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config: MixedPrecisionConfig = MixedPrecisionConfig()):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lowbit_config = config

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MixedPrecisionConfig) -> "MixedPrecisionLinear":
        """Wrap ``linear``'s own parameters (shared, not copied), so optimizers and ties still hold."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device="meta", config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return mixed_precision_linear(x, self.weight, self.bias, self.lowbit_config)

    def extra_repr(self) -> str:
        c = self.lowbit_config
        on = [n for n, v in (("output", c.output), ("grad_input", c.grad_input),
                             ("grad_weight", c.grad_weight)) if v]
        return f"{super().extra_repr()}, {c.format}={'+'.join(on) or 'off'}"


LowBitLinear = MixedPrecisionLinear  # the earlier name


def convert_to_mixed_precision(model: nn.Module, config: MixedPrecisionConfig,
                               filter: LinearFilter = LinearFilter()) -> SwapReport:
    """Replace each eligible ``nn.Linear`` of ``model`` by a :class:`MixedPrecisionLinear`, in place.

    ``filter`` gets the format's alignment (:meth:`MixedPrecisionConfig.filter`). Layers that are
    mixed precision already, and frozen quantized bases given INT8 compute by the QLoRA recipe, are
    reported as such and left alone.
    """
    return swap_linears(model, lambda name, linear: MixedPrecisionLinear.from_linear(linear, config),
                        recipe=config.recipe, target=f"{config.format.upper()} matmuls", filter=config.filter(filter),
                        already=_low_bit_already)


def _low_bit_already(module: nn.Module) -> bool:
    return isinstance(module, MixedPrecisionLinear) or (isinstance(module, QUANTIZED_LINEARS)
                                                        and module.compute is not None)
