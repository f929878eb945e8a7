"""Masks as data: which (query, key) pairs of the global sequence attend, and how a mask covers a pair
of position runs (query segment, key segment), from the runs' bounds alone.

Mask kinds (combined with AND):
- causal: key position <= query position.
- window (left, right): query i sees keys i-left .. i+right; -1 = unbounded (flash_attn convention).
- documents (cu_seqlens): packed sequences; a query sees keys of its own document only.
- block-sparse (BlockSparseMask): a bool matrix over fixed-size blocks of the global sequence.

`MaskSpec.attends` is the one statement of what each kind allows; `MaskSpec.cover` says, per pair of
runs, skip, full, a clean causal triangle or partial. The planner (planner.py) turns those answers
into kernel calls; nothing here knows about tiles or kernels.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch

from ..layout import Segment


class Cover(enum.Enum):
    """How a mask covers a tile: nothing, everything, a clean causal triangle, or some of it.

    MaskSpec.cover answers SKIP to PARTIAL; BAND and RULE are the planner's, for a partial tile it
    passes to the kernel as band arguments or as its rule."""

    SKIP = 0
    FULL = 1
    DIAG = 2  # top-left lower triangle (j <= i)
    SHIFTED = 3  # strict lower triangle (j < i): striped layout, key rank > query rank
    PARTIAL = 4
    BAND = 5  # a diagonal band per sequence, passed to the kernel as arguments (Tile.bands)
    RULE = 6  # a partial tile passed whole as its rule (PositionRule) to a kernel that skips blocks itself


UNBOUNDED = 1 << 40  # a window side without a bound: beyond any distance between two positions


def window_bounds(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """(left, right) for `attends_within`: a window's sides (-1, unbounded, as UNBOUNDED), the right one
    at most 0 when causal."""
    left, right = (UNBOUNDED if side < 0 else side for side in (window or (-1, -1)))
    return left, min(right, 0) if causal else right


def attends_within(q, k, left, right, q_doc=None, k_doc=None, blocks=None) -> torch.Tensor:
    """Elementwise, broadcasting: does query position q see key position k. Keys q - left .. q + right
    (`window_bounds`), of q's own document (q_doc, k_doc), in a block pair the layout allows (blocks:
    (layout, block size)). The one statement of what every mask kind allows: MaskSpec, Bands and
    FlexAttention's mask_mod (kernels/flex.py, where the bounds are per-row tensors) all call it."""
    ok = (k >= q - left) & (k <= q + right)
    if q_doc is not None:
        ok = ok & (q_doc == k_doc)
    if blocks is not None:
        layout, size = blocks
        ok = ok & layout[q // size, k // size]
    return ok


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
class BlockSparseMask:
    """Block-sparse attention over the global sequence.

    block_size: tokens per block. layout: bool (nblocks, nblocks), True where query block i may
    attend key block j; nblocks = ceil(seqlen / block_size). Combined with causal / window / documents
    when those are given too. Block pairs that are False are never computed. The mask keeps its own copy of
    `layout` (plans are cached by its digest): editing your tensor afterwards changes nothing; build a new
    mask for a new layout.
    """

    block_size: int
    layout: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.layout, torch.Tensor) or self.layout.dim() != 2 or self.layout.dtype != torch.bool:
            raise ValueError("layout must be a 2-D bool tensor (query blocks, key blocks)")
        object.__setattr__(self, "layout", self.layout.detach().to("cpu", copy=True))  # the caller's may change

    @cached_property
    def host_layout(self):
        """The layout as a numpy view (the same memory): the planner reads a block pair's corner of it for every
        pair of runs it looks at, where numpy's slicing costs a tenth of torch's."""
        return self.layout.numpy()

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
        documents (`documents`), when the spec has any (`attends_within` says what each kind allows)."""
        sparse = self.block_sparse
        blocks = (sparse.layout.to(q.device), sparse.block_size) if sparse else None
        docs = (q_doc, k_doc) if self.cu_seqlens else (None, None)
        return attends_within(q, k, *window_bounds(self.causal, self.window), *docs, blocks)

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

    def reach(self, qs: Segment) -> tuple[int | None, int | None]:
        """(lowest, highest) key position any query of `qs` may attend (None: unbounded): the documents it
        touches, the causal bound, the window. A superset of what attends: cover() still decides."""
        lo = hi = None
        if self.cu_seqlens:
            bounds = self.cu_seqlens
            lo = bounds[bisect.bisect_right(bounds, qs.first) - 1]
            hi = bounds[min(bisect.bisect_right(bounds, qs.last), len(bounds) - 1)] - 1
        if self.causal:
            hi = qs.last if hi is None else min(hi, qs.last)
        if self.window:
            left, right = self.window
            if left >= 0:
                lo = qs.first - left if lo is None else max(lo, qs.first - left)
            if right >= 0:
                hi = qs.last + right if hi is None else min(hi, qs.last + right)
        return lo, hi

    def in_one_document(self, qs: Segment, ks: Segment) -> bool:
        """True when every position of `qs` and `ks` lies in one document (always, without documents)."""
        return not self.cu_seqlens or _document_cover(qs, ks, self.cu_seqlens) is Cover.FULL


def may_attend(q_segs: list[Segment], k_segs: list[Segment], spec: MaskSpec) -> bool:
    """False only when no query of `q_segs` attends any key of `k_segs` (cheap, from bounds)."""
    if spec.is_dense:
        return True
    return any(spec.cover(qs, ks) is not Cover.SKIP for qs in q_segs for ks in k_segs)


def _causal_cover(qs: Segment, ks: Segment) -> Cover:
    if ks.first > qs.last:
        return Cover.SKIP
    if ks.last <= qs.first:
        return Cover.FULL
    if qs.stride == ks.stride and qs.length == ks.length:
        offset = qs.first - ks.first
        if 0 <= offset < qs.stride:
            return Cover.DIAG  # same positions, or striped with key rank <= query rank: j <= i
        if -qs.stride < offset < 0:
            return Cover.SHIFTED  # striped, key rank > query rank (burstengine.md eq. 14): j < i
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


def _blocks_of(seg: Segment, block_size: int):
    """The blocks `seg`'s positions fall in: a slice of consecutive blocks when its stride is no larger than a
    block (it skips none), else one block per position (all distinct, rising). Planning a strided layout's
    pairs asked torch.unique of every position of each sub-pair: planning grew with the shard squared."""
    if seg.stride <= block_size:
        return slice(seg.first // block_size, seg.last // block_size + 1)
    return seg.positions().numpy() // block_size


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
    sub = mask.host_layout[_blocks_of(qs, bs)][:, _blocks_of(ks, bs)]
    if not bool(sub.any()):
        return Cover.SKIP
    if bool(sub.all()):
        return Cover.FULL
    return Cover.PARTIAL
