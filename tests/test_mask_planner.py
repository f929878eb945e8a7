"""The tile planner covers exactly the attended pairs, once each, for every layout and mask.

Single process: for every pair of ranks' shards the tiles of burst.masks.plan_tiles, painted onto a
(local q x local k) grid, must equal the independently built mask, without overlap; skipped work is
never planned and the pair count matches.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import burst
import burst.masks
from burst.layout import segments, shard_indices
from burst.masks import MaskSpec, plan_tiles
from cases import reference_mask


def _specs(seqlen):
    g = torch.Generator().manual_seed(3)
    nb = seqlen // 8
    layout = (torch.rand(nb, nb, generator=g) < 0.4) | torch.eye(nb, dtype=torch.bool)
    layout[nb // 2] = False
    docs = [0, *sorted({7, 30, 31, seqlen - 9} & set(range(1, seqlen))), seqlen]
    yield dict(causal=True)
    yield dict(window=(9, 4))
    yield dict(causal=True, window=(13, -1))
    yield dict(cu_seqlens=docs)
    yield dict(causal=True, cu_seqlens=docs)
    yield dict(block_sparse=burst.BlockSparseMask(8, layout))
    yield dict(causal=True, block_sparse=burst.BlockSparseMask(8, layout), window=(20, 0))


def _painted(tiles, n):
    grid = torch.zeros(n, n, dtype=torch.int64)
    for t in tiles:
        if t.mask is not None:
            part = t.mask.long()
        elif t.causal:
            part = torch.tril(torch.ones(t.q.length, t.k.length, dtype=torch.long))
        else:
            part = torch.ones(t.q.length, t.k.length, dtype=torch.long)
        grid[t.q.rows, t.k.rows] += part
    return grid


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tiles_cover_the_mask_exactly(layout, world, monkeypatch):
    monkeypatch.setattr(burst.masks, "TILE", 6)
    n = 16
    seqlen = n * world
    for kwargs in _specs(seqlen):
        spec = MaskSpec(causal=kwargs.get("causal", False), window=kwargs.get("window"),
                        cu_seqlens=tuple(kwargs["cu_seqlens"]) if "cu_seqlens" in kwargs else None,
                        block_sparse=kwargs.get("block_sparse"))
        allowed = reference_mask(seqlen, **kwargs)
        # A cap below the partial-tile size too (the backends cap rows per kernel call).
        for qr, kr, max_rows in itertools.product(range(world), range(world), (burst.masks.MAX_TILE, 5)):
            tiles = plan_tiles(segments(layout, qr, world, n), segments(layout, kr, world, n), spec, max_rows)
            assert all(t.q.length <= max_rows and t.k.length <= max_rows for t in tiles)
            q_idx, k_idx = shard_indices(layout, qr, world, seqlen), shard_indices(layout, kr, world, seqlen)
            want = allowed[q_idx][:, k_idx]
            grid = _painted(tiles, n)
            assert grid.max() <= 1, (kwargs, layout, qr, kr, "overlapping tiles")
            assert torch.equal(grid.bool(), want), (kwargs, layout, qr, kr)
            assert sum(t.pairs for t in tiles) == int(want.sum())
            assert all(t.pairs > 0 for t in tiles), "a planned tile attends nothing"
