"""Masks as data: for a pair of position runs (query segment, key segment) decide skip, full, causal
or partial, and plan the kernel calls ("tiles") that compute it.

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

Mask kinds (combined with AND):
- causal: key position <= query position.
- window (left, right): query i sees keys i-left .. i+right; -1 = unbounded (flash_attn convention).
- documents (cu_seqlens): packed sequences; a query sees keys of its own document only.
- block-sparse (BlockSparseMask): a bool matrix over fixed-size blocks of the global sequence.
"""

from __future__ import annotations

import bisect
import hashlib
import enum
from dataclasses import dataclass
from functools import cached_property

import torch

from .layout import Segment

TILE = 512  # rows per tile when a block pair is partial: small enough to skip, big enough to run fast
SUB_TILE = 128  # a partial tile is halved each way until its pieces have at most this many rows: only
# those on a mask's edge carry a mask, the rest run full (coalesced along the keys) or causal, or are
# skipped (a kernel may ask for smaller leaves, kernels.*.LEAF_ROWS)
MAX_TILE = 4096  # default cap on rows per kernel call (each backend sets its own, kernels.*.MAX_ROWS)


@dataclass(frozen=True)
class TileSizes:
    """How a kernel wants its calls sized.

    max_rows: query or key rows per call at most (bounds each call's fresh outputs).
    leaf_rows: a partial tile is halved until its pieces have at most this many rows each way.
    split_triangles: halve causal triangles too (the square between the halves runs full), for a
    kernel whose causal path pays for much of the masked half.
    bands: the kernel takes causal, window and document masks as Bands (flash_attn's window, varlen).
    rules: the kernel takes any other partial tile whole, as a PositionRule (FlexAttention).
    """

    max_rows: int = MAX_TILE
    leaf_rows: int = SUB_TILE
    split_triangles: bool = False
    bands: bool = False
    rules: bool = False

    @classmethod
    def for_kernel(cls, kernel, max_rows: int | None = None) -> "TileSizes":
        """How `kernel` (a burst.kernels backend module) wants its calls: its MAX_ROWS (or fewer), its
        leaves, and whether it takes bands and rules."""
        cap = kernel.MAX_ROWS if max_rows is None else min(max_rows, kernel.MAX_ROWS)
        return cls(cap, getattr(kernel, "LEAF_ROWS", SUB_TILE), getattr(kernel, "SPLITS_TRIANGLES", False),
                   getattr(kernel, "BANDS", False), getattr(kernel, "RULES", False))


class Cover(enum.Enum):
    """How a mask covers a tile: nothing, everything, a clean causal triangle, or some of it."""

    SKIP = 0
    FULL = 1
    DIAG = 2      # top-left lower triangle (j <= i)
    SHIFTED = 3   # strict lower triangle (j < i): striped layout, key rank > query rank
    PARTIAL = 4
    BAND = 5      # a diagonal band per sequence, passed to the kernel as arguments (Tile.bands)
    RULE = 6      # a partial tile passed whole as its rule (PositionRule) to a kernel that skips blocks itself


@dataclass(frozen=True, eq=False)
class PositionRule:
    """A tile's mask as a rule over its global positions, for a kernel that evaluates it per block
    (FlexAttention's mask_mod and BlockMask): query row i holds position q.first + q.stride * i, key row
    j position k.first + k.stride * j, and `spec` says which pairs attend. No dense mask is built."""

    q: Segment
    k: Segment
    spec: "MaskSpec"

    def allowed(self, device=None) -> torch.Tensor:
        """Dense bool (q.length, k.length), True = attend: for kernels that take no rule."""
        return self.spec.allowed(self.q.positions(device), self.k.positions(device))


