#!/usr/bin/env bash
# Issue 29 item 1: time per attended (query, key) pair of masked attention against full attention's,
# 8K and 16K tokens, 2 ranks x 1 thread, burst, fp32, 8 heads, dim 64 (fwd+bwd, best of 3 passes after
# a warm-up). Masks: causal sliding window 1024, causal packed documents (8, zigzag, and doc_zigzag:
# each document cut in 2G parts). Writes
# benchmarks/masks/tiles_*.json; benchmarks/report_masked_tiles.py turns them into a table.
# OUT=dir to write elsewhere (e.g. to compare another tree: PYTHONPATH=that_tree OUT=/tmp/x bash ...).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/masks}
mkdir -p "$out"
B=".venv/bin/burst bench --heads 8 --head-dim 64 --dtype float32 --nproc 2 --threads 1 --repeats 3 --strategies burst --no-baseline"
for n in 8192 16384; do
  $B --seq-len $n --json "$out/tiles_full_$n.json" >/dev/null
  $B --seq-len $n --causal --window 1023,0 --json "$out/tiles_window_$n.json" >/dev/null
  $B --seq-len $n --causal --documents 8 --layout zigzag --json "$out/tiles_documents_$n.json" >/dev/null
  $B --seq-len $n --causal --documents 8 --layout doc_zigzag --json "$out/tiles_docbalanced_$n.json" >/dev/null
  $B --seq-len $n --causal --layout zigzag --json "$out/tiles_causal_$n.json" >/dev/null
done
