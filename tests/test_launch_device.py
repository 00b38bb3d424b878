"""Triton launches on their operands' GPU (hf_lowbit.kernels._launch): eager launchers switch to the device of
their first tensor argument when another is current (a model spread over GPUs by device_map), and every function
in hf_lowbit/kernels that launches a Triton kernel goes through it."""

import ast
import contextlib
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_lowbit.kernels._launch import on_operand_device

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf_lowbit", "kernels")


def test_a_launcher_runs_on_its_operands_device(monkeypatch):
    """With cuda:0 current, a launch on cuda:1 tensors runs under torch.cuda.device(cuda:1) and returns what the
    launcher returns; on the current device, or on the CPU (the interpreter), nothing is switched (fake CUDA tensors:
    no GPU here)."""
    switched, seen = [], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    @contextlib.contextmanager
    def device(d):
        switched.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)

    @on_operand_device
    def launcher(scale, x, *, tiles=None):
        """doc kept"""
        seen.append((scale, tiles))
        return x

    with FakeTensorMode():
        on1, on0 = torch.empty(4, device="cuda:1"), torch.empty(4, device="cuda:0")
    assert launcher(2.0, on1, tiles=(1, 2, 3)) is on1 and switched == [torch.device("cuda:1")]
    assert launcher(2.0, on0) is on0 and launcher(2.0, torch.zeros(2)) is not None and len(switched) == 1
    assert seen == [(2.0, (1, 2, 3)), (2.0, None), (2.0, None)]
    assert launcher.__doc__ == "doc kept" and launcher._hf_lowbit_on_operand_device


def _launchers(path: str) -> list[str]:
    """Top-level functions of a module that launch a Triton kernel: ``kernel[grid](...)`` or
    ``wrap_triton(kernel)[grid](...)`` in their body."""
    tree = ast.parse(open(path).read())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            launches = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
                           and (isinstance(n.func.value, ast.Name) and n.func.value.id.endswith("_kernel")
                                or isinstance(n.func.value, ast.Call)
                                and getattr(n.func.value.func, "id", None) == "wrap_triton")
                           for n in ast.walk(node))
            if launches:
                out.append(node.name)
    return out


@pytest.mark.parametrize("module", sorted(f[:-3] for f in os.listdir(KERNELS) if f.endswith(".py")))
def test_every_eager_launcher_switches_to_its_operands_device(module):
    import importlib

    mod = importlib.import_module(f"hf_lowbit.kernels.{module}")
    for name in _launchers(os.path.join(KERNELS, module + ".py")):
        assert getattr(getattr(mod, name), "_hf_lowbit_on_operand_device", False), \
            f"hf_lowbit/kernels/{module}.py: {name} launches Triton kernels without @on_operand_device"
