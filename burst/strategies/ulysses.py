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

import torch

from ..block import accumulator_zeros_like, attend_backward, attend_forward, empty_accumulators
from ..call import AttentionCall
from ..comm.collectives import all_to_all_blocks
from ..kernels import lse_for_backward, row_delta
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


def _kv_head_of_rank(call: AttentionCall, heads: int, kv_heads: int) -> list[list[int]]:
    """The KV heads rank r's query heads use, for every r."""
    g = call.world
    if kv_heads >= g:
        per = kv_heads // g
        return [list(range(r * per, (r + 1) * per)) for r in range(g)]
    return [[r * kv_heads // g] for r in range(g)]


def _global_order(call: AttentionCall, device) -> torch.Tensor:
    """Global positions of every rank's tokens, concatenated in rank order: (N,)."""
    n = call.local_len * call.world
    return torch.cat([shard_indices(call.layout, r, call.world, n, device=device) for r in range(call.world)])


def _to_heads(call: AttentionCall, x: torch.Tensor, head_groups: list[list[int]], phase: str) -> torch.Tensor:
    """(batch, n_local, heads, d) sequence shard -> (batch, N, heads_r, d) head shard in sequence order."""
    index = torch.tensor([h for group in head_groups for h in group], device=x.device)
    per = len(head_groups[0])
    b, n, _, d = x.shape
    send = x.index_select(2, index).view(b, n, call.world, per, d).permute(2, 0, 1, 3, 4)
    got = all_to_all_blocks(send, call.group, phase, call.topology)  # (G, b, n, per, d): source rank's tokens
    flat = got.permute(1, 0, 2, 3, 4).reshape(b, call.world * n, per, d)
    return _in_sequence_order(call, flat, dim=1)


def _stats_to_heads(call: AttentionCall, s: torch.Tensor, phase: str) -> torch.Tensor:
    """(batch, heads, n_local) row statistics -> (batch, heads / G, N) in sequence order."""
    b, h, n = s.shape
    per = h // call.world
    send = s.view(b, call.world, per, n).permute(1, 0, 2, 3)
    got = all_to_all_blocks(send, call.group, phase, call.topology)  # (G, b, per, n)
    flat = got.permute(1, 2, 0, 3).reshape(b, per, call.world * n)
    return _in_sequence_order(call, flat, dim=2)


def _in_sequence_order(call: AttentionCall, x: torch.Tensor, dim: int) -> torch.Tensor:
    order = _global_order(call, x.device)
    if call.layout == "contiguous":
        return x.contiguous()
    out = torch.empty_like(x)
    out.index_copy_(dim, order, x)
    return out


def _to_sequence(call: AttentionCall, x: torch.Tensor, phase: str) -> torch.Tensor:
    """(batch, N, heads_r, d) head shard in sequence order -> (batch, n_local, heads, d) sequence shard."""
    b, total, per, d = x.shape
    n = total // call.world
    send = x.index_select(1, _global_order(call, x.device)).view(b, call.world, n, per, d).transpose(0, 1)
    got = all_to_all_blocks(send, call.group, phase, call.topology)  # (G, b, n, per, d): source rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, call.world * per, d)


def _stats_to_sequence(call: AttentionCall, s: torch.Tensor, phase: str) -> torch.Tensor:
    b, per, total = s.shape
    n = total // call.world
    send = s.index_select(2, _global_order(call, s.device)).view(b, per, call.world, n).permute(2, 0, 1, 3)
    got = all_to_all_blocks(send, call.group, phase, call.topology)  # (G, b, per, n)
    return got.permute(1, 0, 2, 3).reshape(b, call.world * per, n)


def _full_tiles(call: AttentionCall):
    whole = [Segment(0, call.local_len * call.world, 0, 1)]
    return call.plan(whole, whole)


def ulysses_forward(call: AttentionCall, q, k, v):
    """q: (batch, n_local, heads, d); k, v: (batch, n_local, kv_heads, d). Returns out, lse (shard layout)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    per_q = heads // call.world
    q_groups = [list(range(r * per_q, (r + 1) * per_q)) for r in range(call.world)]
    kv_groups = _kv_head_of_rank(call, heads, kv_heads)
    q_h = _to_heads(call, q, q_groups, "forward")
    k_h, v_h = (_to_heads(call, t, kv_groups, "forward") for t in (k, v))
    out_h, lse_h = empty_accumulators(q_h)
    attend_forward(call.kernel, q_h, k_h, v_h, _full_tiles(call), out_h, lse_h, call.scale)
    out = _to_sequence(call, out_h.to(q.dtype), "forward")
    lse = _stats_to_sequence(call, lse_h, "forward")
    return out, lse


def ulysses_backward(call: AttentionCall, dout, q, k, v, out, lse):
    heads, kv_heads = q.shape[2], k.shape[2]
    per_q = heads // call.world
    q_groups = [list(range(r * per_q, (r + 1) * per_q)) for r in range(call.world)]
    kv_groups = _kv_head_of_rank(call, heads, kv_heads)
    q_h, dout_h = (_to_heads(call, t, q_groups, "backward") for t in (q, dout))
    k_h, v_h = (_to_heads(call, t, kv_groups, "backward") for t in (k, v))
    delta_h = _stats_to_heads(call, row_delta(dout, out), "backward")
    lse_h = lse_for_backward(_stats_to_heads(call, lse, "backward"))
    dq_h, dk_h, dv_h = (accumulator_zeros_like(t) for t in (q_h, k_h, v_h))
    attend_backward(call.kernel, dout_h, q_h, k_h, v_h, None, lse_h, _full_tiles(call), dq_h, dk_h, dv_h,
                    call.scale, delta=delta_h)
    dq = _to_sequence(call, dq_h, "backward")
    dk, dv = (_kv_grads_home(call, t, kv_groups, kv_heads) for t in (dk_h, dv_h))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _kv_grads_home(call: AttentionCall, grad_h: torch.Tensor, kv_groups, kv_heads: int) -> torch.Tensor:
    """dK (or dV) from head layout back to sequence shards; ranks that shared a KV head add theirs."""
    got = _to_sequence(call, grad_h, "backward")  # (b, n, G * per, d): rank r's part is for kv_groups[r]
    if kv_heads >= call.world:
        return got
    b, n, _, d = got.shape
    summed = torch.zeros(b, n, kv_heads, d, dtype=got.dtype, device=got.device)
    index = torch.tensor([group[0] for group in kv_groups], device=got.device)
    return summed.index_add_(2, index, got)


ULYSSES = Strategy("ulysses", forward=ulysses_forward, backward=ulysses_backward, check=check_ulysses)
