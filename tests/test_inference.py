"""Decode attention on a sharded KV cache against float64 attention over each row's real tokens.

One world per size (2, 3, 4): a batch of two prompts of different lengths (padded to the layout's
multiple), prefilled into the sharded cache, then several decode steps whose K, V land on the
ranks in turn. Every rank must get the same, exact output; the cache holds ~1/G of the tokens.
The merges run through the process group's all-gather and through shared memory (comm/shm.py),
which must give the same bits.
"""

from __future__ import annotations

import pytest
import torch
from burst.comm.shm import HostAllGather
from burst.inference import ShardedKVCache, decode_attention
from burst.inference.decode import decode_exchange
from burst.kernels.reference import attention as reference_attention

from world import results_by_world

H, KVH, D, STEPS = 4, 2, 16, 5


def _decode(rank, world, layout, dtype, shared_memory=False):
    g = torch.Generator().manual_seed(world)
    lengths = [7 * world - 3, 4 * world + 1]
    padded = -(-max(lengths) // (2 * world)) * 2 * world
    k_full = torch.randn(2, padded, KVH, D, generator=g, dtype=torch.float64)
    v_full = torch.randn(2, padded, KVH, D, generator=g, dtype=torch.float64)
    cache = ShardedKVCache(layers=1, layout=layout, chunk=4)
    positions = cache.prefill_positions(lengths, padded)
    cache.store_prefill(0, k_full[:, positions[0]].to(dtype), v_full[:, positions[0]].to(dtype))
    rows_k = [k_full[b, : lengths[b]] for b in range(2)]
    rows_v = [v_full[b, : lengths[b]] for b in range(2)]
    errors, outs = [], []
    exchange = decode_exchange((2, 1, H, D), dtype, torch.device("cpu")) if shared_memory else None
    assert (exchange is not None) == shared_memory  # one host, Linux x86-64: the suite's machines
    for step in range(STEPS):
        q = torch.randn(2, 1, H, D, generator=g, dtype=torch.float64)
        k_new = torch.randn(2, 1, KVH, D, generator=g, dtype=torch.float64)
        v_new = torch.randn(2, 1, KVH, D, generator=g, dtype=torch.float64)
        cache.append(0, k_new.to(dtype), v_new.to(dtype), torch.tensor(lengths) + step)
        cache.advance()
        rows_k = [torch.cat([rows_k[b], k_new[b]]) for b in range(2)]
        rows_v = [torch.cat([rows_v[b], v_new[b]]) for b in range(2)]
        out = decode_attention(q.to(dtype), *cache.keys_values(0), agreed=shared_memory, exchange=exchange)
        for b in range(2):
            ref, _ = reference_attention(
                q[b : b + 1].to(dtype).double(), rows_k[b][None].to(dtype).double(), rows_v[b][None].to(dtype).double()
            )
            errors.append(((out[b : b + 1].double() - ref).abs().max() / ref.abs().max()).item())
        outs.append(out)
    total = sum(lengths) + 2 * STEPS  # real tokens over both rows
    held = int(cache.keys_values(0)[2].sum())
    return max(errors), torch.stack(outs), held, total


def _host_all_gather(rank, world):
    """Rank-dependent tensors of two dtypes and sizes through one gather each; then the fallback:
    one rank that cannot use shared memory makes every rank get None."""
    got = []
    for dtype in (torch.float32, torch.float64):
        gather = HostAllGather.create(7, dtype)
        for call in range(5):  # more calls than the two slots: each slot is reused
            n = 3 + call % 5
            got.append((dtype, n, call, gather(torch.arange(n, dtype=dtype) + 100 * rank + call)))
        gather.close()
    real = HostAllGather.supported
    HostAllGather.supported = staticmethod(lambda: rank != world - 1)
    try:
        fallback = [HostAllGather.create(7) is None]
    finally:
        HostAllGather.supported = real
    import burst.comm.shm as shm

    def refused(*args):
        raise PermissionError("/dev/shm read-only")

    for name, failing_rank in (("create_private", 0), ("map_private", world - 1)):  # raised alone, either would hang
        real = getattr(shm, name)
        if rank == failing_rank:
            setattr(shm, name, refused)
        try:
            fallback.append(HostAllGather.create(7) is None)
        finally:
            setattr(shm, name, real)
    return got, all(fallback)


def _all(rank, world):
    out = {
        (layout, str(dtype), shm): _decode(rank, world, layout, dtype, shm)
        for layout in ("contiguous", "zigzag", "striped")
        for dtype in (torch.float32, torch.bfloat16)
        for shm in (False, True)
    }
    out["host_all_gather"] = _host_all_gather(rank, world)
    return out


_results = results_by_world(_all, timeout=240)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_decode_attention_exact_and_identical_on_every_rank(world):
    per_rank = _results(world)
    for key in per_rank[0]:
        if key == "host_all_gather":
            continue
        if key[2]:  # through shared memory: the process group's bits
            assert torch.equal(per_rank[0][key][1], per_rank[0][key[:2] + (False,)][1]), key
        bound = 1e-5 if "float32" in key[1] else 2e-2
        for rank in range(world):
            err, outs, _, _ = per_rank[rank][key]
            assert err < bound, (rank, key, err)
            assert torch.equal(outs, per_rank[0][key][1]), (rank, key)  # bit-identical: greedy stays in step
        held = [per_rank[r][key][2] for r in range(world)]
        total = per_rank[0][key][3]
        assert sum(held) == total, (key, held, total)  # every real token is somewhere, once
        assert max(held) <= total / world + 2 * world + 2, (key, held)  # ~1/G each (padding and turns aside)


@pytest.mark.parametrize("world", [2, 3])
def test_host_all_gather_in_rank_order_and_falls_back_together(world):
    for rank, (got, fell_back) in enumerate(r["host_all_gather"] for r in _results(world)):
        for dtype, n, call, every in got:
            want = torch.stack([torch.arange(n, dtype=dtype) + 100 * r + call for r in range(world)])
            assert every.dtype == dtype and torch.equal(every, want), (rank, dtype, call)
        assert fell_back, rank  # one rank unsupported: None on every rank, none waits on shared memory


def test_partial_attention_with_entries_per_kv_head_matches_float64():
    """valid (batch, entries, kv_heads): each KV head and the query heads of its group attend their own
    entries (an indexer's blocks per KV head), one row with no entry at all for one head."""
    from burst.inference.decode import partial_attention

    g = torch.Generator().manual_seed(5)
    b, n, h, kv, d = 2, 9, 4, 2, 8
    q = torch.randn(b, 1, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, n, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.rand(b, n, kv, generator=g) < 0.5
    valid[1, :, 1] = False
    out, lse = partial_attention(q, k, v, valid, 0.3)
    for row in range(b):
        for head in range(h):
            keep = valid[row, :, head // (h // kv)]
            if not keep.any():
                assert lse[row, head, 0] == float("-inf") and out[row, 0, head].abs().max() == 0
                continue
            scores = (k[row, keep, head // (h // kv)] @ q[row, 0, head]) * 0.3
            want = torch.softmax(scores, 0) @ v[row, keep, head // (h // kv)]
            assert torch.allclose(out[row, 0, head], want, atol=1e-12), (row, head)
            assert torch.allclose(lse[row, head, 0], torch.logsumexp(scores, 0), atol=1e-12)


def test_the_cache_refuses_misuse_before_anything_is_stored_and_counts_narrow_values():
    """chunk 0 had failed on one rank alone, at its first decoded token (the others waiting in the merge);
    a prompt longer than the padding was taken; keys_values / append before a prefill raised TypeError or
    AttributeError; bytes() counted the keys twice where values are narrower (MLA)."""
    for chunk in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            ShardedKVCache(2, chunk=chunk)
    cache = ShardedKVCache(2, chunk=4)
    with pytest.raises(ValueError, match="do not fit the padded length"):
        cache.prefill_positions([9], 4)
    with pytest.raises(ValueError, match="has no prompt stored"):
        cache.keys_values(0)
    with pytest.raises(ValueError, match="has no prompt stored"):
        cache.append(1, torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), torch.tensor([3]))
    cache.prefill_positions([3], 3)
    k, v = torch.zeros(1, 3, 2, 12), torch.zeros(1, 3, 2, 8)  # keys of 12, values of 8
    for layer in range(2):
        cache.store_prefill(layer, k, v)
    assert cache.bytes() == 2 * (k.numel() + v.numel()) * 4
