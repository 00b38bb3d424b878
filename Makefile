# Two commands do all set-up on a fresh machine (Python 3.10+):
#   make sft    - create .venv, install, run scripts/sft.py on its embedded default
#   make test   - create .venv, install, run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# make test: pytest-xdist worker processes (2: the CI machine's cores; most tests are single-threaded Python:
# subprocesses, Triton's interpreter, compiles); WORKERS=0 runs every test in the one pytest process
WORKERS ?= 2

.PHONY: sft test install clean

$(VENV)/.installed: pyproject.toml requirements/ci.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c requirements/ci.txt -e ".[test]"
	touch $@

install: $(VENV)/.installed

sft: $(VENV)/.installed
	$(PY) scripts/sft.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal --durations=15 $(ARGS)

clean:
	rm -rf $(VENV) runs
