#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite, then (with no arguments) the transformers
# tests again on the lowest transformers release pyproject.toml admits, so a release on either end of
# the range that breaks us fails here, naming its version (pytest's header prints it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
# The set-up leaves byte-compiling to the imports (setup.sh): let them cache what they compile, here
# where the suite starts hundreds of processes that import torch, transformers and burst.
unset PYTHONDONTWRITEBYTECODE
cd "$root"
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# Two workers (pytest-xdist), one test module each at a time, the longest first (tests/conftest.py):
# much of a test's time is one process starting or waiting on another, which leaves a core idle. One
# thread a process: two workers of two threads each (torch's default here) ran ~10% slower. Then,
# alone, the tests marked serial.
OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
.venv/bin/python -m pytest -q -m serial
bash scripts/test_lowest_transformers.sh
