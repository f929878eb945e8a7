"""Masks as data: for a pair of position runs (query segment, key segment) decide skip, full, causal
or partial, and plan the kernel calls ("tiles") that compute it.

Strategies never look at a mask themselves: they ask `plan_tiles` for the tiles of a block pair and
hand them to the kernel. A block pair with no attended entry yields no tile (no compute); a pair
that is a clean lower triangle uses the kernel's causal path (which skips the upper half); only
truly partial tiles carry a dense boolean mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Segment


@dataclass(frozen=True)
class MaskSpec:
    """Which (query, key) pairs of the global sequence attend. causal: key position <= query position."""

    causal: bool = False

    @property
    def is_dense(self) -> bool:
        """True when every pair attends (no mask at all)."""
        return not self.causal

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool (len(q_pos), len(k_pos)): True where query q_pos[i] attends key k_pos[j]."""
        ok = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        if self.causal:
            ok &= k_pos[None, :] <= q_pos[:, None]
        return ok


@dataclass(frozen=True)
class Tile:
    """One kernel call: query rows `q.rows` against key rows `k.rows` of the two shards.

    causal: the kernel's top-left lower triangle on this tile. mask: dense bool (len q, len k) or None.
    pairs: the (query, key) pairs that attend in this tile (work accounting).
    """

    q: Segment
    k: Segment
    causal: bool = False
    mask: torch.Tensor | None = None
    pairs: int = 0


def plan_tiles(q_segs: list[Segment], k_segs: list[Segment], spec: MaskSpec) -> list[Tile]:
    """The kernel calls that compute queries `q_segs` against keys `k_segs` under `spec`."""
    tiles: list[Tile] = []
    for qs in q_segs:
        for ks in k_segs:
            tiles.extend(_plan_pair(qs, ks, spec))
    return tiles


def _plan_pair(qs: Segment, ks: Segment, spec: MaskSpec) -> list[Tile]:
    n, m = qs.length, ks.length
    if spec.is_dense:
        return [Tile(qs, ks, pairs=n * m)]
    # Causal only. Positions ascend within a segment.
    if ks.first > qs.last:
        return []
    if ks.last <= qs.first:
        return [Tile(qs, ks, pairs=n * m)]
    if qs.stride == ks.stride and n == m:
        offset = qs.first - ks.first
        if 0 <= offset < qs.stride:
            # Same positions (contiguous diagonal) or striped with key rank <= query rank: j <= i.
            return [Tile(qs, ks, causal=True, pairs=n * (n + 1) // 2)]
        if -qs.stride < offset < 0:
            if n == 1:
                return []
            # Striped, key rank > query rank (burstengine.md eq. 14): j < i, i.e. the causal triangle
            # of queries 1.. against keys ..n-2; query 0 attends nothing here.
            return [Tile(qs.sub(1, n), ks.sub(0, n - 1), causal=True, pairs=n * (n - 1) // 2)]
    mask = spec.allowed(qs.positions(), ks.positions())
    pairs = int(mask.sum())
    if pairs == 0:
        return []
    if pairs == n * m:
        return [Tile(qs, ks, pairs=pairs)]
    return [Tile(qs, ks, mask=mask, pairs=pairs)]