@dataclass(frozen=True)
class Bands:
    """A tile's mask as kernel arguments: sequences of queries against keys, each a diagonal band.

    Sequence n is query rows cu_q[n]:cu_q[n+1] against key rows cu_k[n]:cu_k[n+1] of the tile; no
    query sees a key of another sequence. Within a sequence of sq queries and sk keys, query i sees
    keys i + (sk - sq) - left .. i + (sk - sq) + right: flash_attn's window_size, aligned at the
    bottom-right corner, -1 = unbounded. One sequence runs on flash_attn's plain interface, several
    on its varlen one. The planner trims every sequence to the rows and keys it attends, so no row is
    empty and the window always holds the corner's diagonal (left, right >= 0 or -1).
    """

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    left: int
    right: int

    def __post_init__(self):
        if len(self.cu_q) != len(self.cu_k) or len(self.cu_q) < 2 or self.cu_q[0] != 0 or self.cu_k[0] != 0:
            raise ValueError(f"cu_q and cu_k must both run from 0, one bound per sequence: {self}")
        if min(self.left, self.right) < -1:
            raise ValueError(f"window bounds must be >= 0 or -1 (unbounded): {self}")

    @property
    def sequences(self) -> int:
        return len(self.cu_q) - 1

    @property
    def max_rows(self) -> tuple[int, int]:
        """The longest sequence's queries and keys (flash_attn's max_seqlen_q, max_seqlen_k)."""
        return (max(b - a for a, b in zip(self.cu_q, self.cu_q[1:])),
                max(b - a for a, b in zip(self.cu_k, self.cu_k[1:])))

    def pairs(self) -> int:
        """(query, key) pairs the bands attend (work accounting, without building the mask)."""
        total = 0
        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]):
            sq, sk = q1 - q0, k1 - k0
            i = torch.arange(sq) + (sk - sq)  # each row's diagonal key
            first = (i - self.left).clamp(min=0) if self.left >= 0 else torch.zeros_like(i)
            last = (i + self.right).clamp(max=sk - 1) if self.right >= 0 else torch.full_like(i, sk - 1)
            total += int((last - first + 1).clamp(min=0).sum())
        return total

    def allowed(self, device=None) -> torch.Tensor:
        """Dense bool (cu_q[-1], cu_k[-1]), True = attend: for kernels that take no band arguments."""
        rows = self.rows(device)
        q, k = torch.arange(self.cu_q[-1], device=device), torch.arange(self.cu_k[-1], device=device)
        return self.attends(q[:, None], k[None, :], rows)

    def rows(self, device=None) -> tuple[torch.Tensor, ...]:
        """Per-row lookups for `attends`: each query row's sequence and offset in it, each key row's,
        and each sequence's corner (keys minus queries)."""
        cu_q, cu_k = (torch.tensor(cu, device=device) for cu in (self.cu_q, self.cu_k))
        q_seq = torch.bucketize(torch.arange(self.cu_q[-1], device=device), cu_q, right=True) - 1
        k_seq = torch.bucketize(torch.arange(self.cu_k[-1], device=device), cu_k, right=True) - 1
        q_off = torch.arange(self.cu_q[-1], device=device) - cu_q[q_seq]
        k_off = torch.arange(self.cu_k[-1], device=device) - cu_k[k_seq]
        return q_seq, q_off, k_seq, k_off, (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])

    def attends(self, q_row: torch.Tensor, k_row: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Elementwise, broadcasting: does query row q_row see key row k_row (rows: `rows()`). The dense
        mask (`allowed`) and FlexAttention's mask_mod (kernels/flex.py) both use it."""
        q_seq, q_off, k_seq, k_off, corner = rows
        ok = q_seq[q_row] == k_seq[k_row]
        d = k_off[k_row] - q_off[q_row] - corner[q_seq[q_row]]  # 0 on the sequence's bottom-right diagonal
        if self.left >= 0:
            ok = ok & (d >= -self.left)
        if self.right >= 0:
            ok = ok & (d <= self.right)
        return ok


@dataclass(frozen=True)
class BlockSparseMask:
    """Block-sparse attention over the global sequence.

    block_size: tokens per block. layout: bool (nblocks, nblocks), True where query block i may
    attend key block j; nblocks = ceil(seqlen / block_size). Combined with causal / window / documents
    when those are given too. Block pairs that are False are never computed.
    """

    block_size: int
    layout: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.layout, torch.Tensor) or self.layout.dim() != 2 or self.layout.dtype != torch.bool:
            raise ValueError("layout must be a 2-D bool tensor (query blocks, key blocks)")
        object.__setattr__(self, "layout", self.layout.cpu())

    @cached_property
    def fingerprint(self) -> str:
        """A digest of block size and layout, equal on every rank that holds an equal mask."""
        raw = self.layout.contiguous().numpy().tobytes()
        return f"{self.block_size}:{tuple(self.layout.shape)}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """Which (query, key) pairs of the global sequence attend (all given kinds must allow it)."""

    causal: bool = False
    window: tuple[int, int] | None = None
    cu_seqlens: tuple[int, ...] | None = None
    block_sparse: BlockSparseMask | None = None

    @cached_property
    def key(self) -> tuple:
        """Equal for two specs that allow the same pairs (a hashable stand-in for the spec)."""
        sparse = self.block_sparse.fingerprint if self.block_sparse is not None else None
        return (self.causal, self.window, self.cu_seqlens, sparse)

    @property
    def is_dense(self) -> bool:
        """True when every pair attends (no mask at all)."""
        return not (self.causal or self.window or self.cu_seqlens or self.block_sparse)

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool (len(q_pos), len(k_pos)): True where query q_pos[i] attends key k_pos[j]."""
        return self.attends(q_pos[:, None], k_pos[None, :], *self.documents(q_pos[:, None], k_pos[None, :]))

    def documents(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """(the document of each query position, of each key position), or (None, None) without documents."""
        if not self.cu_seqlens:
            return None, None
        bounds = torch.tensor(self.cu_seqlens, device=q_pos.device)
        return torch.bucketize(q_pos, bounds, right=True), torch.bucketize(k_pos, bounds, right=True)

    def attends(self, q: torch.Tensor, k: torch.Tensor, q_doc=None, k_doc=None) -> torch.Tensor:
        """Elementwise, broadcasting: does query position q attend key position k. q_doc / k_doc: their
        documents (`documents`), when the spec has any. The one statement of what each mask kind
        allows: the dense masks (`allowed`) and FlexAttention's mask_mod (kernels/flex.py) both use it."""
        ok = (q >= 0) & (k >= 0)  # all True, in the broadcast shape
        if self.causal:
            ok = ok & (k <= q)
        if self.window:
            left, right = self.window
            if left >= 0:
                ok = ok & (k >= q - left)
            if right >= 0:
                ok = ok & (k <= q + right)
        if self.cu_seqlens:
            ok = ok & (q_doc == k_doc)
        if self.block_sparse:
            bs, layout = self.block_sparse.block_size, self.block_sparse.layout.to(q.device)
            ok = ok & layout[q // bs, k // bs]
        return ok

    def cover(self, qs: Segment, ks: Segment) -> Cover:
        """How the mask covers queries `qs` x keys `ks`, from the segments' bounds alone."""
        kinds = [_causal_cover(qs, ks)] if self.causal else []
        if self.window:
            kinds.append(_window_cover(qs, ks, *self.window))
        if self.cu_seqlens:
            kinds.append(_document_cover(qs, ks, self.cu_seqlens))
        if self.block_sparse:
            kinds.append(_block_cover(qs, ks, self.block_sparse))
        if Cover.SKIP in kinds:
            return Cover.SKIP
        rest = [c for c in kinds if c is not Cover.FULL]
        if not rest:
            return Cover.FULL
        if len(set(rest)) == 1 and rest[0] in (Cover.DIAG, Cover.SHIFTED):
            return rest[0]
        return Cover.PARTIAL


def _causal_cover(qs: Segment, ks: Segment) -> Cover:
    if ks.first > qs.last:
        return Cover.SKIP
    if ks.last <= qs.first:
        return Cover.FULL
    if qs.stride == ks.stride and qs.length == ks.length:
        offset = qs.first - ks.first
        if 0 <= offset < qs.stride:
            return Cover.DIAG      # same positions, or striped with key rank <= query rank: j <= i
        if -qs.stride < offset < 0:
            return Cover.SHIFTED   # striped, key rank > query rank (burstengine.md eq. 14): j < i
    return Cover.PARTIAL


def _window_cover(qs: Segment, ks: Segment, left: int, right: int) -> Cover:
    if (left >= 0 and ks.last < qs.first - left) or (right >= 0 and ks.first > qs.last + right):
        return Cover.SKIP
    left_whole = left < 0 or ks.first >= qs.last - left
    if left_whole and (right < 0 or ks.last <= qs.first + right):
        return Cover.FULL
    if left_whole and right == 0:  # the right bound is the causal one (key <= query)
        return _causal_cover(qs, ks)
    return Cover.PARTIAL


def _document_cover(qs: Segment, ks: Segment, cu_seqlens: tuple[int, ...]) -> Cover:
    def doc(pos):
        return bisect.bisect_right(cu_seqlens, pos)

    q0, q1, k0, k1 = doc(qs.first), doc(qs.last), doc(ks.first), doc(ks.last)
    if q1 < k0 or k1 < q0:
        return Cover.SKIP
    if q0 == q1 == k0 == k1:
        return Cover.FULL
    return Cover.PARTIAL


def _block_cover(qs: Segment, ks: Segment, mask: BlockSparseMask) -> Cover:
    bs = mask.block_size
    if qs.stride == 1 and ks.stride == 1:
        sub = mask.layout[qs.first // bs: qs.last // bs + 1, ks.first // bs: ks.last // bs + 1]
    else:  # strided runs touch scattered blocks: look at exactly those
        qb = torch.unique(qs.positions() // bs)
        kb = torch.unique(ks.positions() // bs)
        sub = mask.layout[qb[:, None], kb[None, :]]
    if not bool(sub.any()):
        return Cover.SKIP
    if bool(sub.all()):
        return Cover.FULL
    return Cover.PARTIAL


@dataclass(frozen=True, eq=False)
class Tile:
    """One kernel call: query rows `q.rows` against key rows `k.rows` of the two shards."""

    q: Segment
    k: Segment
    cover: Cover
    spec: MaskSpec
    bands: Bands | None = None  # the mask as kernel arguments, for a BAND tile

    @property
    def causal(self) -> bool:
        """Run the kernel's top-left causal path on this tile."""
        return self.cover is Cover.DIAG

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """Dense bool (len q, len k) for a partial or band tile, else None (built on first use)."""
        if self.cover is Cover.BAND:
            return self.bands.allowed()
        if self.cover not in (Cover.PARTIAL, Cover.RULE):
            return None
        return self.spec.allowed(self.q.positions(), self.k.positions())

    @property
    def kernel_mask(self) -> torch.Tensor | Bands | PositionRule | None:
        """What the kernel gets as `mask`: the band arguments of a BAND tile, the rule of a RULE tile,
        else the dense mask."""
        if self.cover is Cover.BAND:
            return self.bands
        if self.cover is Cover.RULE:
            return self.rule
        return self.mask

    @cached_property
    def rule(self) -> PositionRule:
        """This tile's mask as a rule over its positions (one object per tile: kernels cache by it)."""
        return PositionRule(self.q, self.k, self.spec)

    @property
    def pairs(self) -> int:
        """(query, key) pairs of this tile that attend (work accounting)."""
        n, m = self.q.length, self.k.length
        if self.cover is Cover.FULL:
            return n * m
        if self.cover is Cover.DIAG:  # planned only for n == m
            return n * (n + 1) // 2
        if self.cover is Cover.BAND:
            return self.bands.pairs()
        return int(self.mask.sum())


def plan_tiles(q_segs: list[Segment], k_segs: list[Segment], spec: MaskSpec,
               sizes: TileSizes = TileSizes()) -> list[Tile]:
    """The kernel calls that compute queries `q_segs` against keys `k_segs` under `spec`.

    No call has more than `sizes.max_rows` query or key rows: kernels return fresh outputs and
    gradients per call, so the cap bounds those temporaries (a tile's dq, dk, dv instead of a whole
    shard's). `sizes` also sets the leaves of partial tiles and triangles.
    """
    tiles: list[Tile] = []
    for qs in q_segs:
        for ks in k_segs:
            tiles.extend(_plan_pair(qs, ks, spec, sizes))
    return tiles


def may_attend(q_segs: list[Segment], k_segs: list[Segment], spec: MaskSpec) -> bool:
    """False only when no query of `q_segs` attends any key of `k_segs` (cheap, from bounds)."""
    if spec.is_dense:
        return True
    return any(spec.cover(qs, ks) is not Cover.SKIP for qs in q_segs for ks in k_segs)


def _plan_pair(qs: Segment, ks: Segment, spec: MaskSpec, sizes: TileSizes, by_blocks: bool = True,
               exact: bool = True) -> list[Tile]:
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
        return _band_tile(qs, ks, spec)
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
    return not spec.cu_seqlens or _document_cover(qs, ks, spec.cu_seqlens) is Cover.FULL


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
        if (prev is not None and _window(prev) == _window(t) and prev.q.rows.stop == t.q.local_start
                and prev.k.rows.stop == t.k.local_start):
            out[-1].append(t)
        else:
            out.append([t])
    return [run[0] if len(run) == 1 else _varlen_tile(run) for run in out]


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
        return _as_varlen([t for qp in q_parts for kp in k_parts for t in _plan_pair(qp, kp, spec, sizes)])
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
    """Merge runs of FULL tiles that are adjacent along the keys into one kernel call."""
    out: list[Tile] = []
    for t in row:
        prev = out[-1] if out else None
        if (prev is not None and prev.cover is Cover.FULL and t.cover is Cover.FULL and prev.q == t.q
                and prev.k.length + t.k.length <= max_rows
                and prev.k.local_start + prev.k.length == t.k.local_start
                and prev.k.stride == t.k.stride and prev.k.last + prev.k.stride == t.k.first):
            k = Segment(prev.k.local_start, prev.k.length + t.k.length, prev.k.first, prev.k.stride)
            out[-1] = Tile(prev.q, k, Cover.FULL, t.spec)
        else:
            out.append(t)
    return out
