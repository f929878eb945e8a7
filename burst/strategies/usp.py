"""USP: Ulysses inside a group of `ulysses_degree` ranks, BurstAttention's ring across the groups.

A 2-D split of the G ranks: u = ulysses_degree consecutive ranks form a Ulysses group, and the
ranks at the same place in every Ulysses group form a ring of G/u. The default u is the group's own
ranks per node (BurstEngine's head-first placement: the all-to-all stays on the fast intra-node links,
and the ring crosses nodes), reduced to a divisor of the heads when needed.

Forward: the Ulysses all-to-all gives each rank the tokens of its whole Ulysses group for H/u
heads (one "shard" of u·n tokens, the union of the group's layout shards: the mask planner sees its
global positions); the ring forward of strategies/ring.py runs over the ring group; the all-to-all
goes back. Backward: q, k, v, out and dO go to head shards again, BurstAttention's backward runs
over the ring, and dQ, dK, dV come back. Every layout and mask the ring takes, GQA as Ulysses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from ..agreement import agree
from ..call import AttentionCall
from ..comm.group_cache import GroupCache
from ..comm.membership import group_ranks
from ..comm.stats import head_share, record_choice
from ..comm.topology import ranks_per_node
from ..keys import KeyBlocks
from ..layout import Segment
from .base import Options, Strategy, int_at_least
from .burst import BurstOptions, burst_backward
from .ring import ring_forward
from .ulysses import HeadExchange, head_groups, kv_grads_home, valid_degrees

_SUBGROUPS = GroupCache()  # group -> {ulysses degree: (Ulysses groups, ring groups)}


def ulysses_degree(call: AttentionCall, heads: int, kv_heads: int) -> int:
    """The option, or the default (default_degree) for the group's own ranks per node: a sequence group across
    the nodes of a data x sequence mesh holds fewer of a node's ranks than the node has (comm.topology's
    ranks_per_node: one a node where each sits on its own node, the whole group where it is on one)."""
    asked = call.options.ulysses_degree
    if asked is not None:
        return asked
    per_node = ranks_per_node(call.topology, call.group, call.world) if call.topology is not None else call.world
    return default_degree(heads, kv_heads, per_node, call.world)


def default_degree(heads: int, kv_heads: int, per_node: int, world: int) -> int:
    """The group's ranks per node, reduced to a degree that splits the query and KV heads and the world (the
    planner costs USP at this degree too: plan/cost.py)."""
    fits = [d for d in valid_degrees(heads, kv_heads, limit=per_node) if per_node % d == 0 and world % d == 0]
    return max(fits) if fits else 1


@dataclass(frozen=True)
class USPOptions(Options):
    """ulysses_degree: ranks per Ulysses (head) group; the rest form the ring (None: the group's ranks per node,
    reduced to a degree that splits the heads)."""

    ulysses_degree: int | None = None

    def __post_init__(self):
        if self.ulysses_degree is not None:
            int_at_least("ulysses_degree", self.ulysses_degree, 1)


def check_usp(call: AttentionCall, q, k) -> None:
    u = call.options.ulysses_degree
    heads, kv_heads = q.shape[2], k.shape[2]
    if u is not None and call.world % u:
        raise ValueError(f"ulysses_degree={u!r} must be a positive divisor of the world size {call.world}")
    u = ulysses_degree(call, heads, kv_heads)
    if u not in valid_degrees(heads, kv_heads, limit=max(u, 1)):
        degrees = [d for d in valid_degrees(heads, kv_heads, limit=call.world) if call.world % d == 0]
        raise ValueError(
            f"ulysses_degree={u} cannot split {heads} query heads and {kv_heads} KV heads; "
            f"valid degrees for this world: {degrees}"
        )


def _subgroups(call: AttentionCall, u: int):
    """(Ulysses group, ring group) of this rank, created once per (group, degree) on every member.

    Every rank of the call's group creates the same groups in the same order (all Ulysses groups, then
    all ring groups), so the first USP call on a group must be made by all its ranks (as every burst call
    is). On a group smaller than the world (a dp x sp mesh's sp group), the groups are created with local
    synchronization: torch's plain new_group must be entered by every rank of the world, and its count of
    groups would go apart on the ranks that did not, hanging their next new_group. torch names such a group by
    its members and by how many groups the rank holds, so ranks that hold different numbers (one made groups the
    others did not: USP on another group first) would wait on different names for ever: checked first
    (_check_same_group_count), ValueError on every rank.
    """
    made = _SUBGROUPS.of(call.group, {})
    if u not in made:
        ranks = list(group_ranks(call.group))
        local = len(ranks) < dist.get_world_size()
        if local:
            _check_same_group_count(call)

        def new_group(members):
            return dist.new_group(members, use_local_synchronization=local) if local else dist.new_group(members)

        ulysses = [new_group(ranks[g * u : (g + 1) * u]) for g in range(call.world // u)]
        rings = [new_group(ranks[p::u]) for p in range(u)]
        _SUBGROUPS.put(call.group, {**made, u: (ulysses, rings)})
    ulysses, rings = _SUBGROUPS.of(call.group)[u]
    return ulysses[call.rank // u], rings[call.rank % u]


def _check_same_group_count(call: AttentionCall) -> None:
    """ValueError on every rank of the call's group unless each holds as many process groups (torch's count, in
    the name it gives a group made with local synchronization): agreed as a fact (burst.agreement, on the device
    its collectives use). Skipped on a torch that keeps the count elsewhere."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if names is None:
        return
    fact = "process groups this rank holds"
    hint = (
        ": USP makes its subgroups with local synchronization, which torch names by that number, so their creation "
        "would hang. Make USP's first call on each group before any of its ranks makes groups the others do not "
        "(a USP call on another group first)"
    )
    agree("burst.attention (usp)", {fact: len(names)}, None, call.group, call.world, hints={fact: hint})


