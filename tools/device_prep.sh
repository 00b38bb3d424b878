#!/usr/bin/env bash
# What a device call needs that the H200 image lacks, made here (this machine has PyPI; the device has no network):
#   .whl/          wheels for the image's Python 3.12: torchao, bitsandbytes, pytest-xdist (+ execnet), gemlite
#                  (the int4 GEMV peer of benchmarks/benchmark_int4.py; pure Python + Triton, PyPI has its sdist only)
#   .corpus_cache/ the text corpus + BPE of the QAT stages (qat_ptq_hurts, ptq_sensitivity): ~7 min on 2 cores
# Both paths are git-ignored: name them in the device call's `carry`. On the device, before the stage:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site HF_LOWBIT_COMMIT=$(git rev-parse --short HEAD)   # (or the sha, if no .git there)
# Usage: bash tools/device_prep.sh [wheels] [corpus]   (both by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
what=${*:-wheels corpus}
if [[ " $what " == *" wheels "* ]]; then
  mkdir -p .whl
  # pinned as requirements/ci.txt pins them (torchao) or as the QLoRA peer was measured (bitsandbytes 0.50.2)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 -d .whl torchao==0.18.0 bitsandbytes==0.50.2 pytest-xdist==3.8.0 execnet==2.1.2
  # gemlite 0.6.0.post2 (Triton >= 3.6, the image's): built here into a py3-none-any wheel, no dependencies pulled
  $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl gemlite==0.6.0.post2 2>/dev/null \
    || $PY -m pip wheel -q --no-deps -w .whl gemlite==0.6.0.post2
  ls -1 .whl
fi
if [[ " $what " == *" corpus "* ]]; then
  # the entry qat_ptq_hurts and ptq_sensitivity read (benchmarks/run.py: their --corpus_* / --vocab / --seq flags)
  $PY benchmarks/ptq_sensitivity.py --corpus_only --corpus_packages torch,transformers,sympy,networkx,numpy \
    --corpus_cache .corpus_cache --vocab 8192 --seq 256
fi
