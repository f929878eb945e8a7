"""The topology-aware double ring's schedule (burstengine.md §3.1, Fig. 4-5), and the flat ring as its one-node case.

Ranks are numbered node-major: rank = node * L + local, M nodes of L ranks. A block (K, V for the
forward; Q, dO, D, lse for BurstAttention's backward) visits every rank in M outer steps of L inner
steps. At outer step o, inner step j, rank (m, i) holds the block of rank (m - d·o, i - d·j), d the
direction (+1, or -1 when queries travel):

- inner steps pass the held block around the node (intra-node links);
- at the start of each outer step the block the rank received from the previous node is sent on to
  the next node (inter-node link), and it arrives while the whole inner ring computes: the inter,
  the intra transfer and compute overlap (three buffer sets: inter, intra, compute);
- accumulators that travel with a block (dK, dV for ring; dQ for burst) go round the node with it
  and, after the node's last inner step, straight home to the block's owner in one hop; that hop is
  waited only after the next step's compute (the gradient overlap of Fig. 5).

Per rank and pass: (M - 1) blocks cross nodes and M(L - 1) stay inside; the flat ring over several
nodes sends all G - 1 across the boundary. With M = 1 this is exactly the flat ring (RingAttention,
BurstAttention forward), with its early stop: steps past the last one whose block pair the mask
needs on some rank are never run.

Plans only: who holds which block at which step. The loop that moves the blocks is RingAttention's
(strategies/ring.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RingSchedule:
    """Who holds which block when, for `rank` of `world` ranks in nodes of `per_node`.

    steps: (outer, inner) pairs in the order they run; a prefix of all M x L steps (the mask may
    end the ring early).
    """

    rank: int
    world: int
    per_node: int
    direction: int
    steps: tuple[tuple[int, int], ...]

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def rank_of(self, node: int, local: int) -> int:
        return (node % self.nodes) * self.per_node + local % self.per_node

    def holding(self, outer: int, inner: int, rank: int | None = None) -> int:
        """The rank whose block `rank` (default: this one) holds at step (outer, inner)."""
        node, local = divmod(self.rank if rank is None else rank, self.per_node)
        return self.rank_of(node - self.direction * outer, local - self.direction * inner)

    def holder_of_mine(self, outer: int, inner: int) -> int:
        """The rank that holds this rank's block at step (outer, inner)."""
        node, local = divmod(self.rank, self.per_node)
        return self.rank_of(node + self.direction * outer, local + self.direction * inner)

    def _neighbour(self, d_node: int, d_local: int) -> int:
        node, local = divmod(self.rank, self.per_node)
        return self.rank_of(node + d_node, local + d_local)

    @property
    def intra_next(self) -> int:
        return self._neighbour(0, self.direction)

    @property
    def intra_prev(self) -> int:
        return self._neighbour(0, -self.direction)

    @property
    def inter_next(self) -> int:
        return self._neighbour(self.direction, 0)

    @property
    def inter_prev(self) -> int:
        return self._neighbour(-self.direction, 0)

    def by_outer(self) -> list[tuple[int, list[int]]]:
        """[(outer, [inner steps])] in order."""
        grouped: dict[int, list[int]] = {}
        for o, j in self.steps:
            grouped.setdefault(o, []).append(j)
        return list(grouped.items())

    @staticmethod
    def build(
        rank: int, world: int, per_node: int, direction: int, needed: Callable[[int, int], bool]
    ) -> "RingSchedule":
        """The schedule up to the last step at which some rank r needs its pair: needed(r, holding)."""
        full = RingSchedule(rank, world, per_node, direction, ())
        order = [(o, j) for o in range(world // per_node) for j in range(per_node)]
        last = 0
        for n, (o, j) in enumerate(order):
            if any(needed(r, full.holding(o, j, r)) for r in range(world)):
                last = n
        return RingSchedule(rank, world, per_node, direction, tuple(order[: last + 1]))
