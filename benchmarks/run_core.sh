#!/usr/bin/env bash
# Issue 2's benchmark: 2 ranks x 1 thread vs one process x 2 threads, fp32, 8 heads, dim 64,
# 8K-32K tokens, causal and full, forward+backward; then memory per rank as G grows.
# Writes benchmarks/core/*.json and benchmarks/core.md. Run alone: it uses both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/core
mkdir -p "$out"
B=".venv/bin/burst bench --heads 8 --head-dim 64 --dtype float32 --nproc 2 --threads 1"
for n in 8192 16384 32768; do
  reps=2; [ "$n" = 32768 ] && reps=1
  $B --seq-len $n --repeats $reps --strategies burst,ring,allgather --json $out/full_$n.json
  $B --seq-len $n --repeats $reps --causal --strategies burst,ring,allgather --json $out/causal_$n.json
done
# Memory per rank as G grows: benchmarks/run_memory.sh
bash benchmarks/run_memory.sh
.venv/bin/python benchmarks/report_core.py > benchmarks/core.md
