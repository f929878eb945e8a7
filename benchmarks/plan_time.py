"""Planning time of the mask planner at long sequences (single process, 1 thread): every rank pair's
`plan_tiles` for one call's shards, the CPU kernel's tile sizes. Two masks whose planning grew with the
sequence squared before 0.3.11: a document layout of many short documents (one run per document and rank)
and block-sparse masks (every pair of 1024-row runs checked with torch ops; strided runs: torch.unique of
every position).

    PYTHONPATH=. python benchmarks/plan_time.py > benchmarks/plan_time.md
"""

from __future__ import annotations

import time

import torch

import burst
from burst.kernels import cpu_flash
from burst.layout import DocumentLayout, segments
from burst.masks import MaskSpec, TileSizes, plan_tiles

WORLD = 2
LENGTHS = (65536, 131072, 262144, 524288)


def _documents(n: int, length: int = 128):
    cu = tuple(range(0, n + 1, length))
    return DocumentLayout(cu, "zigzag"), MaskSpec(causal=True, cu_seqlens=cu)


def _block_sparse(layout: str):
    def make(n: int, block: int = 128):
        rows = torch.arange(n // block)
        blocks = (rows[:, None] - rows[None, :]).abs() <= 1  # each block and its neighbours
        blocks[:, 0] = True  # and the first block, as attention sinks do
        return layout, MaskSpec(causal=True, block_sparse=burst.BlockSparseMask(block, blocks))

    return make


def _seconds(layout, spec, n: int) -> tuple[float, int]:
    sizes = TileSizes.for_kernel(cpu_flash, join_runs=True)
    start, tiles = time.perf_counter(), 0
    for q_rank in range(WORLD):
        for k_rank in range(WORLD):
            q, k = segments(layout, q_rank, WORLD, n // WORLD), segments(layout, k_rank, WORLD, n // WORLD)
            tiles += len(plan_tiles(q, k, spec, sizes))
    return time.perf_counter() - start, tiles


def main() -> None:
    torch.set_num_threads(1)
    print(__doc__.split("\n\n")[0].replace("\n", " "))
    print("\n| mask | tokens | planning, every rank pair (s) | tiles |\n|---|---|---|---|")
    masks = {
        "documents of 128, doc_zigzag": _documents,
        "block-sparse 128, contiguous": _block_sparse("contiguous"),
        "block-sparse 128, striped": _block_sparse("striped"),
    }
    for name, make in masks.items():
        for n in LENGTHS:
            seconds, tiles = _seconds(*make(n), n)
            print(f"| {name} | {n} | {seconds:.2f} | {tiles} |")


if __name__ == "__main__":
    main()
