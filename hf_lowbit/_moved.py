"""The module paths issue 28 moved, importable under their old names until 0.2 (docs/design.md, "Layout").

``import hf_lowbit.quantized_base`` or ``from hf_lowbit.ops.int8 import quantize_int8`` gives the module at its new
path (``hf_lowbit.qlora.base``, ``hf_lowbit.kernels.int8``) itself, not a copy: a copy of a kernel module would
register its ``hf_lowbit::`` custom ops a second time, and private names or patches through an old path would miss
the module the package uses. No file is left at an old path, so git follows each moved file's history, and the
edits of branches made before the move, to where it is now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

PACKAGE = __name__.rpartition(".")[0]
# old name -> new name, both under the package; a moved package's submodules follow it (ops.int8 -> kernels.int8)
MOVED = {
    "ops": "kernels",
    "fsdp_lowbit_all_gather": "mixed_precision.fsdp_all_gather",
    "quantized_base": "qlora.base",
    "lora": "qlora.lora",
    "loading": "qlora.loading",
    "export": "qat.export",
    "distributed": "integrations.distributed",
    "liger": "integrations.liger",
    "throughput": "integrations.throughput",
    "packing": "data.packing",
    "sft": "cli.sft",
    "trl_trainer": "trl",
    "validation": "warnings",
}


def new_name(name: str) -> str | None:
    """Where module ``name`` (e.g. ``"hf_lowbit.ops.int8"``) is now, or None if it did not move."""
    old, dot, sub = name.removeprefix(PACKAGE + ".").partition(".")
    if not name.startswith(PACKAGE + ".") or old not in MOVED:
        return None
    return f"{PACKAGE}.{MOVED[old]}{dot}{sub}"


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name first (before the path finder, which would load a moved package's files a second time
    under it) and loads it as the module at the new name."""

    def __init__(self):
        self._specs: dict[str, object] = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # nothing to run; the import system set the old name's spec on the module: it gets its own back
        module.__spec__ = self._specs.pop(module.__name__)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
