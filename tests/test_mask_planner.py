"""The tile planner covers exactly the attended pairs, once each, for every layout and mask.

Single process: for every pair of ranks' shards the tiles of burst.masks.plan_tiles, painted onto a
(local q x local k) grid, must equal the independently built mask, without overlap; skipped work is
never planned and the pair count matches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import burst
import burst.masks
import pytest
import torch
from burst.layout import segments, shard_indices
from burst.masks import MaskSpec, TileSizes, plan_tiles

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
    yield dict(causal=True, window=(4, 0))  # divides the tiles: cuDNN's plan cuts it into triangles
    yield dict(cu_seqlens=docs)
    yield dict(causal=True, cu_seqlens=docs)
    yield dict(block_sparse=burst.BlockSparseMask(8, layout))
    yield dict(causal=True, block_sparse=burst.BlockSparseMask(8, layout), window=(20, 0))


def _spec(kwargs) -> MaskSpec:
    """The MaskSpec of burst.attention's mask arguments."""
    return MaskSpec(
        causal=kwargs.get("causal", False),
        window=kwargs.get("window"),
        cu_seqlens=tuple(kwargs["cu_seqlens"]) if "cu_seqlens" in kwargs else None,
        block_sparse=kwargs.get("block_sparse"),
    )


def _painted(tiles, n):
    grid = torch.zeros(n, n, dtype=torch.int64)
    for t in tiles:  # a BAND tile's mask is its bands' (a reversed triangle's included)
        if t.mask is not None:
            part = t.mask.long()
        elif t.causal:
            part = torch.tril(torch.ones(t.q.length, t.k.length, dtype=torch.long))
        else:
            part = torch.ones(t.q.length, t.k.length, dtype=torch.long)
        grid[t.q.rows, t.k.rows] += part
    return grid


_SIZES = (
    TileSizes(burst.masks.MAX_TILE),
    TileSizes(5),
    TileSizes(5, 2, True),
    TileSizes(burst.masks.MAX_TILE, 3, True),
    # kernels that take masks as arguments: flash_attn's bands and varlen, FlexAttention's rules, both
    TileSizes(burst.masks.MAX_TILE, bands=True),
    TileSizes(5, bands=True),
    TileSizes(burst.masks.MAX_TILE, rules=True),
    TileSizes(5, bands=True, rules=True),
    # cuDNN's: bands that are causal triangles (documents' pieces, a window dividing the tile) as triangles
    TileSizes(burst.masks.MAX_TILE, bands=True, triangle_rows=2),
    TileSizes(5, bands=True, triangle_rows=4),
    # full tiles joined across runs of positions (a zigzag shard's halves): what AttentionCall plans
    TileSizes(burst.masks.MAX_TILE, join_runs=True),
    TileSizes(5, 2, True, join_runs=True),
    TileSizes(burst.masks.MAX_TILE, bands=True, triangle_rows=2, join_runs=True),
)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tiles_cover_the_mask_exactly(layout, world, monkeypatch):
    monkeypatch.setattr(burst.masks.planner, "TILE", 6)
    n = 16
    seqlen = n * world
    for kwargs in _specs(seqlen):
        spec = _spec(kwargs)
        allowed = reference_mask(seqlen, **kwargs)
        # A cap below the partial-tile size too (the backends cap rows per kernel call), and partial
        # tiles and triangles halved down to small leaves (the CPU kernel's sizes, scaled down).
        for qr, kr, sizes in itertools.product(range(world), range(world), _SIZES):
            tiles = plan_tiles(segments(layout, qr, world, n), segments(layout, kr, world, n), spec, sizes=sizes)
            assert all(t.q.length <= sizes.max_rows and t.k.length <= sizes.max_rows for t in tiles)
            if sizes.split_triangles:
                assert all(t.q.length <= sizes.leaf_rows for t in tiles if t.causal or t.mask is not None)
            if sizes.rules or (sizes.bands and "block_sparse" not in kwargs):  # no dense mask left to build
                assert all(t.cover is not burst.masks.Cover.PARTIAL for t in tiles), (kwargs, layout, sizes)
            q_idx, k_idx = shard_indices(layout, qr, world, seqlen), shard_indices(layout, kr, world, seqlen)
            want = allowed[q_idx][:, k_idx]
            grid = _painted(tiles, n)
            assert grid.max() <= 1, (kwargs, layout, qr, kr, "overlapping tiles")
            assert torch.equal(grid.bool(), want), (kwargs, layout, qr, kr)
            assert sum(t.pairs for t in tiles) == int(want.sum())
            assert all(t.pairs > 0 for t in tiles), "a planned tile attends nothing"


