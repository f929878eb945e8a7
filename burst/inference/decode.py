"""Decode attention on a sharded KV cache: every rank attends its shard, one collective merges.

The new token's query is on every rank. Each rank computes the partial (out, lse) of the query
against the cache entries it holds (the kernel of burst.kernels, float32 statistics), all ranks
all-gather the partials (batch x heads x (head_dim + 1) floats per rank: small) and merge them in
rank order with the online-softmax merge of merge.py. Every rank thus gets the same, exact result,
bit for bit, which keeps greedy decoding in step across ranks.

A generation checks its shapes once (agree_on_decoding) and, when every rank runs on one host's
CPUs, takes its all-gathers through shared memory (decode_exchange: comm/shm.py, ~10 us against
~1 ms for gloo's), since each layer of each token waits on one.
"""

from __future__ import annotations

import math

import torch

from ..agreement import agree
from ..comm import tensor_bytes
from ..comm.collectives import all_gather_flat, record_to_peers
from ..comm.membership import group_size
from ..comm.shm import HostAllGather
from ..kernels import accumulator_dtype, select_kernel
from ..merge import merge_partial
from ..sinks import check_sinks, fold_sinks


def partial_attention(q, k, v, valid, scale: float, softcap: float = 0.0):
    """This rank's partial result for the new queries against its cache entries.

    q: (batch, t, heads, head_dim); k: (batch, entries, kv_heads, head_dim); v: (batch, entries,
    kv_heads, value_dim); valid: (batch, entries) bool, or (batch, entries, kv_heads) where each KV head
    (and the query heads of its group) attends its own entries. Returns out (batch, t, heads, value_dim)
    float32 and lse (batch, heads, t) float32 (-inf and 0 for a row with no valid entry here). Rows (and
    KV heads) are computed one at a time when their valid entries differ (prompts of different lengths,
    an indexer's choice). softcap > 0: scores capped as softcap * tanh(score / softcap) (Gemma 2).
    """
    if v.shape[-1] != q.shape[-1]:  # MLA's values are narrower than its keys: the kernels take one width
        width = max(v.shape[-1], q.shape[-1])
        out, lse = partial_attention(*(_widened(t, width) for t in (q, k, v)), valid, scale, softcap)
        return out[..., : v.shape[-1]], lse
    acc = accumulator_dtype(q.dtype)
    b, t, h, d = q.shape
    out = torch.zeros(b, t, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=acc, device=q.device)
    if k.shape[1] == 0:
        return out, lse
    kernel = select_kernel(q.device, q.dtype, softcap)
    if bool(valid.all()):
        o, l = kernel.forward(q, k, v, scale, False, None)
        out.copy_(o)
        lse.copy_(l)
        return out, lse
    per_kv_head = valid.dim() == 3  # each KV head (and its group of query heads) attends its own entries
    groups = k.shape[2] if per_kv_head else 1
    for row in range(b):
        for g in range(groups):
            keep = valid[row, :, g] if per_kv_head else valid[row]
            if not bool(keep.any()):
                continue
            kv = slice(g, g + 1) if per_kv_head else slice(None)
            queries = slice(g * h // groups, (g + 1) * h // groups)  # the heads of KV head g (all: one group)
            o, l = kernel.forward(
                q[row : row + 1, :, queries], k[row : row + 1, keep, kv], v[row : row + 1, keep, kv], scale, False, None
            )
            out[row : row + 1, :, queries].copy_(o)
            lse[row : row + 1, queries].copy_(l)
    return out, lse


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """t with zero channels appended to `width` (zeros add nothing to a score, and come out as zeros)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def merge_across_ranks(
    out: torch.Tensor, lse: torch.Tensor, group=None, exchange: HostAllGather | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's partial (out, lse) and merge them in rank order: float32 (out, lse).

    out: (batch, t, heads, head_dim) float32; lse: (batch, heads, t) float32. exchange: the
    generation's shared-memory all-gather (decode_exchange), or None for the process group's.
    """
    world = group_size(group)
    if world == 1:
        return out, lse
    packed = torch.cat([out.flatten(), lse.flatten()])
    if exchange is not None:
        every = exchange(packed)
    else:
        every = packed.new_empty(world * packed.numel())
        all_gather_flat(every, packed, group=group)
    record_to_peers("decode", tensor_bytes(packed), group)
    every = every.view(world, -1)
    n_out = out.numel()
    merged_out = torch.zeros_like(out)
    merged_lse = torch.full_like(lse, float("-inf"))
    for r in range(world):
        merge_partial(merged_out, merged_lse, every[r, :n_out].view_as(out), every[r, n_out:].view_as(lse))
    return merged_out, merged_lse


def decode_attention(
    q,
    k,
    v,
    valid,
    scale: float | None = None,
    group=None,
    agreed: bool = False,
    exchange: HostAllGather | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Exact attention of new queries over a KV cache sharded across `group`; q's dtype out.

    q: (batch, t, heads, head_dim), the same on every rank; k, v, valid: this rank's cache shard
    (ShardedKVCache.keys_values). Heads of q must be a multiple of the cache's kv_heads.
    agreed: the caller already checked, once for a whole generation (`agree_on_decoding`), that every
    rank decodes the same shapes; then this call is one collective (the merge's all-gather), not two.
    exchange: the generation's decode_exchange (after the agreement), or None. sinks: (heads,)
    attention sinks (burst/sinks.py), folded into the merged rows; the same on every rank. softcap: as
    burst.attention's (0: none).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    problem = _decode_problem(q, k, v, valid, scale, softcap)
    try:
        check_sinks(sinks, q)
    except (TypeError, ValueError) as err:
        problem = problem or err
    if agreed and problem is not None:
        raise problem  # the shapes were agreed for the whole generation: a bad one here is a bug of the caller's
    if not agreed:
        agree_on_decoding(q.shape, q.dtype, k.shape[2], scale, group, problem, softcap=softcap, sinks=sinks)
    out, lse = merge_across_ranks(*partial_attention(q, k, v, valid, scale, softcap), group, exchange)
    if sinks is not None:
        out, _ = fold_sinks(out, lse, sinks)
    return out.to(q.dtype)


def _decode_problem(q, k, v, valid, scale, softcap) -> Exception | None:
    """What is wrong with a decode call's own arguments (local facts), or None."""
    tensors = {"q": q, "k": k, "v": v, "valid": valid}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return TypeError(
            f"decode_attention: {[n for n, t in tensors.items() if not isinstance(t, torch.Tensor)]} must be tensors"
        )
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.dim() != 4
        or k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[-1] != k.shape[-1]
        or q.shape[2] % k.shape[2]
        or valid.shape not in (k.shape[:2], k.shape[:3])
    ):
        return ValueError(
            f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, valid "
            f"{tuple(valid.shape)}: want q (batch, t, heads, d), k (batch, entries, kv_heads, d), v (batch, "
            "entries, kv_heads, value_dim) with heads a multiple of kv_heads, valid (batch, entries[, kv_heads])"
        )
    if valid.dtype != torch.bool or not q.dtype == k.dtype == v.dtype:
        return TypeError(
            f"decode_attention: q, k, v must share one dtype ({q.dtype}, {k.dtype}, {v.dtype}) and valid must be "
            f"bool, got {valid.dtype} (an int tensor would index, not mask)"
        )
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return ValueError(f"decode_attention: scale must be a finite number > 0, got {scale!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        return ValueError(f"decode_attention: softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    return None


def agree_on_decoding(
    q_shape, dtype, kv_heads: int, scale: float, group=None, problem=None, softcap: float = 0.0, sinks=None
) -> None:
    """Check once that every rank decodes the same query shape, dtype, KV heads, scale, softcap and sinks
    (raises on every rank otherwise); each decode_attention(..., agreed=True) of the generation then skips it."""
    world = group_size(group)
    facts = {"q shape": tuple(q_shape), "dtype": str(dtype), "kv_heads": int(kv_heads), "scale": float(scale)}
    if problem is None:
        facts["softcap"] = float(softcap)
        facts["sinks"] = None if sinks is None else tuple(sinks.detach().double().flatten().tolist())
    agree("burst decode_attention", facts if problem is None else None, problem, group, world)


def decode_exchange(
    q_shape, dtype: torch.dtype, device: torch.device, group=None, value_dim: int | None = None
) -> HostAllGather | None:
    """Collective, once per generation after agree_on_decoding: the shared-memory all-gather for the
    merges of queries of shape q_shape (batch, t, heads, head_dim) and values of value_dim channels
    (default head_dim) when the world has several ranks, all on this host and decoding on CPU; None
    otherwise (then the process group's all-gather)."""
    world = group_size(group)
    if world == 1 or device.type != "cpu":  # the same on every rank: the shapes and dtype were agreed
        return None
    b, t, h, d = q_shape
    return HostAllGather.create(b * t * h * ((value_dim or d) + 1), accumulator_dtype(dtype), group)
