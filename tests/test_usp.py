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
    """USP on the first half of the world alone (a dp x sp mesh's sp group, Ulysses degree 1 and 2),
    against float64; then a group over the whole world still forms on every rank (USP's subgroups are
    made by the half's ranks alone, without taking a number from torch's count of groups on them)."""
    import torch.distributed as dist

    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    results = []
    if rank < half:
        full = full_inputs(41, 1, N_LOCAL * half, H, 2, D, torch.float32)
        ref = reference_grads(*full, causal=True)
        for u in (1, 2):
            errs = sharded_errors(
                full, ref, torch.float32, "zigzag", groups[0], causal=True, strategy="usp", ulysses_degree=u
            )
            results.append((("half of the world", u, str(torch.float32)), errs))
    whole = torch.ones(1)
    dist.all_reduce(whole, group=dist.new_group(list(range(world))))
    return results, whole.item()


_results = results_by_world(_cases, timeout=400)


@pytest.mark.parametrize("world", [4])  # 6 (3 x 2, 2 x 3) left out for the suite's time
def test_usp_matches_float64(world):
    assert_within_bounds([r[0] for r in _results(world)], lambda key: key[3])


@pytest.mark.parametrize("world", [4])
def test_usp_on_half_of_the_world_matches_float64_and_leaves_group_creation_in_step(world):
    halves = [r[2] for r in _results(world)]
    assert all(len(cases) == 2 for cases, _ in halves[: world // 2])
    assert_within_bounds([cases for cases, _ in halves], lambda key: key[2])
    assert [whole for _, whole in halves] == [float(world)] * world


@pytest.mark.parametrize("world", [4])
def test_bad_degree_raises_on_every_rank(world):
    for rank, (_, bad, _) in enumerate(_results(world)):
        assert bad is not None and "ulysses_degree" in bad, (rank, bad)