def test_cudnn_plans_windows_and_documents_as_triangles():
    """With triangle_rows (cuDNN's plan), a causal window that divides the tile runs as DIAG tiles and
    reversed triangles, documents as their diagonal pieces, each at least triangle_rows long; a window
    that does not divide the tile, or smaller pieces, stay one band or varlen call."""
    from burst.layout import Segment
    from burst.masks import Cover

    whole, sizes = [Segment(0, 64, 0)], TileSizes(burst.masks.MAX_TILE, bands=True, triangle_rows=16)
    window = plan_tiles(whole, whole, MaskSpec(causal=True, window=(16, 0)), sizes)
    assert [t.cover for t in window].count(Cover.DIAG) == 4
    mirrored = [t for t in window if t.cover is Cover.BAND]
    assert len(mirrored) == 3 and all(t.bands.is_reversed_triangle and t.q.length == 16 for t in mirrored)
    for spec in (MaskSpec(causal=True, window=(12, 0)), MaskSpec(causal=True, window=(8, 0))):  # 64 % 12; 8 < 16
        assert [t.cover for t in plan_tiles(whole, whole, spec, sizes)] == [Cover.BAND], spec
    docs = plan_tiles(whole, whole, MaskSpec(causal=True, cu_seqlens=(0, 16, 40, 64)), sizes)
    assert [(t.cover, t.q.length) for t in docs] == [(Cover.DIAG, 16), (Cover.DIAG, 24), (Cover.DIAG, 24)]
    small = plan_tiles(whole, whole, MaskSpec(causal=True, cu_seqlens=(0, 8, 40, 64)), sizes)
    assert len(small) == 1 and small[0].bands.sequences == 3  # one varlen call


def test_a_zigzag_step_off_the_diagonal_is_one_call():
    """Causal zigzag: a rank's queries against an earlier rank's keys are both its halves against one
    half, and against a later rank's keys its second half against both halves: with join_runs one full
    call each (its joined side Rows: no positions to misread), within max_rows; AttentionCall joins
    only without an index selection, which reads positions."""
    from burst.layout import Rows
    from burst.masks import Cover

    world, n, spec = 4, 32, MaskSpec(causal=True)
    segs = [segments("zigzag", r, world, n) for r in range(world)]
    joined = TileSizes(burst.masks.MAX_TILE, join_runs=True)
    earlier, later = plan_tiles(segs[2], segs[0], spec, joined), plan_tiles(segs[1], segs[2], spec, joined)
    assert [(t.cover, t.q.rows, t.k.rows, type(t.q)) for t in earlier] == [
        (Cover.FULL, slice(0, 32), slice(0, 16), Rows)
    ]
    assert [(t.cover, t.q.rows, t.k.rows, type(t.k)) for t in later] == [
        (Cover.FULL, slice(16, 32), slice(0, 32), Rows)
    ]
    assert not hasattr(earlier[0].q, "first")
    alone = segments("zigzag", 0, 1, n)  # one rank, no mask: the four quarter tiles join into one call
    assert [(t.q.rows, t.k.rows) for t in plan_tiles(alone, alone, MaskSpec(), joined)] == [(slice(0, n),) * 2]
    assert len(plan_tiles(segs[2], segs[0], spec, TileSizes(16, join_runs=True))) == 2  # the cap holds
    assert len(plan_tiles(segs[2], segs[0], spec, TileSizes(burst.masks.MAX_TILE))) == 2
    indices = torch.zeros(1, n, 2, dtype=torch.long)
    with_selection = dataclasses.replace(_call("zigzag", 2, world, n, spec), indices=indices)
    assert len(_call("zigzag", 2, world, n, spec).tiles(2, 0)) == 1 and len(with_selection.tiles(2, 0)) == 2


