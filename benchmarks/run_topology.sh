#!/usr/bin/env bash
# Issue 13's benchmark: 4 ranks as 2 nodes x 2 on this machine, inter-node link EMULATED at 0.01, 0.03, 0.1
# and 1 GB/s (intra-node: the real loopback), fp32, 8 heads, dim 64, full mask: burst and ring on the
# flat ring vs the double ring, ulysses, usp. Writes benchmarks/topology/*.json and topology.md.
# 4 ranks share 2 cores: compute is twice as slow as on 4 real devices, which makes links look faster
# than they would next to real compute; the comparison between strategies is what this shows.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/topology
mkdir -p "$out"
N=${N:-4096}
for gbps in 0.01 0.03 0.1 1; do
  .venv/bin/burst bench --seq-len "$N" --heads 8 --head-dim 64 --nproc 4 --threads 1 --repeats 1 --no-baseline \
    --ranks-per-node 2 --inter-node-gbps "$gbps" --strategies burst:flat,burst,ring:flat,ring,ulysses,usp \
    --json "$out/inter_${gbps}.json"
done
.venv/bin/python benchmarks/report_topology.py > benchmarks/topology.md
.venv/bin/python benchmarks/plan_topology.py >> benchmarks/topology.md   # needs benchmarks/report/results.json (burst bench --report)
