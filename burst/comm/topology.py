"""Which ranks share a node: the topology the double ring and CommStats' link counts follow.

    burst.attention(..., topology=burst.Topology(local_world_size=4))   # 4 ranks per node

Nodes are blocks of `local_world_size` consecutive *global* ranks (torchrun's numbering). The
default comes from torchrun's LOCAL_WORLD_SIZE; without it every rank is on one node. One machine
can thus stand for several nodes (e.g. 4 local processes as 2 nodes x 2), which is how the tests
and the emulated-link benchmark exercise the multi-node paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from .membership import group_ranks, group_size


@dataclass(frozen=True)
class Topology:
    """local_world_size: ranks per node (None: LOCAL_WORLD_SIZE, else all ranks one node).
    double_ring: use the topology-aware double ring for burst / ring when there is more than one
    node (False keeps the flat ring: the baseline, still counted by link)."""

    local_world_size: int | None = None
    double_ring: bool = True

    def resolved(self, world: int) -> "Topology":
        """This topology with local_world_size filled in for a default world of `world` ranks."""
        size = self.local_world_size
        if size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env and not env.strip().isdigit():
                raise ValueError(f"LOCAL_WORLD_SIZE={env!r} (ranks per node, read for burst.Topology) is not a number")
            size = int(env) if env else world
        return Topology(local_world_size=size, double_ring=self.double_ring)

    def check(self, world: int) -> None:
        size = self.local_world_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
            raise ValueError(
                f"topology local_world_size={size!r} must be a positive divisor of the world size "
                f"{world} (ranks per node)"
            )
        if not isinstance(self.double_ring, bool):
            raise TypeError(f"topology double_ring must be a bool, got {type(self.double_ring).__name__}")

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.local_world_size

    def link(self, global_a: int, global_b: int) -> str:
        """ "intra" when the two global ranks share a node, else "inter"."""
        return "intra" if self.node_of(global_a) == self.node_of(global_b) else "inter"


def nodes_spanned(topology: Topology | None, group) -> int:
    """The nodes the ranks of `group` (None: the default group) sit on under `topology`: 1 without a
    topology. A subgroup's ranks are looked up by their global numbers, as links are (link_between)."""
    if topology is None or not dist.is_initialized():
        return 1
    return len({topology.node_of(r) for r in group_ranks(group)})


def ranks_per_node(topology: Topology, group, world: int) -> int:
    """The ranks per node of a double ring over `group` (None: the default group) of `world` ranks: L when its
    ranks sit L to a node, each node's in consecutive group ranks, over more than one node (a data x sequence
    mesh's sequence group across nodes too); else `world`, the flat ring."""
    members = group_ranks(group) if dist.is_initialized() else range(world)
    nodes = [topology.node_of(r) for r in members]
    per_node = nodes.count(nodes[0])
    blocks = [nodes[i : i + per_node] for i in range(0, world, per_node)]
    one_node_each = all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == len(blocks)
    return per_node if 1 <= per_node < world and world % per_node == 0 and one_node_each else world


def default_world_size() -> int:
    return group_size()


def link_between(topology: Topology | None, group, peer: int) -> str | None:
    """The link from this rank to group rank `peer` under `topology` (None without a topology)."""
    if topology is None or not dist.is_initialized():
        return None
    me = dist.get_rank()
    other = dist.get_global_rank(group or dist.group.WORLD, peer)
    return topology.link(me, other)
