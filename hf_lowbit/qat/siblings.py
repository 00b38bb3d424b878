"""Sibling linears served as one (issue 26): ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` multiply the
same input, so at decode one GEMV over their weights stacked along the output dim does the work of two or three.

At one decoded token a linear is a GEMV: it streams its weight once, and the small ones (a Llama-8B layer's k/v:
1024 x 4096) do not fill an H200 with work, so each runs far below the bandwidth the large ones reach, and each costs
its own launches (the FP8 path: an activation-quantization kernel and the GEMV, plus a split-K reduction). Stacked,
q/k/v is one 6144-row weight and gate/up one of 28,672 rows: one quantization of the activation, one launch, the
bandwidth of a large GEMV. vLLM (``QKVParallelLinear``, ``MergedColumnParallelLinear``) and gpt-fast stack them for
the same reason, by rewriting the model; here the model's own ``forward`` stays as transformers wrote it:

* :func:`fuse_siblings` replaces each sibling by a :class:`SiblingLinear` and registers one :class:`SiblingGroup` on
  their parent (the stacked weight, built by the serving class's ``concat``: the same bytes, the old ones freed);
* the first sibling called computes the stacked product and keeps it, with its input, in the group's stash; a
  sibling called on *that same tensor* (``is``; the contract: not modified in place between the calls, as no
  transformers model does) takes its columns from it, and the last one empties the stash;
* a parent that does not call its siblings on one input (cross-attention, whose ``k_proj``/``v_proj`` read the
  encoder's states; a decode step that calls ``q_proj`` alone against cached keys; one model run from several
  threads; a forward cut by an exception between siblings) shows itself as a new input arriving while a product is
  still unclaimed: the group then stops stacking for good (``shared = False``) and serves each sibling from its own
  rows of the stacked weight (views, no copy: ``forward_rows``). So every output is its own input's columns, and
  a model that cannot gain pays at most one stacked product too many.

Under ``torch.compile`` the stash is a plain attribute replaced whole (an immutable tuple, read once: no thread can
see half of another's), whose writes Dynamo records as side effects: the graph holds one stacked call per group, and
the stash is empty again at the end of every forward (nothing held between calls, no guard that changes from one
call to the next; the one switch to ``shared = False`` recompiles once). The rows' float32 sums may run in another
order than separately (the GEMV's split over K is chosen from the stacked shape), so outputs agree with the unfused
ones within float32 reordering, not bit for bit. The serving model's state dict names the stacked buffers
(``...self_attn.siblings_q_proj_k_proj_v_proj.linear.weight_codes``), not the siblings' own.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..swap import SwapReport

__all__ = ["SIBLING_GROUPS", "SiblingGroup", "SiblingLinear", "fuse_siblings"]

# the attribute names of linears that read the same input, per parent module (Llama, Mistral, Qwen2/3, Gemma, ...)
SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGroup(nn.Module):
    """The stacked linear of a group of siblings (``linear``: a serving linear whose output features are the
    siblings' in ``names`` order, with ``forward_rows(x, start, end)``: the product of rows ``start:end`` alone) and
    the columns each sibling owns."""

    def __init__(self, linear: nn.Module, names: Sequence[str], sizes: Sequence[int]):
        super().__init__()
        self.linear = linear
        self.names = tuple(names)
        self.sizes = tuple(int(s) for s in sizes)
        self.offsets = tuple(sum(self.sizes[:i]) for i in range(len(self.sizes)))
        self.shared = True  # False once the parent showed it does not call the siblings on one input
        self._stash = None  # (x, its stacked product, siblings yet to take their columns), replaced whole

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling ``index``'s output for input ``x``: its columns of the stacked product, or its own rows'
        product once the group stopped stacking."""
        start = self.offsets[index]
        end = start + self.sizes[index]
        if not self.shared:
            return self.linear.forward_rows(x, start, end)
        stash = self._stash  # one read
        if stash is not None and stash[0] is x:
            y = stash[1]
            self._stash = (x, y, stash[2] - 1) if stash[2] > 1 else None
        elif stash is not None:  # another input while a product is unclaimed: stop stacking (see the module doc)
            self._stash = None
            self.shared = False
            return self.linear.forward_rows(x, start, end)
        else:
            y = self.linear(x)
            self._stash = (x, y, len(self.sizes) - 1)
        return y[..., start:end]

    def extra_repr(self) -> str:
        return f"siblings={'+'.join(self.names)}, sizes={self.sizes}" + ("" if self.shared else ", not stacking")


class SiblingLinear(nn.Module):
    """What a fused sibling becomes: its columns of its :class:`SiblingGroup`'s stacked product. Holds no tensors
    (the group, registered on the parent, holds the weight); ``in_features`` / ``out_features`` as the linear's."""

    def __init__(self, group: SiblingGroup, index: int):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a submodule: the parent registers it once
        self.index = index
        self.in_features = group.linear.in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        g = self.group
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"columns {g.offsets[self.index]}:{g.offsets[self.index] + self.out_features} of "
                f"{'+'.join(g.names)}")