def _call(layout, rank, world, n, spec):
    from burst.call import AttentionCall
    from burst.kernels import reference

    return AttentionCall(
        group=None, rank=rank, world=world, layout=layout, local_len=n, spec=spec, scale=1.0, kernel=reference
    )


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_chunk_stream_plans_agree_and_cover_the_needed_rows(layout, world):
    """burst's backward stream (schedules/chunk_stream.py): what a rank serves at each step is exactly what
    its peer expects (else ranks would hang or mismatch), every query row that attends a key of the
    receiving rank travels, chunks never overlap, and every rank has the same slots at each step."""
    from burst.schedules.chunk_stream import plan_stream
    from burst.strategies.burst_stream import query_chunk_needed

    n, rows = 16, 3
    seqlen = n * world
    for kwargs in [*_specs(seqlen), {}]:
        spec = _spec(kwargs)
        allowed = reference_mask(seqlen, **kwargs)
        plans = []
        for r in range(world):
            call = _call(layout, r, world, n, spec)
            plans.append(plan_stream(call.q_schedule, n, rows, functools.partial(query_chunk_needed, call)))
        assert len({len(p) for p in plans}) == 1
        assert all(len({p[j].slots for p in plans}) == 1 for j in range(len(plans[0])))
        for r, plan in enumerate(plans):
            for j, step in enumerate(plan):
                assert step.chunks_out == plans[step.peer][j].chunks_in, (kwargs, r, j)
                assert len(step.chunks_in) <= step.slots
                covered = torch.zeros(n, dtype=torch.long)
                for a, b in step.chunks_in:
                    covered[a:b] += 1
                assert covered.max() <= 1, (kwargs, r, j, step.chunks_in)
                q_pos = shard_indices(layout, step.src, world, seqlen)
                k_pos = shard_indices(layout, r, world, seqlen)
                needed = allowed[q_pos][:, k_pos].any(dim=1)
                assert bool((covered.bool() | ~needed).all()), (kwargs, r, j, step.chunks_in)
        if kwargs == dict(causal=True) and layout == "zigzag":  # equal work per slot on every rank
            assert all(len(s.chunks_in) == s.slots for p in plans for s in p[1:])


