"""The QLoRA recipe: frozen quantized base linears ``Nf4Linear`` and ``Int8Linear``.

The recipe: :class:`QuantizedBaseConfig` (the storage, ``"nf4"`` or ``"int8"``, and the optional INT8
compute; knows NF4's block constraint), :func:`convert_to_quantized_base` (swap, return the report),
the modules and their ``autograd.Function``. Loading a checkpoint straight into quantized bases is
:func:`hf_lowbit.qlora.loading.load_quantized_model`.

Storage and compute are separate concerns: these modules only *store* a frozen weight compactly
(plain tensors registered as ``requires_grad=False`` parameters, so ``state_dict`` / safetensors /
``.to()`` / FSDP2 sharding treat them like any weight) and compute ``x · Wᵀ (+ b)``; LoRA wraps them
from outside (:class:`hf_lowbit.LoraLinear`) and INT8 compute is a switch on them (``compute``).

The matmul is one ``autograd.Function`` with no weight gradient (the base is frozen) that keeps
nothing per call for backward but the stored tensors (no dequantized copy lives until backward):

* bf16 compute: dequantize, ``F.linear``; backward dequantizes again for ``dX = dY·W``.
* INT8 compute (``MixedPrecisionConfig(format="int8")``), with the weight as int8 per output channel
  ``W ≈ diag(s)·Wq``: forward ``Y = q(X)·Wqᵀ`` (X quantized per token); backward folds ``s`` into
  the gradient, ``dX = q(dY·diag(s))·Wq``, so the *same* int8 weight serves both matmuls. An
  ``Int8Linear`` stores ``Wq`` and ``s`` and never requantizes; an ``Nf4Linear`` decodes its 4-bit codes
  straight into the INT8 operand per call, in the layout each matmul needs (``kernels.nf4.nf4_to_int8``: one
  pass over the codes, no bf16 weight), or keeps an INT8 copy computed once (``int8_cache``: +1 byte/parameter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..compute import compute_dtype
from ..kernels import scaled_matmul_input_grad, scaled_matmul_quantized
from ..kernels.int8 import quantize_int8
from ..kernels.nf4 import BLOCK_SIZE, Nf4Data, check_nf4_shape, dequantize_nf4, nf4_to_int8, quantize_nf4
from ..swap import LinearFilter, SwapReport, swap_linears

if TYPE_CHECKING:  # only the annotations name it: mixed_precision imports this module
    from ..mixed_precision import MixedPrecisionConfig

# How a frozen base stores its weight (the ``lora_base_quant`` argument picks one). "Storage" is the
# word for this choice everywhere; "format" is a compute number format (hf_lowbit.kernels.formats).
BASE_STORAGES = ("nf4", "int8")
_INT8_CHUNK_NUMEL = 1 << 22


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _int8_weight(storage: str, tensors: tuple[Tensor, ...], transposed: bool = False) -> tuple[Tensor, Tensor]:
    """(int8 ``[N, K]``, float32 scale ``[N]``) of the stored weight, per output channel; with ``transposed`` the
    codes come ``[K, N]`` contiguous (the input gradient's operand: INT8 tensor cores need the reduction dim, N
    there, contiguous; a transposed view ran several times slower, docs/benchmarks.md "One linear layer")."""
    if storage == "int8":
        return (tensors[0].T.contiguous() if transposed else tensors[0]), tensors[1].float()
    return nf4_to_int8(Nf4Data(*tensors), transposed)  # one pass over the 4-bit codes into either layout


def _dense_weight(storage: str, tensors: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    if storage == "int8":
        return (tensors[0].to(torch.float32) * tensors[1].float()[:, None]).to(dtype)
    return dequantize_nf4(Nf4Data(*tensors), dtype)


class _FrozenQuantizedLinearFn(torch.autograd.Function):
    """``x · Wᵀ + b`` for a stored (``storage``) frozen weight; optional INT8 forward / input-gradient.

    The stored tensors come as one tuple, not ``*tensors``: when no input needs grad, Dynamo drops
    ``ctx`` from a varargs ``forward`` whose argument count happens to equal its parameter count
    (two stored tensors), fails, and runs the whole enclosing frame (a decoder layer) eagerly.
    """

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, tensors: tuple[Tensor, ...], storage: str, int8_output: bool,
                int8_grad_input: bool) -> Tensor:
        dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        if int8_output:
            qw, sw = _int8_weight(storage, tensors)
            y = scaled_matmul_quantized("int8", x2, 1, qw, sw, dtype)
        else:
            y = x2.to(dtype) @ _dense_weight(storage, tensors, dtype).T
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(*tensors)
        ctx.flags = (storage, int8_grad_input, dtype, x.dtype, x.shape,
                     None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        tensors = ctx.saved_tensors
        storage, int8_grad_input, dtype, x_dtype, x_shape, bias_dtype = ctx.flags
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        dx = db = None
        if ctx.needs_input_grad[0]:
            if int8_grad_input:  # dX = q(dY·diag(s))·Wq: reduce over N with the same int8 weight, made
                # again here in its transposed layout rather than kept from the forward (+1 byte/param resident)
                qw_t, sw = _int8_weight(storage, tensors, transposed=True)
                dx = scaled_matmul_input_grad("int8", g2, qw_t, sw, x_dtype)
            else:
                dx = (g2.to(dtype) @ _dense_weight(storage, tensors, dtype)).to(x_dtype)
            dx = dx.reshape(x_shape)
        if bias_dtype is not None and ctx.needs_input_grad[1]:
            db = g2.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, db, None, None, None, None


# The largest adapter rank added in the INT8 matmul's epilogue: its [tile, r] and [r, tile] operands sit in shared
# memory beside the matmul's pipeline buffers (r is padded to a power of two >= 16). Tested up to 64.
FUSED_LORA_MAX_RANK = 64


class _FrozenQuantizedLoraFn(torch.autograd.Function):
    """``base(x) + (xd · Aᵀ) · (B · scaling)ᵀ`` for a frozen base with INT8 compute and one LoRA adapter, the
    up-projection added in the base matmul's epilogue (``kernels.scaled_matmul_quantized(add=...)``).

    Unfused, a LoRA layer writes its ``[tokens, out]`` output three times (the base's, the up-projection's, their
    sum) and its ``[tokens, in]`` input gradient three times; here once each. ``xd`` is ``None`` when the adapter
    has no dropout (its input is ``x``): then the backward also adds ``dH · A`` in the input-gradient matmul's
    epilogue; with dropout, ``dH · A`` is returned as ``xd``'s gradient and autograd carries it through the dropout.
    The adapter weights' gradients are the same matmuls PEFT's autograd runs (in the compute dtype).
    """

    @staticmethod
    def forward(ctx, x: Tensor, xd: Tensor | None, lora_a: Tensor, lora_b: Tensor, bias: Tensor | None,
                tensors: tuple[Tensor, ...], storage: str, scaling: float, int8_grad_input: bool) -> Tensor:
        dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 if xd is None else xd.reshape(-1, xd.shape[-1])
        a, bs = lora_a.to(dtype), lora_b.to(dtype) * scaling
        h = xa.to(dtype) @ a.T  # [tokens, r]
        qw, sw = _int8_weight(storage, tensors)
        y = scaled_matmul_quantized("int8", x2, 1, qw, sw, dtype, add=(h, bs))
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(xa, h, a, bs, *tensors)
        ctx.flags = (storage, scaling, int8_grad_input, xd is None, dtype, x.dtype, x.shape,
                     None if xd is None else xd.dtype, None if bias is None else bias.dtype, lora_a.dtype,
                     lora_b.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        xa, h, a, bs, *tensors = ctx.saved_tensors
        storage, scaling, int8_grad_input, no_dropout, dtype, x_dtype, x_shape, xd_dtype, bias_dtype, a_dtype, \
            b_dtype = ctx.flags
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gd = g2.to(dtype)
        dh = gd @ bs  # [tokens, r]
        da = (dh.T @ xa.to(dtype)).to(a_dtype) if ctx.needs_input_grad[2] else None
        db = (gd.T @ h).to(b_dtype) * scaling if ctx.needs_input_grad[3] else None
        dx = dxd = dbias = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            fuse = no_dropout and int8_grad_input
            if int8_grad_input:
                qw_t, sw = _int8_weight(storage, tuple(tensors), transposed=True)
                dx = scaled_matmul_input_grad("int8", g2, qw_t, sw, x_dtype, add=(dh, a.T) if fuse else None)
            else:
                dx = gd @ _dense_weight(storage, tuple(tensors), dtype)
            if no_dropout and not fuse:
                dx = dx + dh @ a
            elif not no_dropout:
                dxd = (dh @ a).to(xd_dtype).reshape(x_shape)
            dx = dx.to(x_dtype).reshape(x_shape)
        if bias_dtype is not None and ctx.needs_input_grad[4]:
            dbias = g2.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, dxd, da, db, dbias, None, None, None, None


class QuantizedBaseLinear(nn.Module):
    """Shared behaviour of the frozen quantized bases (see :class:`Nf4Linear`, :class:`Int8Linear`).

    ``compute``: ``None`` (matmuls in the compute dtype) or an INT8 ``MixedPrecisionConfig`` whose
    ``output`` / ``grad_input`` pick the low-bit matmuls (a frozen base has no weight gradient).
    ``compute_dtype`` is the dtype of the weight it was built from (PEFT casts adapters to it).
    """

    storage: str = ""
    stored: tuple[str, ...] = ()  # names of the stored tensors, in the order the kernels take them

    def __init__(self, in_features: int, out_features: int, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.compute: MixedPrecisionConfig | None = None
        self.bias: nn.Parameter | None = None
        # name -> (integer dtype, shape) of codes held in a floating-point carrier (see hold_codes_as)
        self._code_layout: dict[str, tuple[torch.dtype, torch.Size]] = {}

    def set_compute(self, compute: MixedPrecisionConfig | None) -> None:
        if compute is not None and compute.format != "int8":
            raise ValueError(f"{type(self).__name__}: only INT8 compute is supported on a quantized base, "
                             f"got format {compute.format!r}")
        self.compute = compute

    def _stored(self) -> tuple[Tensor, ...]:
        out = []
        for name in self.stored:
            t = getattr(self, name)
            layout = self._code_layout.get(name)
            if layout is not None and t.dtype != layout[0]:  # a carrier: the same bytes, seen as the codes
                t = t.view(layout[0]).view(layout[1])
            out.append(t)
        return tuple(out)

    @torch.no_grad()
    def hold_codes_as(self, carrier: torch.dtype) -> bool:
        """Re-register the integer code parameters as flat ``carrier`` (floating-point) parameters over the
        same bytes, so torch < 2.13's ``fully_shard`` shards them (it creates every sharded parameter with
        ``requires_grad=True`` and casts every parameter whose dtype differs from its ``param_dtype``: with
        ``carrier`` = that ``param_dtype`` both are no-ops) and all-gathers them bit for bit, at their own
        byte count. The forward views them back (:meth:`_stored`). Flat, so no row needs to hold a whole
        number of carrier elements; False (nothing changed) if a tensor's byte count does not divide."""
        size = torch.empty(0, dtype=carrier).element_size()
        codes = [(n, getattr(self, n)) for n in self.stored if isinstance(getattr(self, n), nn.Parameter)
                 and not getattr(self, n).is_floating_point()]
        if not carrier.is_floating_point or any(t.numel() * t.element_size() % size for _, t in codes):
            return False
        for name, t in codes:
            self._code_layout[name] = (t.dtype, t.shape)
            setattr(self, name, _frozen(t.detach().reshape(-1).view(carrier)))
        return True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # codes saved in one form (integer, or a carrier: hold_codes_as) load into the other by their bytes,
        # never by value (copy_ would convert int8 -1 into the float -1.0)
        for name in self.stored:
            t, current = state_dict.get(prefix + name), getattr(self, name)
            if (t is None or t.dtype == current.dtype or t.is_floating_point() == current.is_floating_point()
                    or t.numel() * t.element_size() != current.numel() * current.element_size()):
                continue
            state_dict[prefix + name] = t.reshape(-1).view(current.dtype).view(current.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "QuantizedBaseLinear":
        """Quantize ``linear``'s weight into a new module of this storage (bias shared, frozen); ``kwargs`` go to
        the constructor."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", dtype=linear.weight.dtype,
                  **kwargs)
        new.load_weight(linear.weight)
        if linear.bias is not None:
            new.bias = _frozen(linear.bias.detach())
        new.train(linear.training)
        return new

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight this module stores, ``[out_features, in_features]`` in ``dtype`` (default: compute_dtype)."""
        return _dense_weight(self.storage, self._stored(), dtype or self.compute_dtype)

    def to_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding the dequantized weight (and this bias)."""
        dtype = dtype or self.compute_dtype
        w = self.dequantize(dtype)
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        out.weight = nn.Parameter(w, requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return out

    def _operands(self) -> tuple[tuple[Tensor, ...], str]:
        """The tensors the matmuls read and their storage (an ``Nf4Linear`` with an INT8 cache: the cache)."""
        return self._stored(), self.storage

    def forward(self, x: Tensor) -> Tensor:
        c = self.compute
        tensors, storage = self._operands()
        return _FrozenQuantizedLinearFn.apply(x, self.bias, tensors, storage, bool(c and c.output),
                                              bool(c and c.grad_input))

    def fuses_lora(self, r: int) -> bool:
        """Whether :meth:`forward_with_lora` applies to a rank-``r`` adapter: INT8 compute on the forward, r at most
        :data:`FUSED_LORA_MAX_RANK`, and nothing that expects this module to be called (the fused path computes the
        base without calling it): no forward or backward hooks, its own or global, and no wrapper replacing its
        ``forward`` (accelerate's ``_hf_hook``, ZeRO-3's)."""
        from torch.nn.modules import module as m

        return bool(self.compute is not None and self.compute.output and r <= FUSED_LORA_MAX_RANK
                    and not (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
                             or self._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                             or m._global_backward_hooks or m._global_backward_pre_hooks)
                    and "forward" not in self.__dict__)

    def forward_with_lora(self, x: Tensor, xd: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                          scaling: float) -> Tensor:
        """``self(x) + (xd · lora_aᵀ) · lora_bᵀ · scaling`` (``xd`` None: ``x``) with the LoRA up-projection in
        this base's INT8 matmul epilogue (and ``dH · A`` in the input gradient's): see
        :class:`_FrozenQuantizedLoraFn`."""
        tensors, storage = self._operands()
        return _FrozenQuantizedLoraFn.apply(x, xd, lora_a, lora_b, self.bias, tensors, storage, float(scaling),
                                            bool(self.compute.grad_input))

    def extra_repr(self) -> str:
        compute = "bf16" if self.compute is None else "+".join(
            n for n, v in (("output", self.compute.output), ("grad_input", self.compute.grad_input)) if v)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, storage={self.storage}, int8_compute={compute}")


class Nf4Linear(QuantizedBaseLinear):
    """A frozen linear whose weight is stored as NF4 (64-element blocks, double-quantized scales).

    Parameters (``requires_grad=False``; FSDP2 shards them): ``qweight`` uint8 ``[out, in/2]`` (two codes
    a byte), ``qscale`` int8 ``[out, in/64]``, ``bias`` as the source linear had it. Buffers (small float
    scales: FSDP2 neither shards them nor casts them to its mixed-precision ``param_dtype``):
    ``scale_factor`` ``[groups of 256 blocks]``, ``scale_mean`` ``[1]`` (see :mod:`hf_lowbit.kernels.nf4`).
    """

    storage = "nf4"
    stored = ("qweight", "qscale", "scale_factor", "scale_mean")

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16, int8_cache: bool = False):
        super().__init__(in_features, out_features, dtype)
        why = check_nf4_shape((out_features, in_features))
        if why:
            raise ValueError(f"Nf4Linear: {why}")
        n_blocks = out_features * in_features // BLOCK_SIZE
        self.qweight = _frozen(torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.qscale = _frozen(torch.empty(out_features, in_features // BLOCK_SIZE, dtype=torch.int8, device=device))
        self.register_buffer("scale_factor", torch.empty(-(-n_blocks // 256), dtype=dtype, device=device))
        self.register_buffer("scale_mean", torch.empty(1, dtype=dtype, device=device))
        if bias:
            self.bias = _frozen(torch.empty(out_features, dtype=dtype, device=device))
        self.int8_cache = int8_cache
        self.register_buffer("_cache_q", None, persistent=False)
        self.register_buffer("_cache_s", None, persistent=False)

    @torch.no_grad()
    def load_weight(self, weight: Tensor) -> None:
        """Quantize ``weight`` (``[out, in]``, floating) into this module's storage, on its device."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Nf4Linear.load_weight: expected shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        data = quantize_nf4(weight)
        self.qweight, self.qscale = _frozen(data.codes), _frozen(data.scales)
        self.scale_factor, self.scale_mean = data.scale_factor, data.scale_mean
        self.compute_dtype = weight.dtype
        self._cache_q = self._cache_s = None

    def set_compute(self, compute: MixedPrecisionConfig | None) -> None:
        super().set_compute(compute)
        self.refresh_int8_cache()

    @torch.no_grad()
    def refresh_int8_cache(self) -> None:
        """(Re)build the INT8 copy used by INT8 compute when ``int8_cache`` is on (call after ``.to()``)."""
        self._cache_q = self._cache_s = None
        if self.int8_cache and self.compute is not None and self.qweight.device.type != "meta":
            q, s = _int8_weight("nf4", self._stored())
            self._cache_q, self._cache_s = q, s

    def _operands(self) -> tuple[tuple[Tensor, ...], str]:
        if self._cache_q is not None and self.compute is not None:
            return (self._cache_q, self._cache_s), "int8"
        return super()._operands()


