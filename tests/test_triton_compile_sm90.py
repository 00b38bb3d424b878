"""The serving kernels (int4 W4A16, FP8 row-wise GEMV) compiled for the H200 (sm_90) on this machine, no GPU needed
(tests/_triton_sm90_compile.py): what Triton's CPU interpreter accepts but compiled Triton refuses shows here, not
in the first minutes of a GPU session."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compiles_at_all() -> str | None:
    """Why Triton cannot compile for sm_90 here (no NVIDIA backend, no ptxas), or None."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"no Triton NVIDIA backend: {e}"
    return None


def test_serving_kernels_compile_for_sm90():
    why = _compiles_at_all()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_triton_sm90_compile.py")], env=env,
                       capture_output=True, text=True, timeout=900, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "FAIL" not in out, out[-8000:]
    assert "compiled" in out and "kernel configs for sm_90" in out, out[-8000:]


def test_int4_gemv_sass_factored_has_fewer_instructions():
    """tools/int4_gemv_sass.py: the factored GEMV's main loop at sm_90 issues fewer SASS instructions a code than the
    tile GEMV's (the point of the factored design: no scale FMA, no bf16 rounding a code), and its tensor-core form
    fewer still (two codes an instruction, no shared-memory trip), without spills, for group 128 and 32; and the
    tensor-core form's wgmmas stay in flight across steps (the wait in its loop leaves some: its point, which ptxas
    takes away when it serializes them); the figures the kernels' docstrings quote come from this tool."""
    import re

    why = _compiles_at_all()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "int4_gemv_sass.py")], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    per = {(m.group(1), m.group(2), m.group(3)): (float(m.group(5)), int(m.group(4)), m.group(6))
           for m in re.finditer(r"^(tile|factored|mma) GEMV \S+ \S+ \S+ \S+ group (\d+) split (\d+): \d+ regs, (\d+) B "
                                r"spilled.* ([\d.]+) a code[^;\n]*;[^;\n]*(?:; wgmma waits in the loop leave (\d+))?",
                                r.stdout, re.MULTILINE)}
    assert len(per) == 12, r.stdout
    for gs in ("128", "32"):
        for split in ("1", "4"):
            (fact, fact_spill, _), (tile, _, _) = per["factored", gs, split], per["tile", gs, split]
            assert fact_spill == 0 and fact < 0.7 * tile, (gs, split, fact, tile)
            mma, mma_spill, in_flight = per["mma", gs, split]
            assert mma_spill == 0 and mma < fact, (gs, split, mma, fact)
            assert in_flight is not None and int(in_flight) > 0, (gs, split, r.stdout)
