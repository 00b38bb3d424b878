#!/usr/bin/env bash
# The stages are one table in benchmarks/run.py now (python benchmarks/run.py --list); this name runs it until 0.2.
exec python3 "$(dirname "$0")/run.py" "$@"