class Int8Linear(QuantizedBaseLinear):
    """A frozen linear whose weight is stored as int8 per output channel: ``W ≈ qweight * scale[:, None]``.

    Parameters (``requires_grad=False``; FSDP2 shards them): ``qweight`` int8 ``[out, in]``, ``bias``. Buffer:
    ``scale`` float32 ``[out]`` (FSDP2 neither shards it nor casts it to its mixed-precision ``param_dtype``).
    INT8 compute multiplies ``qweight`` directly in both forward and input-gradient matmuls.
    """

    storage = "int8"
    stored = ("qweight", "scale")

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__(in_features, out_features, dtype)
        self.qweight = _frozen(torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = _frozen(torch.empty(out_features, dtype=dtype, device=device))

    @torch.no_grad()
    def load_weight(self, weight: Tensor) -> None:
        """Quantize ``weight`` row-wise (a chunk of rows at a time: no full float32 copy)."""
        if weight.dim() != 2 or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Int8Linear.load_weight: expected shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        s = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        step = max(1, _INT8_CHUNK_NUMEL // weight.shape[1])
        for r0 in range(0, weight.shape[0], step):
            qc, sc = quantize_int8(weight[r0:r0 + step], dim=1)
            q[r0:r0 + step], s[r0:r0 + step] = qc, sc.reshape(-1)
        self.qweight, self.scale = _frozen(q), s
        self.compute_dtype = weight.dtype


QuantizedLinear = QuantizedBaseLinear  # the earlier name
QUANTIZED_LINEARS = (Nf4Linear, Int8Linear)


@dataclass(frozen=True)
class QuantizedBaseConfig:
    """How :func:`convert_to_quantized_base` stores the frozen linears and computes with them."""

    storage: str = "nf4"  # "nf4" or "int8" (BASE_STORAGES)
    compute: MixedPrecisionConfig | None = None  # INT8 compute on the base (None: compute dtype)
    int8_cache: bool = False  # NF4 + INT8 compute: keep an INT8 copy computed once

    recipe = "lora_base_quant"  # the recipe's name in reports (its LowBitTrainingArguments field)

    def __post_init__(self):
        if self.storage not in BASE_STORAGES:
            raise ValueError(f"QuantizedBaseConfig.storage must be one of {BASE_STORAGES}, got {self.storage!r}")

    @property
    def format(self) -> str:
        """The earlier name of :attr:`storage`."""
        return self.storage

    @property
    def target(self) -> str:
        """What a swapped linear becomes, as the swap report says it."""
        return f"{self.storage.upper()} frozen base" + (" + INT8 compute" if self.compute else "")

    def make_empty(self, linear: nn.Linear, device=None) -> QuantizedBaseLinear:
        """An unfilled module for ``linear``'s shape (``load_weight`` fills it)."""
        dtype = linear.weight.dtype
        if self.storage == "nf4":
            new = Nf4Linear(linear.in_features, linear.out_features, linear.bias is not None, device, dtype,
                            int8_cache=self.int8_cache)
        else:
            new = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None, device, dtype)
        new.compute = self.compute
        return new

    def make(self, linear: nn.Linear) -> QuantizedBaseLinear:
        new = (Nf4Linear.from_linear(linear, int8_cache=self.int8_cache) if self.storage == "nf4"
               else Int8Linear.from_linear(linear))
        new.set_compute(self.compute)
        return new

    def filter(self, base: LinearFilter) -> LinearFilter:
        """``base`` plus the storage's shape rule (NF4: in_features a multiple of its 64-element block)."""
        return replace(base, in_features_multiple_of=BLOCK_SIZE) if self.storage == "nf4" else base


def convert_to_quantized_base(model: nn.Module, config: QuantizedBaseConfig,
                              filter: LinearFilter = LinearFilter()) -> SwapReport:
    """Replace each eligible ``nn.Linear`` of ``model`` by a frozen quantized base, in place.

    Each weight is quantized on its own device as it is visited and the bf16 original is released
    when the swap drops it, so the peak is the model plus one layer's quantization temporaries.
    """
    return swap_linears(model, lambda name, linear: config.make(linear), recipe=config.recipe, target=config.target,
                        filter=config.filter(filter), already=QUANTIZED_LINEARS)


def quantize_base(model: nn.Module, config: QuantizedBaseConfig, filter: LinearFilter = LinearFilter(),
                  recipe: str = "lora_base_quant") -> SwapReport:
    """The earlier name of :func:`convert_to_quantized_base` (``recipe`` names the report)."""
    report = convert_to_quantized_base(model, config, filter)
    report.recipe = recipe
    return report