# The layouts pinned by hand, not through shard_indices itself: every test above (and burst.shard,
# burst.unshard, the strategies) takes shard_indices' word for which tokens a rank holds.
PINNED = {  # (layout, world, seq_len) -> each rank's global token indices, in local order
    # BurstEngine eq. 11: 2G chunks, rank r holds chunk r and chunk 2G-1-r (16 tokens: chunks of 2)
    ("zigzag", 4, 16): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    ("zigzag", 2, 8): [[0, 1, 6, 7], [2, 3, 4, 5]],
    # eq. 13: rank r holds tokens r, r+G, r+2G, ...
    ("striped", 4, 16): [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    ("striped", 2, 8): [[0, 2, 4, 6], [1, 3, 5, 7]],
    ("contiguous", 4, 16): [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
}


@pytest.mark.parametrize("layout, world, seqlen", list(PINNED))
def test_layouts_hold_the_papers_token_indices(layout, world, seqlen):
    held = [shard_indices(layout, r, world, seqlen).tolist() for r in range(world)]
    assert held == PINNED[(layout, world, seqlen)], (layout, world, held)
    # the planner's segments name the same tokens, in the same order
    for r in range(world):
        positions = [p for s in segments(layout, r, world, seqlen // world) for p in s.positions().tolist()]
        assert positions == PINNED[(layout, world, seqlen)][r], (layout, world, r, positions)


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_document_layouts_plan_each_document_against_its_own_runs(split, monkeypatch):
    """A document layout holds one run per document and rank: every run met every other rank's runs, so
    planning grew with the documents squared (6.6 s for 512 documents of 128 tokens at 2 ranks). The key runs
    a query run may reach are found by bisection now: the tiles cover the mask exactly, as before, and the pairs
    of runs looked at grow with the documents, not their square."""
    from burst.layout import DocumentLayout
    from burst.masks import planner

    world, docs, length = 3, 24, 12  # every document cuts into 2 x 3 parts of 2 tokens
    cu = [i * length for i in range(docs + 1)]
    seqlen = cu[-1]
    layout = DocumentLayout(tuple(cu), split)
    looked_at = []
    reachable = planner._reachable
    monkeypatch.setattr(planner, "_reachable", lambda qs, ks, spec: looked_at.append(r := reachable(qs, ks, spec)) or r)
    for kwargs in (dict(causal=True), dict(causal=True, window=(5, 0)), dict(window=(3, 3)), {}):
        kwargs = {**kwargs, "cu_seqlens": cu}
        spec, allowed = _spec(kwargs), reference_mask(seqlen, **kwargs)
        for qr, kr in itertools.product(range(world), range(world)):
            looked_at.clear()
            q_segs, k_segs = layout.segments(qr, world), layout.segments(kr, world)
            tiles = plan_tiles(q_segs, k_segs, spec, sizes=TileSizes(burst.masks.MAX_TILE, join_runs=True))
            want = allowed[shard_indices(layout, qr, world, seqlen)][:, shard_indices(layout, kr, world, seqlen)]
            grid = _painted(tiles, seqlen // world)
            assert grid.max() <= 1 and torch.equal(grid.bool(), want), (kwargs, split, qr, kr)
            assert len(looked_at) == len(q_segs) and sum(map(len, looked_at)) <= 2 * len(k_segs), (kwargs, qr, kr)


def test_the_blocks_a_strided_run_touches():
    """_block_cover reads the blocks a run's positions fall in: a slice of consecutive blocks when its stride is
    no larger than a block, else one per position (it asked torch.unique of every position of each sub-pair)."""
    from burst.layout import Segment
    from burst.masks.rules import _blocks_of

    layout = torch.arange(100 * 100).reshape(100, 100)  # each block pair its own number
    for first, length, stride, block in itertools.product((0, 3, 17), (1, 5, 9), (1, 2, 3, 7, 8, 9), (1, 3, 8)):
        seg = Segment(0, length, first, stride)
        want = torch.unique(seg.positions() // block)
        got = layout.numpy()[_blocks_of(seg, block)][:, 0]
        assert got.tolist() == layout[want][:, 0].tolist(), (first, length, stride, block)


def test_the_plan_cache_counts_the_block_sparse_layouts_it_keeps_alive():
    """Each cached tile holds its mask spec, and a block-sparse spec its whole layout: a mask new at every call had
    kept every layout alive, uncounted (a helper's probe: ~8 MB a call, no bound in practice). The cache counts
    the layout and the dense masks that band and rule tiles build, and stays within its limit."""
    from burst import call
    from burst.masks import BlockSparseMask

    n, block, limit = 256, 1, 256 << 10  # layouts of 256 x 256 blocks (64 KiB) in a cache of 256 KiB
    q, k = segments("contiguous", 0, 2, n // 2), segments("contiguous", 1, 2, n // 2)
    sizes = TileSizes(1024, 64, True)
    cache = call.BoundedCache(limit, size=call._plan_bytes, largest=limit)
    for seed in range(20):  # 20 new masks: 1.25 MiB of layouts if every one were kept
        layout = torch.ones(n // block, n // block, dtype=torch.bool)
        layout[seed, n // 2 + seed] = False  # a block of rank 0's queries x rank 1's keys: a few tiles, a new mask
        spec = MaskSpec(block_sparse=BlockSparseMask(block, layout))
        plan = cache.get((spec.key, tuple(q), tuple(k), sizes), lambda: tuple(plan_tiles(q, k, spec, sizes=sizes)))
        assert call._plan_bytes(plan) >= layout.numel()
    held = {id(t.spec.block_sparse) for plan in cache._values.values() for t in plan}
    assert 0 < len(held) * (n // block) ** 2 <= limit, len(held)
