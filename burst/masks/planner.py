"""The tile planner: the kernel calls ("tiles") that compute a pair of position runs under a mask.

Strategies never look at a mask themselves: they ask `plan_tiles` for the tiles of a block pair and
hand them to the kernel. A block pair with no attended entry yields no tile (no compute); a pair
that is a clean lower triangle uses the kernel's causal path (which skips the upper half). A partial
pair of consecutive positions under causal and document masks is cut exactly where the mask changes
(the other run's ends, the documents' bounds): every piece is then skipped, full or a clean triangle,
and no tile carries a mask. Other partial pairs (windows, block-sparse, strided runs) are cut into tiles
of `TILE` rows, and a partial tile is halved each way until its pieces are skipped, whole or a clean
triangle, or small (`SUB_TILE` rows, or the kernel's `LEAF_ROWS`): empty pieces are skipped, whole ones
run without a mask (as large as they come, coalesced along the keys) or on the causal path, and only
the small pieces on a mask's edge carry a dense boolean mask (the CPU kernel spends full time on a
masked tile, and building the mask costs too). A kernel whose causal path pays for much of the masked
half (the CPU one) has its triangles halved the same way (`TileSizes.split_triangles`).

A kernel that takes masks as arguments (`TileSizes.bands`: flash_attn's window and varlen interfaces)
gets no dense mask for causal, window and document masks on runs of equal stride: such a pair is a
diagonal band of the tile (`Bands`, one BAND tile, trimmed to the rows and keys it attends), and a pair
across documents is cut at the documents' bounds only and its pieces sent as one varlen call per run of
pieces with the same window. A kernel that evaluates masks itself (`TileSizes.rules`: FlexAttention)
gets the remaining partial tiles (block-sparse masks, runs of unequal strides) whole, as their rule
over global positions (`PositionRule`). Only a kernel that takes neither gets dense masks.

What attends is rules.py's (MaskSpec); this module only asks it and cuts.
"""

from __future__ import annotations

import bisect

from ..layout import Rows, Segment
from .bands import Bands
from .rules import Cover, MaskSpec
from .tiles import Tile, TileSizes

TILE = 512  # rows per tile when a block pair is partial: small enough to skip, big enough to run fast


def plan_tiles(
    q_segs: list[Segment], k_segs: list[Segment], spec: MaskSpec, sizes: TileSizes = TileSizes()
) -> list[Tile]:
    """The kernel calls that compute queries `q_segs` against keys `k_segs` under `spec`.

    No call has more than `sizes.max_rows` query or key rows: kernels return fresh outputs and
    gradients per call, so the cap bounds those temporaries (a tile's dq, dk, dv instead of a whole
    shard's). `sizes` also sets the leaves of partial tiles and triangles.
    """
    tiles: list[Tile] = []
    sorted_apart = len(k_segs) >= 8 and _apart_and_rising(k_segs)
    for qs in q_segs:
        for ks in _reachable(qs, k_segs, spec) if sorted_apart else k_segs:
            tiles.extend(_plan_pair(qs, ks, spec, sizes))
    return _joined(tiles, sizes.max_rows, across_runs=True) if sizes.join_runs else tiles


def _reachable(qs: Segment, k_segs: list[Segment], spec: MaskSpec) -> list[Segment]:
    """The key runs of `k_segs` (apart, in rising order) that `qs` may attend, by its reach (MaskSpec.reach),
    in two bisections: a document layout's runs, one per document and rank, would otherwise each meet every
    other document's (planning grew with the documents squared)."""
    lo, hi = spec.reach(qs)
    start = bisect.bisect_left(k_segs, lo, key=lambda ks: ks.last) if lo is not None else 0
    stop = bisect.bisect_right(k_segs, hi, key=lambda ks: ks.first) if hi is not None else len(k_segs)
    return k_segs[start:stop]


def _apart_and_rising(segs: list[Segment]) -> bool:
    return all(a.last < b.first for a, b in zip(segs, segs[1:]))


