#!/usr/bin/env bash
# Peak memory per rank as G grows (causal, fp32, 8 heads, dim 64), G ranks x 1 thread, with one
# process running SDPA as reference. G=4 and G=8 oversubscribe 2 cores: their times mean nothing,
# their memory does. Writes benchmarks/core/mem_<tokens>_g<G>[_mmap].json; report: report_core.py.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/core
mkdir -p "$out"
run() {  # tokens G strategies suffix [env...]
  local n=$1 g=$2 strategies=$3 suffix=$4; shift 4
  env "$@" .venv/bin/burst bench --heads 8 --head-dim 64 --seq-len "$n" --causal --nproc "$g" --threads 1 \
    --repeats 1 --strategies "$strategies" $([ "$g" = 1 ] || echo --no-baseline) --json "$out/mem_${n}_g${g}${suffix}.json"
}
# 16K: glibc as it comes, and with a fixed mmap threshold (freed large blocks go back to the OS),
# which separates memory the algorithms hold from memory glibc keeps after churn.
for g in 1 2 4 8; do
  run 16384 "$g" burst,ring,allgather "" GLIBC_DEFAULTS=1
  run 16384 "$g" burst,ring,allgather _mmap MALLOC_MMAP_THRESHOLD_=1048576
done
# 32K, burst only: the fixed per-process part weighs half as much.
for g in 1 2 4 8; do
  run 32768 "$g" burst _mmap MALLOC_MMAP_THRESHOLD_=1048576
done
