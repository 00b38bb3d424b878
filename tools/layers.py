#!/usr/bin/env python
"""The layers of the ``hf_lowbit`` package and the imports between them, read from the source with ``ast``.

    python tools/layers.py                          # each layer, what it imports, and any cycle or violation
    python tools/layers.py --png docs/layers.png    # the picture at the top of docs/design.md (needs matplotlib)

``LAYERS`` is the rule tests/test_layers.py enforces: every module belongs to one layer, and imports only modules
of its own layer or of the layers that layer ``may_import``; the package's imports have no cycle. Every import
statement counts, wherever it is: at module level, inside a function (where an import that would close a cycle
used to hide) and under ``if TYPE_CHECKING:`` (a dependency of the code's meaning, if not of its start-up).
Importing ``a.b.c`` also runs ``a.b``'s ``__init__``, so that is an edge too (except from inside ``a.b``, and
except to ``hf_lowbit`` itself: its ``__init__`` runs before any module of the package, as the front door).
Nothing is imported, so the check needs neither torch nor a GPU.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hf_lowbit"


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # module names under the package; a name also covers its submodules
    may_import: tuple[str, ...]  # the other layers its modules may import
    what: str


# top to bottom, as docs/layers.png draws them
LAYERS = (
    Layer("package", ("__init__", "_quiet", "_moved"), ("cli", "user API", "integrations", "arguments", "recipes",
                                                         "core", "kernels", "data"),
          "`from hf_lowbit import ...`, the old module paths; imports every layer (arrows not drawn)"),
    Layer("cli", ("cli",), ("user API", "integrations", "arguments", "recipes", "core", "kernels", "data"),
          "hf-lowbit-sft / scripts/sft.py"),
    Layer("user API", ("trainer", "trl"), ("integrations", "arguments", "recipes", "core", "kernels"),
          "LowBitTrainer, LowBitTrainerMixin, LowBitSFTTrainer"),
    Layer("integrations", ("integrations",), ("arguments", "recipes", "core", "kernels"),
          "FSDP2, DeepSpeed, Liger, tokens/s and MFU"),
    Layer("arguments", ("args", "prepare"), ("recipes", "core", "kernels"),
          "LowBitTrainingArguments, prepare_model: arguments -> recipes"),
    Layer("recipes", ("mixed_precision", "qlora", "qat"), ("core", "kernels"),
          "config + convert + module, one folder each"),
    Layer("core", ("swap", "compute", "warnings", "atomic"), ("kernels",),
          "the swap walker, the compute dtype, LowBitWarning, atomic writes"),
    Layer("kernels", ("kernels",), (), "formats registry, quantize and scaled-matmul ops"),
    Layer("data", ("data",), (), "records in, fixed-length token blocks out"),
)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that importing module ``name`` (file ``path``) may import, by its source."""
    here = name if _is_package(path) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import name`: the submodule pkg.name if there is one (`from . import packing`), else pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import hf_lowbit.kernels.int8 as x`: the module itself
                target = target.rpartition(".")[0]
            if not target.startswith(PACKAGE):
                continue
            found.add(target)
            parent = target.rpartition(".")[0]
            while parent != PACKAGE and parent and not (name + ".").startswith(parent + "."):
                found.add(parent)  # its __init__ runs first
                parent = parent.rpartition(".")[0]
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> Layer:
    rel = module.removeprefix(PACKAGE).removeprefix(".") or "__init__"
    for layer in LAYERS:
        if any(rel == m or rel.startswith(m + ".") for m in layer.modules):
            return layer
    raise LookupError(f"{module} is in no layer of tools/layers.py's LAYERS: add it to one")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a layer its importer may not import: ``"a (layer) imports b (layer)"``."""
    out = []
    for a in sorted(graph):
        la = layer_of(a)
        for b in sorted(graph[a]):
            lb = layer_of(b)
            if lb is not la and lb.name not in la.may_import:
                out.append(f"{a} ({la.name}) imports {b} ({lb.name})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: one shortest cycle per strongly connected group of modules (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_shortest_cycle(graph, set(g), g[0]) for g in groups]


def _shortest_cycle(graph, group: set[str], start: str) -> list[str]:
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return [start]


def layer_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """(importing layer, imported layer) -> number of module imports between them."""
    out: dict[tuple[str, str], int] = {}
    for a, targets in graph.items():
        for b in targets:
            key = (layer_of(a).name, layer_of(b).name)
            if key[0] != key[1]:
                out[key] = out.get(key, 0) + 1
    return out


def layer_files(layer: Layer, modules: dict[str, Path]) -> list[str]:
    """What ``layer`` holds, a line per folder and one for its top-level files: ``"qlora/  base.py  lora.py"``."""
    lines, top = [], []
    for m in layer.modules:
        path = ROOT / PACKAGE / m
        if path.is_dir():
            files = sorted(p.name for p in path.glob("*.py") if p.name != "__init__.py")
            lines.append(f"{m}/  " + "  ".join(files))
        elif (ROOT / PACKAGE / f"{m}.py").exists():
            top.append(f"{m}.py")
    return lines + (["  ".join(top)] if top else [])


def draw(graph: dict[str, set[str]], png: str) -> None:
    """The layers as boxes, top to bottom (data beside them), and an arrow from each layer to every layer its
    modules import (the package's front door, which imports them all, is left without arrows)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    modules = package_modules()
    column = [layer for layer in LAYERS if layer.name != "data"]
    side = next(layer for layer in LAYERS if layer.name == "data")
    height, gap, width, side_width = 1.2, 0.45, 8.4, 3.4
    pos = {layer.name: (0.0, -i * (height + gap)) for i, layer in enumerate(column)}
    pos[side.name] = (width + 1.0, pos["core"][1])
    colours = {"package": "#eeeeee", "cli": "#e3f2fd", "user API": "#bbdefb", "integrations": "#c8e6c9",
               "arguments": "#d1c4e9", "recipes": "#ffe0b2", "core": "#fff9c4", "kernels": "#ffcdd2", "data": "#dcedc8"}
    fig, ax = plt.subplots(figsize=(12, 12))
    for layer in LAYERS:
        x, y = pos[layer.name]
        w = side_width if layer is side else width
        ax.add_patch(FancyBboxPatch((x, y), w, height, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=colours.get(layer.name, "white"), ec="#555555", lw=1))
        ax.text(x + 0.12, y + height - 0.1, layer.name, va="top", fontsize=11, weight="bold")
        ax.text(x + 0.12, y + height - 0.38, "\n".join(textwrap.wrap(layer.what, 58 if layer is side else 110)),
                va="top", fontsize=8.5, style="italic")
        files = (layer_files(layer, modules) if layer.name != "package"
                 else ["__init__.py (public names, PEFT dispatch)  _moved.py (old paths)  _quiet.py"])
        wrapped = [part for line in files for part in textwrap.wrap(line, 38 if layer is side else 86)]
        ax.text(x + 0.12, y + height - 0.62, "\n".join(wrapped), va="top", fontsize=8, family="monospace")
    order = [layer.name for layer in column]
    edges = sorted((a, b) for a, b in layer_edges(graph) if a != "package")
    outgoing = {a: [e for e in edges if e[0] == a] for a in order + [side.name]}
    incoming = {b: [e for e in edges if e[1] == b] for b in order + [side.name]}
    for a, b in edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        if b == side.name:  # from the right edge, across to the side box
            start, end, rad = (xa + width, ya + height / 2), (xb, yb + height * 0.7), -0.15
        else:
            hops = order.index(b) - order.index(a)
            if hops == 1:  # straight down
                start, end, rad = (xa + width / 2, ya), (xb + width / 2, yb + height), 0.0
            else:  # down the left side, each edge at its own height on both boxes, wider arcs for longer jumps
                i, j = outgoing[a].index((a, b)), incoming[b].index((a, b))
                start = (xa, ya + height * (0.2 + 0.6 * i / max(1, len(outgoing[a]) - 1)))
                end = (xb, yb + height * (0.8 - 0.6 * j / max(1, len(incoming[b]) - 1)))
                rad = 0.15 + 0.06 * hops
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=0.9, color="#37474f",
                                     connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))
    ax.set_xlim(-3.2, width + side_width + 1.3)
    ax.set_ylim(pos[column[-1].name][1] - 0.2, height + 0.3)
    ax.axis("off")
    ax.set_title("hf_lowbit's layers: an arrow means the layer imports the one it points at; imports only go down\n"
                 "(drawn by tools/layers.py from the source; tests/test_layers.py fails on a cycle or an upward import)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--png", help="draw the layers and their imports into this PNG (needs matplotlib)")
    a = p.parse_args()
    graph = import_graph()
    for layer in LAYERS:
        mods = sorted(m for m in graph if layer_of(m) is layer)
        uses = sorted({layer_of(b).name for m in mods for b in graph[m]} - {layer.name})
        print(f"{layer.name:12s} {len(mods):2d} modules; imports {', '.join(uses) or 'nothing of the package'}")
    bad, loops = violations(graph), cycles(graph)
    for v in bad:
        print("layer violation:", v)
    for c in loops:
        print("import cycle:", " -> ".join(c))
    if a.png:
        draw(graph, a.png)
    return 1 if bad or loops else 0


if __name__ == "__main__":
    sys.exit(main())
