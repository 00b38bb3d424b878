"""The one module-swap walker every recipe uses, and the report it returns.

:func:`swap_linears` visits every module of a model once. An ``nn.Linear`` that passes the filter
(not excluded by name, not the output embedding, large enough) is replaced by what the recipe's
factory builds from it; everything else that holds a matrix (``Conv1D``, ``Embedding``, linears of
other classes, filtered linears) is recorded with the reason it was left alone.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable

from torch import nn

SWAPPED = "swapped"
SKIPPED = "skipped"
PATCHED = "patched"  # the module stays, another library bound its forward (hf_lowbit.integrations.liger)


@dataclass
class SwapEntry:
    name: str
    module_type: str
    shape: tuple[int, ...]  # (out_features, in_features) for linears, the weight's shape otherwise
    action: str  # SWAPPED, SKIPPED or PATCHED
    reason: str  # what it became, or why not


@dataclass
class SwapReport:
    """What a recipe did to each matrix-holding module of a model."""

    recipe: str
    entries: list[SwapEntry] = field(default_factory=list)

    @property
    def swapped(self) -> list[SwapEntry]:
        return [e for e in self.entries if e.action == SWAPPED]

    @property
    def skipped(self) -> list[SwapEntry]:
        return [e for e in self.entries if e.action == SKIPPED]

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "entries": [asdict(e) for e in self.entries]}

    def summary(self) -> str:
        """Compact text: one line per (name pattern, shape, outcome), layer indices folded to ``*``."""
        already = [e for e in self.skipped if e.reason.startswith("already ")]
        if already and not self.swapped:  # e.g. INT8 compute over QLoRA bases set up by the report before
            rest = len(self.skipped) - len(already)
            return (f"[hf_lowbit] {self.recipe}: nothing further to swap; {len(already)} modules are "
                    f"{already[0].reason} from the recipe above" + (f", {rest} left as they were" if rest else ""))
        groups: Counter = Counter()
        for e in self.entries:
            pattern = re.sub(r"\.\d+\.", ".*.", e.name)
            groups[(e.action, pattern, e.module_type, e.shape, e.reason)] += 1
        patched = sum(e.action == PATCHED for e in self.entries)
        lines = [f"[hf_lowbit] {self.recipe}: {len(self.swapped)} modules swapped, "
                 f"{len(self.skipped)} left as they were" if not patched else
                 f"[hf_lowbit] {self.recipe}: {patched} modules patched"]
        for (action, pattern, mtype, shape, reason), n in sorted(groups.items(), key=lambda kv: kv[0][0] == SKIPPED):
            dims = " " + "x".join(map(str, shape)) if shape else ""
            count = f" (x{n})" if n > 1 else ""
            lines.append(f"  {action:7s} {pattern}{count} [{mtype}{dims}]: {reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


@dataclass(frozen=True)
class LinearFilter:
    """Which ``nn.Linear`` modules a recipe may take.

    ``exclude``: module names or glob patterns; a pattern also matches a name that ends with
    ``"." + pattern`` (so ``"lm_head"`` matches ``"model.lm_head"``). ``min_features``: layers with
    ``in_features`` or ``out_features`` below it are too small for low-bit matmuls to pay.
    ``multiple_of``: both features must be multiples of it (a kernel's alignment), else the layer is
    skipped as "shape not supported". ``in_features_multiple_of``: ``in_features`` alone must be a
    multiple of it (a quantization group or storage block: QAT's group size, NF4's 64 elements).
    ``exclude_output_embeddings``: also skip the model's LM head whatever its name.
    """

    exclude: tuple[str, ...] = ("lm_head",)
    min_features: int = 1
    multiple_of: int = 1
    in_features_multiple_of: int = 1
    exclude_output_embeddings: bool = True


# every nn.Linear, the LM head included: the serving swaps (hf_lowbit.qat.int4_serving / fp8_serving) decide by the
# loaded weight's type (their ``check``), not by name or size
SERVING_FILTER = LinearFilter(exclude=(), exclude_output_embeddings=False)


def name_matches(name: str, patterns: Iterable[str]) -> str | None:
    """The first pattern that matches module ``name``, or None."""
    for p in patterns:
        if name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
            return p
    return None


def including_output_embeddings(model: nn.Module, filter: LinearFilter) -> LinearFilter:
    """``filter`` that also takes ``model``'s output embedding (LM head): ``exclude_output_embeddings`` off, and the
    exclusion patterns that match the head's name dropped. A recipe's explicit "the head too" (QAT's
    ``include_lm_head``, mixed precision's ``lowbit_include_lm_head``) wins over a pattern naming it: the default
    ``lowbit_exclude_modules=["lm_head"]`` names it, so otherwise the switch would need the list edited as well.
    A dropped pattern is dropped for every module (a glob such as ``"*"`` would stop excluding the others too)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = None if head is None else next((n for n, m in model.named_modules() if m is head), None)
    exclude = tuple(p for p in filter.exclude if head_name is None or name_matches(head_name, [p]) is None)
    return replace(filter, exclude=exclude, exclude_output_embeddings=False)


def _parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def swap_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module], *, recipe: str,
                 target: str, filter: LinearFilter = LinearFilter(),
                 already: tuple[type, ...] | Callable[[nn.Module], bool] = (),
                 check: Callable[[nn.Linear], str | None] | None = None) -> SwapReport:
    """Replace each eligible ``nn.Linear`` of ``model`` by ``make(name, linear)``, in place.

    ``target`` describes what a swapped module becomes (for the report); modules that are already
    instances of ``already`` (or for which ``already(module)`` is true) are reported as such and left
    alone, so preparing twice is harmless. ``check``: the recipe's own condition on a linear that passed
    the filter (e.g. the type of its loaded weight), the reason it is skipped or None.
    """
    report = SwapReport(recipe=recipe)
    output_embeddings = None
    if filter.exclude_output_embeddings and hasattr(model, "get_output_embeddings"):
        output_embeddings = model.get_output_embeddings()

    todo: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if not name:
            continue
        mtype = type(module).__name__
        if already and (already(module) if callable(already) else isinstance(module, already)):
            report.entries.append(SwapEntry(name, mtype, _shape(module), SKIPPED, f"already {target}"))
            continue
        if type(module) is not nn.Linear:
            weight = getattr(module, "weight", None)
            is_leaf = next(module.children(), None) is None
            if is_leaf and isinstance(weight, nn.Parameter) and weight.dim() >= 2:
                why = ("a lookup, not a matmul" if isinstance(module, nn.Embedding)
                       else "subclass of nn.Linear with its own forward" if isinstance(module, nn.Linear)
                       else "not an nn.Linear; this recipe only swaps nn.Linear")
                report.entries.append(SwapEntry(name, mtype, tuple(weight.shape), SKIPPED, why))
            continue
        shape = (module.out_features, module.in_features)
        pattern = name_matches(name, filter.exclude)
        if pattern is not None:
            why = f"excluded by pattern {pattern!r}"
        elif module is output_embeddings:
            why = "output embedding (LM head): excluded by default"
        elif min(shape) < filter.min_features:
            why = f"too small: min(in, out) = {min(shape)} < min_features = {filter.min_features}"
        elif shape[0] % filter.multiple_of or shape[1] % filter.multiple_of:
            why = f"shape not supported: in and out features must be multiples of {filter.multiple_of}"
        elif shape[1] % filter.in_features_multiple_of:
            why = (f"shape not supported: in_features {shape[1]} is not a multiple of "
                   f"{filter.in_features_multiple_of} (the quantization group/block size)")
        elif check is not None and (why := check(module)):
            pass
        else:
            todo.append((name, module))
            report.entries.append(SwapEntry(name, mtype, shape, SWAPPED, target))
            continue
        report.entries.append(SwapEntry(name, mtype, shape, SKIPPED, why))

    # swap after the walk (never mutate a tree while iterating it), letting go of each replaced linear as it goes: a
    # list holding them all to the end would keep every original weight alive beside its replacement (a QLoRA base
    # made from a loaded bf16 model would peak at the bf16 model plus all its NF4 codes)
    for i in range(len(todo)):
        (name, module), todo[i] = todo[i], None
        parent, attr = _parent_and_attr(model, name)
        setattr(parent, attr, make(name, module))
        del module
    return report


def _shape(module: nn.Module) -> tuple[int, ...]:
    if isinstance(module, nn.Linear) or hasattr(module, "out_features"):  # quantized bases have no .weight
        return (module.out_features, module.in_features)
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if weight is not None else ()
