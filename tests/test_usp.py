"""strategy="usp" (Ulysses inside a group, ring across groups) against float64 attention.

One world of 4 ranks (6, for 3 x 2 and 2 x 3 meshes, is left out for the suite's time): Ulysses
degrees 1, 2 and the whole world, and the default taken from the topology (ranks per node); every
layout, causal / window / documents, MHA and GQA (one KV head with Ulysses degree 2), fp32 and bf16;
degrees that do not divide raise on every rank. Every layout meets every mask at degree 2 (Ulysses and
ring both at work); degrees 1 and 4 (all ring, all Ulysses) and the topology's default take one layout
per mask, the three in turn.
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import assert_within_bounds, full_inputs, reference_grads, reference_mask, sharded_errors
from world import results_by_world, value_error_text

N_LOCAL, H, D = 4, 4, 8
DEGREES = {4: (1, 2, 4), 6: (2,)}


def _cases(rank, world):
    results = []
    seqlen = N_LOCAL * world
    masks = {
        "full": {},
        "causal": dict(causal=True),
        "window": dict(causal=True, window=(5, 0)),
        "documents": dict(cu_seqlens=[0, 5, seqlen // 2 + 1, seqlen]),
    }
    settings = [dict(ulysses_degree=u) for u in DEGREES[world]]
    settings.append(dict(topology=burst.Topology(local_world_size=2)))  # default degree: ranks per node
    layouts = ("contiguous", "zigzag", "striped")
    for options in settings:
        for i, (name, kwargs) in enumerate(masks.items()):
            if "topology" in options and name != "causal":
                continue  # the default degree is 2, run above with every mask: here that it is taken
            extra = {k: v for k, v in kwargs.items() if k != "causal"}
            allowed = reference_mask(seqlen, causal=kwargs.get("causal", False), **extra)
            for kv_heads in (4, 2, 1):
                if kv_heads == 1 and options.get("ulysses_degree", 2) > 2:
                    continue
                for dtype in (torch.float32, torch.bfloat16) if name == "causal" else (torch.float32,):
                    full = full_inputs(30 + kv_heads, 1, seqlen, H, kv_heads, D, dtype)
                    ref = reference_grads(*full, causal=False, mask=allowed)
                    for layout in layouts if options.get("ulysses_degree") == 2 else (layouts[i % 3],):
                        errs = sharded_errors(full, ref, dtype, layout=layout, strategy="usp", **kwargs, **options)
                        results.append(((str(options), name, kv_heads, str(dtype), layout), errs))
    x = torch.randn(1, N_LOCAL, H, D)
    bad = value_error_text(lambda: burst.attention(x, x, x, strategy="usp", ulysses_degree=3 if world == 4 else 4))
    return results, bad, _on_half_of_the_world(rank, world)


def _on_half_of_the_world(rank, world):
    """USP on groups of part of the world (a dp x sp mesh's sp groups) against float64. The default degree counts
    the group's own ranks per node: groups {0, 2} and {1, 3} on nodes of two ranks hold one rank a node (a pure
    ring; the node's size, 2, sent the all-to-all across nodes), a group on one node all of its ranks. Then the
    first half alone at Ulysses degrees 1 and 2; then USP on a new group across the halves, whose ranks now hold
    different numbers of groups, is refused on every rank (torch's local synchronization would hang); then a
    group over the whole world still forms on every rank (USP's subgroups took no number from torch's count)."""
    import torch.distributed as dist

    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    strided = [dist.new_group([r, r + half]) for r in range(half)]
    results, degrees = [], {}
    for name, group, members in (
        ("across nodes", strided[rank % half], 2),
        ("on one node", groups[rank // half], half),
    ):
        full = full_inputs(43, 1, N_LOCAL * members, H, 2, D, torch.float32)
        ref = reference_grads(*full, causal=True)
        with burst.CommStats() as stats:
            errs = sharded_errors(
                full, ref, torch.float32, "zigzag", group, causal=True, strategy="usp", topology=burst.Topology(2)
            )
        results.append(((f"default degree, {name}", 0, str(torch.float32)), errs))
        degrees[name] = [c for c in stats.choices() if c.startswith("ulysses_degree=")]
    if rank < half:
        full = full_inputs(41, 1, N_LOCAL * half, H, 2, D, torch.float32)
        ref = reference_grads(*full, causal=True)
        for u in (1, 2):
            errs = sharded_errors(
                full, ref, torch.float32, "zigzag", groups[0], causal=True, strategy="usp", ulysses_degree=u
            )
            results.append((("half of the world", u, str(torch.float32)), errs))
    across = [dist.new_group([r, r + half]) for r in range(half)][rank % half]
    x = burst.shard(torch.randn(1, 2 * N_LOCAL, H, D), group=across)
    refused = value_error_text(lambda: burst.attention(x, x, x, group=across, strategy="usp", ulysses_degree=1))
    whole = torch.ones(1)
    dist.all_reduce(whole, group=dist.new_group(list(range(world))))
    return results, whole.item(), degrees, refused


_results = results_by_world(_cases, timeout=400)


@pytest.mark.parametrize("world", [4])  # 6 (3 x 2, 2 x 3) left out for the suite's time
def test_usp_matches_float64(world):
    assert_within_bounds([r[0] for r in _results(world)], lambda key: key[3])


@pytest.mark.parametrize("world", [4])
def test_usp_on_half_of_the_world_matches_float64_and_leaves_group_creation_in_step(world):
    halves = [r[2] for r in _results(world)]
    assert [len(cases) for cases, *_ in halves] == [4] * (world // 2) + [2] * (world // 2)
    assert_within_bounds([cases for cases, *_ in halves], lambda key: key[2])
    assert [whole for _, whole, *_ in halves] == [float(world)] * world
    for rank, (_, _, degrees, refused) in enumerate(halves):
        assert degrees == {"across nodes": ["ulysses_degree=1"], "on one node": ["ulysses_degree=2"]}, (rank, degrees)
        assert refused is not None and "process groups this rank holds" in refused, (rank, refused)


@pytest.mark.parametrize("world", [4])
def test_bad_degree_raises_on_every_rank(world):
    for rank, (_, bad, _) in enumerate(_results(world)):
        assert bad is not None and "ulysses_degree" in bad, (rank, bad)
