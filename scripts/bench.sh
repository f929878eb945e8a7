#!/usr/bin/env bash
# Sets up .venv if needed and runs `burst bench` (default: 2 local CPU processes) with any extra options.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/burst bench "$@"