def _calls(call: AttentionCall, q, k):
    """The Ulysses exchange and the ring's AttentionCall for this rank."""
    u = ulysses_degree(call, q.shape[2], k.shape[2])
    record_choice("ulysses_degree", str(u))
    ulysses_group, ring_group = _subgroups(call, u) if call.world > 1 else (None, None)
    exchange = HeadExchange(ulysses_group, u, call.topology, None)
    n = call.local_len

    def ring_member_segments(j: int) -> list[Segment]:  # Ulysses group j's shards, concatenated
        return [
            Segment(p * n + s.local_start, s.length, s.first, s.stride)
            for p in range(u)
            for s in call.segments(j * u + p)
        ]

    ring = replace(
        call,
        group=ring_group,
        rank=call.rank // u,
        world=call.world // u,
        local_len=u * n,
        shard_segments=ring_member_segments,
        options=BurstOptions(),
    )
    return exchange, ring, u


def usp_forward(call: AttentionCall, q, keys):
    k, v = keys.k, keys.v
    exchange, ring, u = _calls(call, q, k)
    q_groups, kv_groups = head_groups(q.shape[2], k.shape[2], u)
    q_h = exchange.to_heads(q, q_groups, "forward")
    k_h, v_h = (exchange.to_heads(t, kv_groups, "forward") for t in (k, v))
    with head_share(q_h.shape[2], q.shape[2]):
        out_h, lse_h = ring_forward(ring, q_h, KeyBlocks(k_h, v_h))
    return exchange.to_sequence(out_h, "forward"), exchange.stats_to_sequence(lse_h, "forward")


def usp_backward(call: AttentionCall, dout, q, keys, out, lse):
    k, v = keys.k, keys.v
    exchange, ring, u = _calls(call, q, k)
    q_groups, kv_groups = head_groups(q.shape[2], k.shape[2], u)
    q_h, dout_h, out_h = (exchange.to_heads(t, q_groups, "backward") for t in (q, dout, out))
    k_h, v_h = (exchange.to_heads(t, kv_groups, "backward") for t in (k, v))
    lse_h = exchange.stats_to_heads(lse, "backward")
    with head_share(q_h.shape[2], q.shape[2]):
        dq_h, dk_h, dv_h = burst_backward(ring, dout_h, q_h, KeyBlocks(k_h, v_h), out_h, lse_h)
    dq = exchange.to_sequence(dq_h, "backward")
    dk, dv = (kv_grads_home(exchange, t, kv_groups, k.shape[2]) for t in (dk_h, dv_h))
    return dq, dk, dv


USP = Strategy("usp", forward=usp_forward, backward=usp_backward, options=USPOptions, check=check_usp)
