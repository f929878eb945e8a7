#!/usr/bin/env bash
# Issue 3's benchmark (BurstEngine Table 3 at our scale): full vs causal vs sliding window vs packed
# documents on the same 16K sequence, and the causal schedules side by side. 2 ranks x 1 thread,
# fp32, 8 heads, dim 64. Writes benchmarks/masks/*.json and benchmarks/masks.md. Run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/masks
mkdir -p "$out"
B=".venv/bin/burst bench --seq-len 16384 --heads 8 --head-dim 64 --dtype float32 --nproc 2 --threads 1 --repeats 2"
$B --strategies burst --no-baseline --json $out/full.json
$B --strategies burst --causal --layout zigzag --no-baseline --json $out/causal_zigzag.json
$B --strategies burst --causal --window 2047,0 --no-baseline --json $out/window_2048.json
$B --strategies burst --causal --documents 8 --layout zigzag --no-baseline --json $out/documents_8.json
# Causal schedules: contiguous ring (unbalanced) vs zigzag vs striped vs DistFlashAttn.
$B --strategies ring,burst,distflash --causal --layout contiguous --json $out/causal_contiguous.json
$B --strategies ring,burst --causal --layout zigzag --no-baseline --json $out/causal_zigzag_all.json
$B --strategies ring,burst --causal --layout striped --no-baseline --json $out/causal_striped.json
# Block-sparse (random 25% of 512-token block pairs, diagonal kept) under causal: contiguous vs striped (Fig. 11).
$B --strategies burst --block-sparse 512,0.25 --causal --layout contiguous --no-baseline --json $out/block_sparse_contiguous.json
$B --strategies burst --block-sparse 512,0.25 --causal --layout striped --no-baseline --json $out/block_sparse_striped.json
.venv/bin/python benchmarks/report_masks.py > benchmarks/masks.md.new  # it keeps masks.md's hand-written sections
mv benchmarks/masks.md.new benchmarks/masks.md
