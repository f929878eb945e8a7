#!/usr/bin/env bash
# Sets up .venv if needed and runs the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
