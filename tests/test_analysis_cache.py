"""hf_lowbit.kernels.analysis_cache: torch's per-launch Triton kernel analysis done once per distinct launch
signature, with the same result."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _trace(layers: int, cache: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HF_LOWBIT_TRITON_ANALYSIS_CACHE"] = "1" if cache else "0"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_analysis_cache_check.py"), str(layers)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


@needs_triton
def test_cached_analysis_traces_the_same_graphs_with_fewer_ttir_generations():
    """The CUDA graph of a 2-layer INT8 Llama compiled whole (a stand-in sm_90 target, AOTAutograd's partition):
    the forward and backward graphs are the same with the cache and without, and the cache generated the TTIR of
    each distinct launch once (our three kernels here) instead of once per launch."""
    off, on = _trace(2, cache=False), _trace(2, cache=True)
    assert on["forward"] == off["forward"] and on["backward"] == off["backward"]
    assert off["cache"] == {"hits": 0, "misses": 0, "uncached": 0}
    launches = on["cache"]["hits"] + on["cache"]["misses"]
    assert launches == off["generate_ttir"] > 40  # every launch went through the cache
    assert on["generate_ttir"] == on["cache"]["misses"] <= 4 < on["cache"]["hits"]


@needs_triton
def test_key_is_what_the_ttir_depends_on():
    """Launch signatures that give the same TTIR share a key; those that may not, do not."""
    import triton
    import triton.language as tl
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.backends.compiler import GPUTarget

    from hf_lowbit.kernels.analysis_cache import _UNCACHEABLE, _key

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32), mask=tl.arange(0, BLOCK) < n)

    class StandIn:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    previous = triton.runtime.driver._active
    triton.runtime.driver.set_active(StandIn())
    try:
        with FakeTensorMode():
            x, y = torch.empty(8), torch.empty(8, dtype=torch.bfloat16)

            def key(**kw):
                return _key(kernel, {"x_ptr": x, "n": 32, "BLOCK": 16, **kw}, ({},))

            assert key() == key(n=64) == key(n=4096)  # sizes by their specialization: divisible by 16
            assert key() != key(n=33) != key(n=1)  # not divisible by 16; 1 (a constant to Triton)
            assert key(n=33) == key(n=35)
            assert key() != key(BLOCK=32)  # a constexpr by value
            assert key() != key(x_ptr=y)  # the pointer's dtype
            assert key() != key(n=2**40)  # an i64 argument
        assert _key(kernel, {"x_ptr": torch.empty(8), "n": 32, "BLOCK": 16}, ({},)) is _UNCACHEABLE  # real tensor
    finally:
        triton.runtime.driver._active = previous  # reset_active() would look for a GPU driver
