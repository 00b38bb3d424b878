"""The package's shape: its layers (tools/layers.py: no import cycle, no import of a layer a module may not import,
every module in a layer, read from the source with ``ast``), and the module paths that moved (hf_lowbit/_moved.py):
importable under their old names, as the very modules at the new paths."""

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import layers  # noqa: E402

from hf_lowbit._moved import MOVED  # noqa: E402


def test_every_module_is_in_a_layer_and_imports_only_what_its_layer_may():
    graph = layers.import_graph()
    assert {layers.layer_of(m).name for m in graph} == {layer.name for layer in layers.LAYERS}
    assert layers.violations(graph) == []


def test_no_import_cycle():
    assert layers.cycles(layers.import_graph()) == []


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks():
    """The real tree: function-level imports (the CLI's data path, the NF4 kernel's Triton half), a TYPE_CHECKING
    one (QLoRA names mixed precision's config), a parent package's __init__ that an import runs, and none of the
    imports of libraries named like our modules (``import warnings``, ``from trl import ...``)."""
    graph = layers.import_graph()
    assert {"hf_lowbit.data.packing", "hf_lowbit.data", "hf_lowbit.trainer"} <= graph["hf_lowbit.cli.sft"]
    assert "hf_lowbit.mixed_precision" in graph["hf_lowbit.qlora.base"]
    assert "hf_lowbit.qlora" in graph["hf_lowbit.integrations.throughput"]  # qlora.base runs qlora/__init__
    assert "hf_lowbit.qlora" not in graph["hf_lowbit.qlora.lora"]  # ... which is running already for its own modules
    assert graph["hf_lowbit.trl"] == {"hf_lowbit.args", "hf_lowbit.trainer"}
    assert graph["hf_lowbit.kernels.nf4"] == {"hf_lowbit.kernels.triton_nf4"}  # inside a function, CUDA only
    assert graph["hf_lowbit.kernels._checks"] == set()


def test_a_hidden_cycle_and_an_upward_import_fail(tmp_path, monkeypatch):
    """A package where a kernel imports the trainer inside a function and swap imports a recipe under
    TYPE_CHECKING: both are violations, and the first closes a cycle."""
    pkg = tmp_path / "hf_lowbit"
    for name, text in {
        "__init__.py": "from .trainer import T\n",
        "trainer.py": "from .kernels import f\nT = 1\n",
        "kernels/__init__.py": "def f():\n    from ..trainer import T\n    return T\n",
        "swap.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .qat.linear import Q\n",
        "qat/__init__.py": "",
        "qat/linear.py": "from ..swap import *\nQ = 1\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    graph = layers.import_graph()
    assert layers.violations(graph) == ["hf_lowbit.kernels (kernels) imports hf_lowbit.trainer (user API)",
                                        "hf_lowbit.swap (core) imports hf_lowbit.qat (recipes)",
                                        "hf_lowbit.swap (core) imports hf_lowbit.qat.linear (recipes)"]
    found = layers.cycles(graph)
    assert ["hf_lowbit.kernels", "hf_lowbit.trainer", "hf_lowbit.kernels"] in found
    assert ["hf_lowbit.qat.linear", "hf_lowbit.swap", "hf_lowbit.qat.linear"] in found
    (pkg / "stray.py").write_text("")
    with pytest.raises(LookupError, match="hf_lowbit.stray is in no layer"):
        layers.violations(layers.import_graph())


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_moved_module(old):
    if old == "trl_trainer":
        pytest.importorskip("trl")
    new = importlib.import_module(f"hf_lowbit.{MOVED[old]}")
    assert importlib.import_module(f"hf_lowbit.{old}") is new
    assert new.__spec__.name == new.__name__ == f"hf_lowbit.{MOVED[old]}"  # its own spec, not the old name's


def test_old_paths_of_submodules_and_names():
    import hf_lowbit
    import hf_lowbit.ops.int8 as old_int8
    from hf_lowbit.kernels import int8
    from hf_lowbit.ops.nf4 import quantize_nf4
    from hf_lowbit.quantized_base import Nf4Linear

    assert old_int8 is int8 and hf_lowbit.ops is hf_lowbit.kernels and quantize_nf4.__module__ == "hf_lowbit.kernels.nf4"
    assert Nf4Linear is hf_lowbit.Nf4Linear and hf_lowbit.quantized_base is hf_lowbit.qlora.base
    # the modules that became packages keep their public names
    from hf_lowbit.data import build_char_tokenizer, pack  # noqa: F401
    from hf_lowbit.mixed_precision import LowBitLinear, refresh_weight_caches, set_weight_cache  # noqa: F401
    from hf_lowbit.qat import QAT_SCHEMES, FakeQuantScheduleCallback, qat_linear  # noqa: F401
    with pytest.raises(AttributeError):
        hf_lowbit.not_a_module
