"""DeepSpeed-Ulysses (BurstEngine's head-parallel baseline, burstengine.md §4.1).

An all-to-all turns sequence shards into head shards: rank r receives every rank's tokens for its
H/G query heads (and the KV heads those need), attends over the whole sequence locally, and a
second all-to-all turns the output back into sequence shards. The mask planner sees the global
positions (each rank's tokens are put back in sequence order first), so every layout and mask works
as in the ring strategies. Per rank it holds the whole sequence for H/G heads: as much as its shard.

GQA with fewer KV heads than ranks: rank r's query heads all use one KV head, and each rank sends
that head, once, to every rank that needs it: no repeat_kv of the whole tensor before the
all-to-all. Valid degrees: G divides the query heads, and G divides the KV heads or they divide G.

Backward re-sends q, k, v (instead of keeping head-layout copies from the forward, which would
double what a rank holds between the passes), with dO, D and lse; gradients go back by all-to-all,
dK, dV of a shared KV head summed at its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..call import AttentionCall
from ..comm.collectives import all_to_all_blocks
from ..comm.stats import head_share
from ..kernels.accumulators import accumulator_zeros_like, empty_accumulators, lse_for_backward, row_delta
from ..layout import Segment, shard_indices
from .base import Strategy


def valid_degrees(heads: int, kv_heads: int, limit: int = 1024) -> list[int]:
    """Ulysses degrees that split `heads` query heads and `kv_heads` KV heads."""
    return [g for g in range(1, limit + 1) if heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0)]


def check_ulysses(call: AttentionCall, q, k) -> None:
    heads, kv_heads, g = q.shape[2], k.shape[2], call.world
    if heads % g or not (kv_heads % g == 0 or g % kv_heads == 0):
        degrees = [d for d in valid_degrees(heads, kv_heads, limit=max(g, heads))]
        raise ValueError(
            f"strategy='ulysses' splits heads over the {g} ranks: {heads} query heads and {kv_heads} KV heads "
            f"cannot be (valid world sizes: {degrees}); use 'usp' or a ring strategy"
        )


def _global_order(call: AttentionCall, device) -> torch.Tensor:
    """Global positions of every rank's tokens, concatenated in rank order: (N,)."""
    n = call.local_len * call.world
    return torch.cat([shard_indices(call.layout, r, call.world, n, device=device) for r in range(call.world)])


