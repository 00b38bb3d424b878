"""The Triton INT8 matmul against the exact integer reference: interpreted on CPU, compiled on CUDA."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpreter_works() -> bool:
    import numpy

    return tuple(int(v) for v in numpy.__version__.split(".")[:2]) < (2, 4)


@pytest.mark.skipif(not _interpreter_works(), reason="Triton 3.6's interpreter breaks on numpy >= 2.4 "
                    "(requirements/ci.txt pins numpy<2.4); the CUDA test covers the kernel where a GPU is")
def test_triton_int8_scaled_mm_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_triton_checks.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked 24 matmuls and 24 quantizations" in proc.stdout


@pytest.mark.cuda
def test_triton_int8_scaled_mm_cuda():
    from _triton_checks import check_int8_scaled_mm

    assert check_int8_scaled_mm("cuda") > 0


@pytest.mark.cuda
def test_triton_quantize_t_cuda():
    from _triton_checks import check_quantize_t

    assert check_quantize_t("cuda") > 0
