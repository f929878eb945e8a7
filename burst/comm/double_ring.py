"""The topology-aware double ring (burstengine.md §3.1, Fig. 4-5), and the flat ring as its one-node case.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .ring import RingComm

# Message tags: inner ring 0..7, outer ring 8..15, accumulators 16..23 (gloo matches by tag).
INTRA_TAG, INTER_TAG, ACC_TAG = 0, 8, 16


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
    def build(rank: int, world: int, per_node: int, direction: int,
              needed: Callable[[int, int], bool]) -> "RingSchedule":
        """The schedule up to the last step at which some rank r needs its pair: needed(r, holding)."""
        full = RingSchedule(rank, world, per_node, direction, ())
        order = [(o, j) for o in range(world // per_node) for j in range(per_node)]
        last = 0
        for n, (o, j) in enumerate(order):
            if any(needed(r, full.holding(o, j, r)) for r in range(world)):
                last = n
        return RingSchedule(rank, world, per_node, direction, tuple(order[: last + 1]))


def ring_per_node(call) -> int:
    """Ranks per node for this call's ring: the topology's when the double ring applies (several
    nodes, double_ring on, the default group), else the whole world (the flat ring)."""
    topo = call.topology
    if topo is None or not topo.double_ring or call.world == 1:
        return call.world
    if call.group is not None and call.group is not dist.group.WORLD:
        return call.world  # nodes are blocks of global ranks: a subgroup runs the flat ring
    per_node = topo.local_world_size
    return per_node if per_node < call.world and call.world % per_node == 0 else call.world


def visit_blocks(call, schedule: RingSchedule, phase: str, block: Sequence[torch.Tensor],
                 compute: Callable, acc_likes: Sequence[torch.Tensor] | None = None):
    """Run `compute(src, held, accs)` for every step of `schedule` while blocks move.

    block: this rank's tensors that travel. held: the block of rank `src` at that step. accs: when
    acc_likes is given, a block.ArrivingAccumulators for the held block's float32 accumulators
    (shaped like acc_likes), which travel with it inside the node and then go home; else None.
    Returns the sum of the accumulators that came home for this rank's own block (acc_likes given).
    """
    from ..block import ArrivingAccumulators

    s = schedule
    intra = RingComm(call.group, phase, tag=INTRA_TAG, topology=call.topology)
    inter = RingComm(call.group, phase, tag=INTER_TAG, topology=call.topology)
    accs_comm = RingComm(call.group, phase, tag=ACC_TAG, topology=call.topology) if acc_likes else None
    mine, home, pending_home = None, None, False
    outer_block = list(block)
    plan = s.by_outer()
    for n_outer, (o, inner) in enumerate(plan):
        more_outer = n_outer + 1 < len(plan)
        if more_outer:  # posted first: it has the whole inner ring to arrive
            next_outer = inter.send_recv(outer_block, to=s.inter_next, frm=s.inter_prev)
        held, incoming = outer_block, None
        for n_inner, j in enumerate(inner):
            more_inner = n_inner + 1 < len(inner)
            if more_inner:
                next_held = intra.send_recv(held, to=s.intra_next, frm=s.intra_prev)
            src = s.holding(o, j)
            accs = ArrivingAccumulators(list(acc_likes), accs_comm, incoming if n_inner > 0 else None) \
                if acc_likes else None
            compute(src, held, accs)
            if acc_likes:
                done = accs()  # (fetched already unless this step had no tile)
                if pending_home:  # the previous node's gradients, home while this step computed
                    mine = _add_home(mine, home, accs_comm)
                    pending_home = False
                if more_inner:
                    incoming = accs_comm.send_recv(done, to=s.intra_next, frm=s.intra_prev)
                else:  # straight home to the block's owner
                    home = accs_comm.send_recv(done, to=src, frm=s.holder_of_mine(o, j))
                    pending_home = True
                del accs, done
            if more_inner:
                intra.wait()
                held = next_held
        if more_outer:
            inter.wait()
            outer_block = next_outer
    if pending_home:
        mine = _add_home(mine, home, accs_comm)
    return mine


def _add_home(mine, arrived, comm: RingComm):
    comm.wait()
    if mine is None:
        return list(arrived)
    for acc, part in zip(mine, arrived):
        acc.add_(part)
    return mine