def shared_problem(modules: Sequence[nn.Module], attrs: Sequence[str] = ("in_features",)) -> str | None:
    """What every serving linear's ``stack_problem`` checks (one line, or None): the same values of ``attrs``, one
    device (their buffers'), a bias in all of them or none, one bias dtype. Each kind adds its own checks."""
    first = modules[0]
    device = next(first.buffers()).device
    for m in modules[1:]:
        for attr in attrs:
            if getattr(m, attr) != getattr(first, attr):
                return f"{attr} differs ({getattr(first, attr)}, {getattr(m, attr)})"
        if next(m.buffers()).device != device:
            return f"on different devices ({device}, {next(m.buffers()).device})"
        if (m.bias is None) != (first.bias is None):
            return "some have a bias, some not"
        if m.bias is not None and m.bias.dtype != first.bias.dtype:
            return f"bias dtypes differ ({first.bias.dtype}, {m.bias.dtype})"
    return None


def fuse_siblings(model: nn.Module, kind: type, concat: Callable[[list[nn.Module]], nn.Module],
                  problem: Callable[[list[nn.Module]], str | None], report: SwapReport | None = None,
                  groups: Sequence[Sequence[str]] = SIBLING_GROUPS) -> list[str]:
    """Stack every group of sibling ``kind`` modules (children of one parent named as in ``groups``) into one,
    in place. ``problem(modules)``: why a group cannot be stacked (one line) or None; ``concat(modules)``: the
    stacked module (with ``forward_rows``, :class:`SiblingGroup`). A group is left as it is when not all its
    siblings are ``kind`` or when one of them is held in another place too (a module shared by two parents).
    Returns the fused groups' names (``model.layers.0.self_attn.q_proj+k_proj+v_proj``); with ``report``, each
    sibling's entry says what it became or why it was not stacked."""
    entries = {e.name: e for e in report.entries} if report is not None else {}
    homes: dict[int, int] = {}  # module -> how many (parent, name) places hold it
    for parent in model.modules():
        for child in parent._modules.values():  # every name, where children() yields a module once
            if child is not None:
                homes[id(child)] = homes.get(id(child), 0) + 1
    fused: list[str] = []
    # the parents alone, not every module: a list of all of them would keep each replaced sibling (its bytes) alive
    # until the walk ends, so a stacked 8B model would peak at its siblings' bytes twice (4 GiB in FP8)
    names_in_groups = {n for names in groups for n in names}
    parents = [(n, p) for n, p in model.named_modules() if names_in_groups & p._modules.keys()]
    for parent_name, parent in parents:
        for names in groups:
            mods = [getattr(parent, n, None) for n in names]
            ours = [isinstance(m, kind) for m in mods]
            if not any(ours):
                continue
            prefix = f"{parent_name}." if parent_name else ""
            others = ", ".join(f"{n}: {'absent' if m is None else type(m).__name__}"
                               for n, m, o in zip(names, mods, ours) if not o)
            why = problem(mods) if all(ours) else f"its siblings are not all {kind.__name__} ({others})"
            if why is None and any(homes.get(id(m), 0) > 1 for m in mods):
                why = ("the same module under several names" if len({id(m) for m in mods}) < len(mods) else
                       "a sibling is held in several places (a shared module keeps its own weight)")
            if why is not None:
                for n, o in zip(names, ours):
                    if o and prefix + n in entries:
                        entries[prefix + n].reason += f" (not stacked with its siblings: {why})"
                continue
            group = SiblingGroup(concat(mods), names, [m.out_features for m in mods])
            parent.register_module("siblings_" + "_".join(names), group)
            for i, n in enumerate(names):
                setattr(parent, n, SiblingLinear(group, i))
                if prefix + n in entries:
                    entries[prefix + n].reason += f", stacked with {'+'.join(x for x in names if x != n)} (one GEMV)"
            fused.append(prefix + "+".join(names))
    return fused
