"""What the planner hands a kernel: `Tile` (one kernel call: query rows against key rows, and how the
mask covers them) and `TileSizes` (how a kernel wants its calls sized and its masks passed).

Kernels read tiles (kernels/attend.py); the planner (planner.py) makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..layout import Rows, Segment
from .bands import Bands
from .rules import Cover, MaskSpec, PositionRule

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
    triangle_rows: with bands, a band that is causal triangles of at least this many rows each runs as
    those triangles instead (0: never): a document's diagonal piece as a DIAG tile, a causal window
    as DIAG tiles and reversed triangles (Bands.is_reversed_triangle), for a kernel whose causal
    path is faster than its band arguments (cuDNN's, beside FlashAttention-2's window and varlen).
    join_runs: full tiles next to each other in a shard's local rows (the same queries and the next keys,
    or the same keys and the next queries) run as one call up to max_rows, also across runs of
    positions that do not continue each other (a zigzag shard's two halves, whose joined side is
    `Rows`): fewer, larger calls and one merge where there were two. Only for calls with no index
    selection, which reads a tile's positions (AttentionCall.plan sets it).
    """

    max_rows: int = MAX_TILE
    leaf_rows: int = SUB_TILE
    split_triangles: bool = False
    bands: bool = False
    rules: bool = False
    triangle_rows: int = 0
    join_runs: bool = False

    @classmethod
    def for_kernel(cls, kernel, max_rows: int | None = None, join_runs: bool = False) -> "TileSizes":
        """How `kernel` (a burst.kernels backend module) wants its calls: its MAX_ROWS (or fewer), its
        leaves, and whether it takes bands and rules; join_runs as the field says."""
        cap = kernel.MAX_ROWS if max_rows is None else min(max_rows, kernel.MAX_ROWS)
        return cls(
            cap,
            getattr(kernel, "LEAF_ROWS", SUB_TILE),
            getattr(kernel, "SPLITS_TRIANGLES", False),
            getattr(kernel, "BANDS", False),
            getattr(kernel, "RULES", False),
            getattr(kernel, "TRIANGLE_ROWS", 0),
            join_runs,
        )


@dataclass(frozen=True, eq=False)
class Tile:
    """One kernel call: query rows `q.rows` against key rows `k.rows` of the two shards (a side is Rows
    only in a FULL tile joined across runs)."""

    q: Segment | Rows
    k: Segment | Rows
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
