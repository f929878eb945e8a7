"""Packed causal work per rank under each layout: the planner's exact (query, key) pair counts.

    .venv/bin/python benchmarks/doc_balance.py > benchmarks/doc_balance.md

Documents of uneven lengths (seeded; each a multiple of 2G so the per-document layouts take them)
packed into one causal sequence. For every layout, the pairs each rank computes (what
burst.CommStats().pairs("forward") reports in a run) and max/mean: 1.00 is perfect balance, and the
slowest rank sets the step time. No timing here: `burst bench` measures it.
"""

from __future__ import annotations

import torch

from burst.layout import DocumentLayout, segments
from burst.masks import MaskSpec, plan_tiles

TOKENS = 16384
DOCUMENTS = 8


def documents(world: int, seed: int = 1) -> tuple[int, ...]:
    unit = 2 * world
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(TOKENS // unit - 1, generator=g)[: DOCUMENTS - 1].add(1).tolist())
    return (0, *(c * unit for c in cuts), TOKENS)


def pairs_per_rank(layout, world: int, spec: MaskSpec) -> list[int]:
    n = TOKENS // world
    return [
        sum(
            t.pairs
            for k in range(world)
            for t in plan_tiles(segments(layout, q, world, n), segments(layout, k, world, n), spec)
        )
        for q in range(world)
    ]


def main() -> None:
    print("| G | documents (tokens) | layout | pairs per rank (M) | max/mean |")
    print("|---|---|---|---|---|")
    for world in (2, 4, 8):
        cu = documents(world)
        spec = MaskSpec(causal=True, cu_seqlens=cu)
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        layouts = {
            "contiguous": "contiguous",
            "zigzag": "zigzag",
            "striped": "striped",
            "doc_contiguous": DocumentLayout(cu, "contiguous"),
            "doc_zigzag": DocumentLayout(cu, "zigzag"),
        }
        for name, layout in layouts.items():
            pairs = pairs_per_rank(layout, world, spec)
            mean = sum(pairs) / world
            print(
                f"| {world} | {lengths} | {name} | {', '.join(f'{p / 1e6:.2f}' for p in pairs)} | "
                f"{max(pairs) / mean:.2f} |"
            )


if __name__ == "__main__":
    main()
