#!/usr/bin/env bash
# Issue 29 item 3: causal zigzag forward+backward over 1,048,576 tokens on 8 local ranks (burst,
# 1 head, dim 64, fp32, one cold pass: a warm-up would double an hour-long run). Peak memory per
# rank, pairs balance and 64 rows per rank against float64 attention come from `burst bench`.
# Writes benchmarks/million/burst_1048576.json and the log; benchmarks/million.md is written from them.
# Run alone (it uses both cores for about an hour); `nice` lets lighter work go first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/million
mkdir -p "$out"
n=${BURST_MILLION_TOKENS:-1048576}
{ date -u +"start %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- burst || echo ' (burst/ modified)')"
  MALLOC_MMAP_THRESHOLD_=1048576 nice -n 10 .venv/bin/burst bench --seq-len "$n" --heads 1 --head-dim 64 \
    --dtype float32 --causal --layout zigzag --nproc 8 --threads 1 --strategies burst --repeats 0 \
    --no-baseline --json "$out/burst_$n.json"
  date -u +"end %Y-%m-%dT%H:%M:%SZ"; } 2>&1 | tee "$out/burst_$n.log"
