#!/usr/bin/env bash
# Creates .venv beside the repo and installs burst into it (idempotent).
# torch is pinned to 2.13.0 only when no torch is present: on our machines that takes the local CPU
# wheel, while a looser request would pull several GB of CUDA packages. pyproject keeps torch>=2.4.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
if ! .venv/bin/python -c "import burst, pytest" >/dev/null 2>&1; then
  .venv/bin/pip install -q -e ".[dev]"
fi