@dataclass(frozen=True)
class HeadExchange:
    """The all-to-alls of one Ulysses group: `world` ranks of `group` trade sequence shards for head
    shards. order: where the gathered tokens go (global positions, rank-order concatenation first);
    None keeps them concatenated in rank order (USP's ring then sees them as one shard)."""

    group: object
    world: int
    topology: object
    order: torch.Tensor | None

    def to_heads(self, x: torch.Tensor, head_groups: list[list[int]], phase: str) -> torch.Tensor:
        """(batch, n_local, heads, d) sequence shard -> (batch, world * n_local, heads_r, d)."""
        index = torch.tensor([h for grp in head_groups for h in grp], device=x.device)
        per = len(head_groups[0])
        b, n, _, d = x.shape
        send = x.index_select(2, index).view(b, n, self.world, per, d).permute(2, 0, 1, 3, 4)
        got = all_to_all_blocks(send, self.group, phase, self.topology)  # (G, b, n, per, d): source rank's tokens
        return self._placed(got.permute(1, 0, 2, 3, 4).reshape(b, self.world * n, per, d), dim=1)

    def stats_to_heads(self, s: torch.Tensor, phase: str) -> torch.Tensor:
        """(batch, heads, n_local) row statistics -> (batch, heads / world, world * n_local)."""
        b, h, n = s.shape
        per = h // self.world
        send = s.view(b, self.world, per, n).permute(1, 0, 2, 3)
        got = all_to_all_blocks(send, self.group, phase, self.topology)  # (G, b, per, n)
        return self._placed(got.permute(1, 2, 0, 3).reshape(b, per, self.world * n), dim=2)

    def to_sequence(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        """(batch, world * n_local, heads_r, d) head shard -> (batch, n_local, heads, d) sequence shard."""
        b, total, per, d = x.shape
        n = total // self.world
        send = self._unplaced(x, dim=1).view(b, self.world, n, per, d).transpose(0, 1)
        got = all_to_all_blocks(send, self.group, phase, self.topology)  # (G, b, n, per, d): source's heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, n, self.world * per, d)

    def stats_to_sequence(self, s: torch.Tensor, phase: str) -> torch.Tensor:
        b, per, total = s.shape
        n = total // self.world
        send = self._unplaced(s, dim=2).view(b, per, self.world, n).permute(2, 0, 1, 3)
        got = all_to_all_blocks(send, self.group, phase, self.topology)  # (G, b, per, n)
        return got.permute(1, 0, 2, 3).reshape(b, self.world * per, n)

    def _placed(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.order is None:
            return x
        out = torch.empty_like(x)
        return out.index_copy_(dim, self.order, x)

    def _unplaced(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.order is None else x.index_select(dim, self.order)


def head_groups(heads: int, kv_heads: int, world: int) -> tuple[list[list[int]], list[list[int]]]:
    """(query heads, KV heads) each rank of a Ulysses group of `world` takes."""
    per_q = heads // world
    q_groups = [list(range(r * per_q, (r + 1) * per_q)) for r in range(world)]
    if kv_heads >= world:
        per = kv_heads // world
        return q_groups, [list(range(r * per, (r + 1) * per)) for r in range(world)]
    return q_groups, [[r * kv_heads // world] for r in range(world)]


def kv_grads_home(exchange: HeadExchange, grad_h: torch.Tensor, kv_groups, kv_heads: int) -> torch.Tensor:
    """dK (or dV) from head layout back to sequence shards, in grad_h's dtype; ranks that shared a KV head
    add theirs in float32 at least (USP's partials come in the input dtype), rounded once after."""
    got = exchange.to_sequence(grad_h, "backward")  # (b, n, G * per, d): rank r's part is for kv_groups[r]
    if kv_heads >= exchange.world:
        return got
    b, n, _, d = got.shape
    wide = torch.promote_types(got.dtype, torch.float32)  # float64 stays float64
    summed = torch.zeros(b, n, kv_heads, d, dtype=wide, device=got.device)
    index = torch.tensor([grp[0] for grp in kv_groups], device=got.device)
    return summed.index_add_(2, index, got.to(wide)).to(got.dtype)


def _exchange(call: AttentionCall, device) -> HeadExchange:
    order = None if call.layout == "contiguous" else _global_order(call, device)
    return HeadExchange(call.group, call.world, call.topology, order)


def _full_tiles(call: AttentionCall):
    whole = [Segment(0, call.local_len * call.world, 0, 1)]
    return call.plan(whole, whole)


def ulysses_forward(call: AttentionCall, q, keys):
    """q: (batch, n_local, heads, d); keys.k, keys.v: (batch, n_local, kv_heads, d). Returns out, lse
    (shard layout)."""
    k, v = keys.k, keys.v
    ex = _exchange(call, q.device)
    q_groups, kv_groups = head_groups(q.shape[2], k.shape[2], call.world)
    q_h = ex.to_heads(q, q_groups, "forward")
    k_h, v_h = (ex.to_heads(t, kv_groups, "forward") for t in (k, v))
    out_h, lse_h = empty_accumulators(q_h)
    with head_share(q_h.shape[2], q.shape[2]):
        call.attend_forward(q_h, k_h, v_h, _full_tiles(call), out_h, lse_h)
    return ex.to_sequence(out_h.to(q.dtype), "forward"), ex.stats_to_sequence(lse_h, "forward")


def ulysses_backward(call: AttentionCall, dout, q, keys, out, lse):
    k, v = keys.k, keys.v
    ex = _exchange(call, q.device)
    q_groups, kv_groups = head_groups(q.shape[2], k.shape[2], call.world)
    q_h, dout_h = (ex.to_heads(t, q_groups, "backward") for t in (q, dout))
    k_h, v_h = (ex.to_heads(t, kv_groups, "backward") for t in (k, v))
    delta_h = ex.stats_to_heads(row_delta(dout, out), "backward")
    lse_h = lse_for_backward(ex.stats_to_heads(lse, "backward"))
    dq_h, dk_h, dv_h = (accumulator_zeros_like(t) for t in (q_h, k_h, v_h))
    with head_share(q_h.shape[2], q.shape[2]):
        call.attend_backward(dout_h, q_h, k_h, v_h, None, lse_h, _full_tiles(call), dq_h, dk_h, dv_h, delta=delta_h)
    dq = ex.to_sequence(dq_h, "backward")
    dk, dv = (kv_grads_home(ex, t, kv_groups, k.shape[2]) for t in (dk_h, dv_h))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


ULYSSES = Strategy("ulysses", forward=ulysses_forward, backward=ulysses_backward, check=check_ulysses)
