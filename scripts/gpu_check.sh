#!/usr/bin/env bash
# scripts/gpu_check.sh DIR [--budget SECONDS] [--sections 1,3]: prove burst on this machine's GPU in one command (issue 27).
#
# Runs burst/bench/gpu_check/ (python -m burst.bench.gpu_check) with the python3 that already has a CUDA PyTorch (no install, no
# download; PYTHON=... to pick another) and writes DIR/report.md, DIR/report.json and DIR/log.txt.
# Sections: kernel exactness vs float64, the API on 1 and several ranks, speed vs SDPA, memory,
# CUDA-only features; each has its own time budget and the whole stays under 10 minutes (a hard
# stop at BURST_GPU_CHECK_TIMEOUT seconds, default 580; the report is rewritten after each section).
# BURST_DEVICE=cpu runs the same code at tiny sizes on the CPU (what the test suite does).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: scripts/gpu_check.sh DIR [--budget SECONDS]}
shift
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
timeout --kill-after=10 "${BURST_GPU_CHECK_TIMEOUT:-580}" "$python" -u -m burst.bench.gpu_check "$out" "$@" 2>&1 \
  | tee "$out/log.txt"
