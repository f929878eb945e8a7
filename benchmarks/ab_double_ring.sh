#!/usr/bin/env bash
# A/B: burst zigzag causal 16K, the old flat loops (a git worktree of 45051b0~1 at /tmp/oldtree:
#   git worktree add /tmp/oldtree 45051b0~1) vs the double-ring driver, alternating, no baseline.
set -e
for round in 1 2; do
  for tree in /tmp/oldtree /work/main; do
    cd $tree
    PYTHONPATH=$tree /work/main/.venv/bin/python -m burst bench --heads 8 --head-dim 64 --nproc 2 --threads 1 --seq-len 16384 --repeats 2 --causal --layout zigzag --strategies burst --no-baseline 2>&1 | grep "^| burst" | sed "s|^|$tree round $round |"
  done
done
