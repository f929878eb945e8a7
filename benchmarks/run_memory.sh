#!/usr/bin/env bash
# Peak memory per rank as G grows (16K tokens, causal, fp32, 8 heads, dim 64), G ranks x 1 thread,
# with the single process as reference. G=4 oversubscribes 2 cores: its times mean nothing, its memory does.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/core
mkdir -p "$out"
# Twice: with glibc's default malloc, and with a fixed mmap threshold (large blocks go back to the
# OS when freed), which separates memory the algorithms hold from memory glibc keeps after churn.
for tuned in "" 1; do
  for g in 1 2 4; do
    suffix=$([ -n "$tuned" ] && echo _mmap || true)
    env ${tuned:+MALLOC_MMAP_THRESHOLD_=1048576} .venv/bin/burst bench --heads 8 --head-dim 64 --seq-len 16384 \
      --causal --nproc $g --threads 1 --repeats 1 --strategies burst,ring,allgather \
      $([ $g = 1 ] || echo --no-baseline) --json $out/mem_g$g$suffix.json
  done
done
