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
    """With cuda:0 current, a launch on cuda:1 tensors (the first CUDA one, positional or keyword: a CPU tensor before
    it does not decide) runs under torch.cuda.device(cuda:1) and returns what the launcher returns; on the current
    device, or on the CPU (the interpreter), nothing is switched (fake CUDA tensors: no GPU here)."""
    switched, seen = [], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    @contextlib.contextmanager
    def device(d):
        switched.append(torch.device(d))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)

    @on_operand_device
    def launcher(scale, x=None, *, tiles=None):
        """doc kept"""
        seen.append((scale, tiles))
        return x

    with FakeTensorMode():
        on1, on0 = torch.empty(4, device="cuda:1"), torch.empty(4, device="cuda:0")
    assert launcher(2.0, on1, tiles=(1, 2, 3)) is on1 and switched == [torch.device("cuda:1")]
    assert launcher(torch.zeros(1), x=on1) is on1 and len(switched) == 2  # a CPU tensor first, the CUDA one by keyword
    assert launcher(2.0, on0) is on0 and launcher(2.0, torch.zeros(2)) is not None and len(switched) == 2
    assert len(seen) == 4 and seen[0] == (2.0, (1, 2, 3))
    assert launcher.__doc__ == "doc kept" and launcher._hf_lowbit_on_operand_device


def _jit_names(tree: ast.Module) -> set[str]:
    """Names of the module's Triton kernels: functions decorated with triton.jit / autotune / heuristics."""
    def is_triton(d):
        d = d.func if isinstance(d, ast.Call) else d
        return (isinstance(d, ast.Attribute) and d.attr in ("jit", "autotune", "heuristics")) or \
            (isinstance(d, ast.Name) and d.id == "jit")
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(map(is_triton, n.decorator_list))}


def _launches(fn: ast.FunctionDef, kernels: set[str]) -> bool:
    """Whether ``fn`` launches a Triton kernel: ``k[grid](...)``, ``wrap_triton(k)[grid](...)`` or ``k.run(...)``
    with ``k`` one of the module's kernels or any name bound to one (``k = _a_kernel if c else _b_kernel``)."""
    aliases = set(kernels)
    for n in ast.walk(fn):  # names assigned from an expression that mentions a kernel
        if isinstance(n, ast.Assign) and any(isinstance(m, ast.Name) and m.id in kernels for m in ast.walk(n.value)):
            aliases |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript):
            v = n.func.value
            if isinstance(v, ast.Name) and v.id in aliases:
                return True
            if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "wrap_triton":
                return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "run" \
                and isinstance(n.func.value, ast.Name) and n.func.value.id in aliases:
            return True
    return False


def _decorated(fn: ast.FunctionDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "on_operand_device")
               or (isinstance(d, ast.Attribute) and d.attr == "on_operand_device") for d in fn.decorator_list)


PACKAGE = os.path.dirname(KERNELS)
MODULES = sorted(os.path.relpath(os.path.join(d, f), PACKAGE) for d, _, fs in os.walk(PACKAGE) for f in fs
                 if f.endswith(".py") and "__pycache__" not in d)


@pytest.mark.parametrize("module", MODULES)
def test_every_launcher_switches_to_its_operands_device(module):
    """Every function in hf_lowbit that launches a Triton kernel (at any depth: a nested one inside a decorated
    function is covered by it) is wrapped by on_operand_device."""
    tree = ast.parse(open(os.path.join(PACKAGE, module)).read())
    kernels = _jit_names(tree)
    missing = []

    def visit(node, covered: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and child.name not in kernels:
                here = covered or _decorated(child)
                if not here and _launches(child, kernels):
                    missing.append(child.name)
                visit(child, here)
            elif not isinstance(child, ast.FunctionDef):
                visit(child, covered)

    visit(tree, False)
    assert not missing, f"hf_lowbit/{module}: {missing} launch Triton kernels without @on_operand_device"


def test_the_launcher_scan_sees_every_form():
    """The scan above finds launches by subscript, through wrap_triton, through an alias and by .run, in methods too,
    and not in a decorated one (so a test that passes is not one that sees nothing)."""
    src = """
import triton
@triton.jit
def _a_kernel(x): pass
@triton.jit
def _b(x): pass
def plain(x): _a_kernel[(1,)](x)
def wrapped(x): wrap_triton(_b)[(1,)](x)
def alias(x, c):
    k = _a_kernel if c else _b
    k[(1,)](x)
def by_run(x): _b.run(x, grid=(1,))
class C:
    def method(self, x): _b[(1,)](x)
@on_operand_device
def ok(x): _b[(1,)](x)
def none(x): return x
"""
    tree = ast.parse(src)
    kernels = _jit_names(tree)
    assert kernels == {"_a_kernel", "_b"}
    found = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name not in kernels
             and _launches(n, kernels) and not _decorated(n)}
    assert found == {"plain", "wrapped", "alias", "by_run", "method"}
