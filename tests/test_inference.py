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
    out["misuse"] = _misuse_on_every_rank(rank, world)
    return out


def _misuse_on_every_rank(rank, world):
    """What raised on one rank alone (the others hung in the merge) or was taken silently (a helper's probe):
    each raises on every rank now, before the merge."""
    from burst.inference import decode_attention

    torch.manual_seed(0)
    cache = ShardedKVCache(1, chunk=4)
    cache.prefill_positions([1], 2 * world)  # a one-token prompt: rank 1 on holds padding alone
    k = torch.randn(1, 2, 2, 8)
    cache.store_prefill(0, k, k)
    q = torch.randn(1, 1, 4, 8)
    keys, values, valid = cache.keys_values(0)
    sinks = torch.zeros(4) + rank  # a value of each rank's own
    cases = {
        "q dtype": lambda: decode_attention(q.double(), keys, values, valid),
        "valid float": lambda: decode_attention(q, keys, values, valid.float()),
        "q batch": lambda: decode_attention(q.expand(3, -1, -1, -1), keys, values, valid),
        "sinks differ": lambda: decode_attention(q, keys, values, valid, sinks=sinks),
        "append k heads": lambda: cache.append(0, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 2, 8), torch.tensor([1])),
    }
    return {name: _error_text(call) for name, call in cases.items()}


def _error_text(call):
    """The message of the TypeError or ValueError `call()` raises (the rank with the bad input raises its own
    type, its peers a ValueError naming it), None when it raises none."""
    try:
        call()
    except (TypeError, ValueError) as err:
        return str(err)
    return None


_results = results_by_world(_all, timeout=240)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_decode_attention_exact_and_identical_on_every_rank(world):
    per_rank = _results(world)
    for key in per_rank[0]:
        if key in ("host_all_gather", "misuse"):
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


@pytest.mark.parametrize("world", [2])
def test_decode_misuse_raises_on_every_rank(world):
    expected = {
        "q dtype": "share one dtype",
        "valid float": "valid must be bool",
        "q batch": "want q (batch, t, heads, d)",
        "sinks differ": "sinks differs across ranks",
        "append k heads": "layer 0 stores (1, 1, 2, 8)",
    }
    for rank, results in enumerate(_results(world)):
        for case, words in expected.items():
            message = results["misuse"][case]
            assert message is not None and words in message, (rank, case, message)


def test_the_cache_refuses_what_it_took_silently():
    """append broadcast a K of 1 KV head into 2 and cast dtypes, took float positions, let a layer append
    twice in a step or not at all (its entry: the storage's zeros); store_prefill wrote layer -1 into the last
    and took a shard shorter than its positions; decode took scale=nan (all zeros) and softcap=-1; a cache
    of 0 layers was made."""
    from burst.inference import decode_attention

    with pytest.raises(ValueError, match="layers must be a positive int"):
        ShardedKVCache(0)
    cache = ShardedKVCache(2, chunk=4)
    cache.prefill_positions([3, 2], 3)
    k = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match="layer -1 is not one of the 2"):
        cache.store_prefill(-1, k, k)
    with pytest.raises(ValueError, match="prompt shard"):
        cache.store_prefill(0, k[:, :2], k[:, :2])
    for layer in range(2):
        cache.store_prefill(layer, k, k)
    new, at = torch.randn(2, 1, 2, 8), torch.tensor([3, 3])
    for bad in (
        (new[:, :, :1], new, at),
        (new[:1], new[:1], at),
        (new.double(), new.double(), at),
        (new, new, at.float()),
        (new, new, torch.tensor(3)),
        (new, new, torch.tensor([True, True])),  # positions 1 and 1, silently
    ):
        with pytest.raises(ValueError, match="ShardedKVCache.append"):
            cache.append(0, *bad)
    cache.append(0, new, new, at)
    with pytest.raises(ValueError, match="appended twice"):
        cache.append(0, new, new, at)
    with pytest.raises(ValueError, match=r"layers \[1\] stored a prompt and appended no token"):
        cache.advance()
    keys, values, valid = cache.keys_values(0)
    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        decode_attention(q, keys, values, valid, scale=float("nan"))
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        decode_attention(q, keys, values, valid, softcap=-1.0)