def _plan_pair(
    qs: Segment, ks: Segment, spec: MaskSpec, sizes: TileSizes, by_blocks: bool = True, exact: bool = True
) -> list[Tile]:
    cover = Cover.FULL if spec.is_dense else spec.cover(qs, ks)
    if cover is Cover.SKIP:
        return []
    if qs.length > sizes.max_rows or ks.length > sizes.max_rows:
        return _split_pair(qs, ks, spec, sizes.max_rows, sizes, by_blocks)
    if cover is Cover.SHIFTED:
        # j < i is the causal triangle of queries 1.. against keys ..n-2; query 0 attends nothing here.
        n = qs.length
        return _plan_pair(qs.sub(1, n), ks.sub(0, n - 1), spec, sizes, by_blocks) if n > 1 else []
    if cover is Cover.PARTIAL and sizes.bands and _is_band(qs, ks, spec):
        return [piece for t in _band_tile(qs, ks, spec) for piece in _as_triangles(t, sizes)]
    if cover is Cover.PARTIAL and sizes.rules and not (sizes.bands and _cuts_exactly(qs, ks, spec, sizes)):
        return _rule_tile(qs, ks, spec)
    if cover is Cover.PARTIAL and exact and _cuts_exactly(qs, ks, spec, sizes):
        return _plan_cut(qs, ks, spec, sizes)
    cut = cover is Cover.PARTIAL or (cover is Cover.DIAG and sizes.split_triangles)
    if not cut or (qs.length <= sizes.leaf_rows and ks.length <= sizes.leaf_rows):
        return _checked(Tile(qs, ks, cover, spec))
    if spec.block_sparse is not None and by_blocks:
        return _plan_by_blocks(qs, ks, spec, sizes)
    if qs.length <= TILE and ks.length <= TILE:  # halves, so that whole pieces stay as large as can be
        half = max(sizes.leaf_rows, -(-max(qs.length, ks.length) // 2))
        return _split_pair(qs, ks, spec, half, sizes, by_blocks)
    return _split_pair(qs, ks, spec, min(TILE, sizes.max_rows), sizes, by_blocks)


def _cuts_exactly(qs: Segment, ks: Segment, spec: MaskSpec, sizes: TileSizes) -> bool:
    """Causal and document masks on runs of consecutive positions change only at known positions (the
    other run's ends, the documents' bounds): cut there, every piece is skipped, full or a clean
    triangle, and no tile needs a mask. Windows and block-sparse masks take the sub-tiles. With band
    arguments, a pair across documents is cut at the documents' bounds (windows included)."""
    if spec.block_sparse is not None:
        return False
    if sizes.bands:  # documents' bounds cut runs of any stride; each piece is then one band
        return qs.stride == ks.stride and bool(spec.cu_seqlens)
    return qs.stride == 1 and ks.stride == 1 and not spec.window


def _is_band(qs: Segment, ks: Segment, spec: MaskSpec) -> bool:
    """Causal and window masks on two runs of one stride, inside one document, are a diagonal band."""
    if qs.stride != ks.stride or spec.block_sparse is not None:
        return False
    return spec.in_one_document(qs, ks)


def _band_tile(qs: Segment, ks: Segment, spec: MaskSpec) -> list[Tile]:
    """`qs` x `ks` as one BAND tile (or FULL / DIAG / nothing), trimmed to the rows and keys it attends.

    With query positions a + s*i and key positions c + s*j, causal (key <= query) is j - i <= (a - c) / s
    and a window (left, right) is (a - c - left) / s <= j - i <= (a - c + right) / s: a band lo <= j - i <= hi.
    """
    s, off = qs.stride, qs.first - ks.first
    lo, hi = None, None
    if spec.causal:
        hi = off // s
    if spec.window:
        left, right = spec.window
        if left >= 0:
            lo = -((left - off) // s)  # ceil((off - left) / s)
        if right >= 0:
            hi = (off + right) // s if hi is None else min(hi, (off + right) // s)
    sq, sk = qs.length, ks.length
    q0, q1 = max(0, -hi) if hi is not None else 0, min(sq, sk - lo) if lo is not None else sq
    k0, k1 = max(0, lo) if lo is not None else 0, min(sk, sq + hi) if hi is not None else sk
    if q0 >= q1 or k0 >= k1 or (lo is not None and hi is not None and lo > hi):
        return []
    qt, kt = qs.sub(q0, q1), ks.sub(k0, k1)
    corner = kt.length - qt.length  # where the trimmed tile's bottom-right diagonal lies, in j - i
    shift = q0 - k0  # j - i in the trimmed tile's rows = j - i in the untrimmed ones + shift
    # A bound no row reaches is no bound: left from the last row's view, right from the first row's.
    left = -1 if lo is None or corner - (lo + shift) >= kt.length - 1 else corner - (lo + shift)
    right = -1 if hi is None or (hi + shift) - corner >= qt.length - 1 else (hi + shift) - corner
    if left == -1 and right == -1:
        return [Tile(qt, kt, Cover.FULL, spec)]
    if left == -1 and right == 0 and corner == 0:
        return [Tile(qt, kt, Cover.DIAG, spec)]
    return [Tile(qt, kt, Cover.BAND, spec, Bands((0, qt.length), (0, kt.length), left, right))]


def _as_triangles(tile: Tile, sizes: TileSizes) -> list[Tile]:
    """A one-sequence causal window band of a square tile, `left` wide, as triangles for a kernel whose
    causal path beats its band arguments (sizes.triangle_rows): with rows and keys cut in blocks of
    `left`, query a of block b sees keys 0..a of block b (a DIAG tile) and keys a.. of block b - 1 (a
    reversed triangle: key - query = t - a - left >= -left). Only where `left` divides the tile and
    is at least sizes.triangle_rows (smaller calls lose more than the band costs); else the band."""
    bands, n = tile.bands, tile.q.length
    if (
        tile.cover is not Cover.BAND
        or not sizes.triangle_rows
        or bands.sequences != 1
        or tile.k.length != n
        or bands.right != 0
        or bands.left < sizes.triangle_rows
        or n % bands.left
    ):
        return [tile]
    w, mirrored = bands.left, Bands((0, bands.left), (0, bands.left), 0, -1)
    pieces = []
    for b in range(n // w):
        q = tile.q.sub(b * w, (b + 1) * w)
        if b:
            pieces.append(Tile(q, tile.k.sub((b - 1) * w, b * w), Cover.BAND, tile.spec, mirrored))
        pieces.append(Tile(q, tile.k.sub(b * w, (b + 1) * w), Cover.DIAG, tile.spec))
    return pieces


RULE_CHECK = 1 << 20  # pairs: a rule tile up to this size is evaluated once when planned


def _rule_tile(qs: Segment, ks: Segment, spec: MaskSpec) -> list[Tile]:
    """`qs` x `ks` whole, as its rule (the kernel skips the blocks the rule leaves out). Bounds are
    conservative for strided runs: a tile small enough is evaluated here, and one that attends nothing
    is not planned (a large one would cost a dense mask to check; its kernel skips it block by block)."""
    if qs.length * ks.length <= RULE_CHECK and not bool(spec.allowed(qs.positions(), ks.positions()).any()):
        return []
    return [Tile(qs, ks, Cover.RULE, spec)]


def _window(tile: Tile) -> tuple[int, int]:
    """A planned tile's mask as flash_attn's bottom-right window (FULL, DIAG or a one-sequence BAND)."""
    if tile.cover is Cover.BAND:
        return tile.bands.left, tile.bands.right
    return (-1, 0) if tile.cover is Cover.DIAG else (-1, -1)


def _as_varlen(pieces: list[Tile]) -> list[Tile]:
    """Pieces of one pair cut at documents' bounds, as few calls as can be: each run of pieces that
    follow each other in both query and key rows and share one window becomes one varlen BAND tile."""
    out: list[list[Tile]] = []
    for t in pieces:
        prev = out[-1][-1] if out else None
        if (
            prev is not None
            and _window(prev) == _window(t)
            and prev.q.rows.stop == t.q.local_start
            and prev.k.rows.stop == t.k.local_start
        ):
            out[-1].append(t)
        else:
            out.append([t])
    return [run[0] if len(run) == 1 else _varlen_tile(run) for run in out]


def _triangles_alone(pieces: list[Tile], sizes: TileSizes) -> bool:
    """Documents' pieces run as they are, not as one varlen call, for a kernel whose causal path beats
    its varlen one (sizes.triangle_rows) when every piece is full, a triangle or a mirrored one, and
    none smaller than triangle_rows (many small calls cost more than one varlen call)."""
    return bool(sizes.triangle_rows) and all(
        min(t.q.length, t.k.length) >= sizes.triangle_rows
        and (t.cover in (Cover.FULL, Cover.DIAG) or (t.cover is Cover.BAND and t.bands.is_reversed_triangle))
        for t in pieces
    )


def _varlen_tile(run: list[Tile]) -> Tile:
    q = Segment(run[0].q.local_start, sum(t.q.length for t in run), run[0].q.first, run[0].q.stride)
    k = Segment(run[0].k.local_start, sum(t.k.length for t in run), run[0].k.first, run[0].k.stride)
    cu_q, cu_k = [0], [0]
    for t in run:
        cu_q.append(cu_q[-1] + t.q.length)
        cu_k.append(cu_k[-1] + t.k.length)
    # The run's segments span several documents: their positions are not one mask's; the bands say it.
    return Tile(q, k, Cover.BAND, run[0].spec, Bands(tuple(cu_q), tuple(cu_k), *_window(run[0])))


def _plan_cut(qs: Segment, ks: Segment, spec: MaskSpec, sizes: TileSizes) -> list[Tile]:
    """`qs` x `ks` cut where the mask changes. With query positions [a, b] and key positions [c, d],
    causal: queries cut at c and d + 1, keys at a and b + 1, so each piece of keys lies before, on or
    after each piece of queries (full, the same positions: a triangle, or skipped); documents: both
    cut at the documents' bounds, so a piece pair lies in one document (or in two: skipped)."""
    q_cuts, k_cuts = set(), set()
    if spec.causal and not sizes.bands:  # with band arguments a piece in one document is one band
        q_cuts |= {ks.first, ks.last + 1}
        k_cuts |= {qs.first, qs.last + 1}
    if spec.cu_seqlens:
        q_cuts |= set(spec.cu_seqlens)
        k_cuts |= set(spec.cu_seqlens)
    q_parts, k_parts = _cut(qs, q_cuts), _cut(ks, k_cuts)
    if len(q_parts) == 1 and len(k_parts) == 1:  # nothing to cut at: the sub-tiles decide
        return _plan_pair(qs, ks, spec, sizes, exact=False)
    if sizes.bands:
        pieces = [t for qp in q_parts for kp in k_parts for t in _plan_pair(qp, kp, spec, sizes)]
        return pieces if _triangles_alone(pieces, sizes) else _as_varlen(pieces)
    tiles = []
    for qp in q_parts:
        row = []
        for kp in k_parts:
            row.extend(_plan_pair(qp, kp, spec, sizes))
        tiles.extend(_coalesce_full(row, sizes.max_rows))
    return tiles


def _cut(seg: Segment, positions: set[int]) -> list[Segment]:
    """A run of positions cut before each of `positions` that falls strictly inside it (before the
    first of its positions at or past it, for a run of stride > 1)."""
    inside = sorted({-(-(p - seg.first) // seg.stride) for p in positions if seg.first < p <= seg.last})
    bounds = [0, *inside, seg.length]
    return [seg.sub(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _split_pair(qs: Segment, ks: Segment, spec: MaskSpec, size: int, sizes: TileSizes, by_blocks: bool) -> list[Tile]:
    """Plan `qs` x `ks` as sub-pairs of at most `size` rows each way."""
    tiles = []
    for qi in range(0, qs.length, size):
        qt = qs.sub(qi, min(qi + size, qs.length))
        row = []
        for ki in range(0, ks.length, size):
            kt = ks.sub(ki, min(ki + size, ks.length))
            row.extend(_plan_pair(qt, kt, spec, sizes, by_blocks))
        tiles.extend(_coalesce_full(row, sizes.max_rows))
    return tiles


def _plan_by_blocks(qs: Segment, ks: Segment, spec: MaskSpec, sizes: TileSizes) -> list[Tile]:
    """Tiles along the block-sparse grid: one tile per attended (query block, key block) pair.

    Cut at block boundaries, every tile lies inside one block pair, so the block layout alone says
    skip or keep; the other masks then plan within it. With the striped layout and a block size
    that is a multiple of the ranks, each rank holds block_size / G rows of every block: the
    balance of burstengine.md Fig. 11.
    """
    bs, layout = spec.block_sparse.block_size, spec.block_sparse.layout
    q_parts, k_parts = _block_parts(qs, bs), _block_parts(ks, bs)
    attended = layout[[b for _, b in q_parts]][:, [b for _, b in k_parts]]
    tiles = []
    for i, (q_sub, _) in enumerate(q_parts):
        row = []
        for j in attended[i].nonzero().flatten().tolist():
            row.extend(_plan_pair(q_sub, k_parts[j][0], spec, sizes, by_blocks=False))
        tiles.extend(_coalesce_full(row, sizes.max_rows))
    return tiles


def _block_parts(seg: Segment, block_size: int) -> list[tuple[Segment, int]]:
    """`seg` cut into runs that each lie inside one block of the global sequence, with the block."""
    parts, row = [], 0
    while row < seg.length:
        block = (seg.first + seg.stride * row) // block_size
        # First row whose position reaches the next block.
        end = min(seg.length, -(-((block + 1) * block_size - seg.first) // seg.stride))
        parts.append((seg.sub(row, end), block))
        row = end
    return parts


def _checked(tile: Tile) -> list[Tile]:
    """Bounds are conservative: a partial tile whose mask is all-False is dropped, all-True runs full."""
    if tile.cover is Cover.PARTIAL:
        if not bool(tile.mask.any()):
            return []
        if bool(tile.mask.all()):
            return [Tile(tile.q, tile.k, Cover.FULL, tile.spec)]
    return [tile]


def _coalesce_full(row: list[Tile], max_rows: int) -> list[Tile]:
    """Merge runs of FULL tiles that are adjacent along the keys, and whose keys continue one run of
    positions, into one kernel call."""
    return _joined(row, max_rows, across_runs=False)


def _joined(tiles: list[Tile], max_rows: int, across_runs: bool) -> list[Tile]:
    """Consecutive FULL tiles next to each other in local rows joined into one call of at most max_rows
    each way: the same queries and the next keys; with across_runs also the same keys and the next
    queries, and runs of positions that do not continue each other (the joined side is then Rows).
    A joined tile may join its predecessor in turn (a zigzag shard's four quarter tiles make one)."""
    out: list[Tile] = []
    for t in tiles:
        out.append(t)
        while len(out) > 1 and (joined := _join(out[-2], out[-1], max_rows, across_runs)) is not None:
            out[-2:] = [joined]
    return out


def _join(a: Tile, b: Tile, max_rows: int, across_runs: bool) -> Tile | None:
    """a and b as one FULL tile (b after a in local rows), or None."""
    if a.cover is not Cover.FULL or b.cover is not Cover.FULL:
        return None
    if _same_rows(a.q, b.q) and _next_rows(a.k, b.k, max_rows, across_runs):
        return Tile(a.q, _union(a.k, b.k), Cover.FULL, b.spec)
    if across_runs and _same_rows(a.k, b.k) and _next_rows(a.q, b.q, max_rows, True):
        return Tile(_union(a.q, b.q), a.k, Cover.FULL, b.spec)
    return None


def _same_rows(a, b) -> bool:
    return a.local_start == b.local_start and a.length == b.length


def _next_rows(a, b, max_rows: int, across_runs: bool) -> bool:
    """b's local rows follow a's, together at most max_rows (and b's positions continue a's run unless
    across_runs)."""
    return (
        a.local_start + a.length == b.local_start
        and a.length + b.length <= max_rows
        and (across_runs or _continues(a, b))
    )


def _continues(a, b) -> bool:
    return isinstance(a, Segment) and isinstance(b, Segment) and a.stride == b.stride and a.last + a.stride == b.first


def _union(a, b) -> Segment | Rows:
    """The local rows of a and then b: one Segment when b's positions continue a's, else Rows."""
    if _continues(a, b):
        return Segment(a.local_start, a.length + b.length, a.first, a.stride)
    return Rows(a.local_start, a.length + b.length)
