"""strategy="ulysses" against float64 attention: every layout and mask, MHA and GQA (including one KV
head on four ranks), fp32 and bf16; all-to-all volumes; head counts it cannot split raise everywhere.

One world per size (2, 4); the cases loop inside it: every layout with every mask at 2 ranks, at 4 one
layout per mask (the three in turn), with every head shape and dtype.
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import assert_within_bounds, full_inputs, reference_grads, reference_mask, sharded_errors
from world import results_by_world, value_error_text

N_LOCAL, H, D = 8, 4, 8


def _masks(seqlen):
    nb = seqlen // 4
    layout = torch.rand(nb, nb, generator=torch.Generator().manual_seed(3)) < 0.5
    layout |= torch.eye(nb, dtype=torch.bool)
    return {
        "full": {},
        "causal": dict(causal=True),
        "window": dict(causal=True, window=(5, 0)),
        "documents": dict(causal=True, cu_seqlens=[0, 5, seqlen // 2 + 1, seqlen]),
        "block_sparse": dict(block_sparse=burst.BlockSparseMask(4, layout)),
    }


def _cases(rank, world):
    results = []
    seqlen = N_LOCAL * world
    layouts = ("contiguous", "zigzag", "striped")
    for i, (name, kwargs) in enumerate(_masks(seqlen).items()):
        extra = {k: v for k, v in kwargs.items() if k != "causal"}
        allowed = reference_mask(seqlen, causal=kwargs.get("causal", False), **extra)
        for kv_heads in (4, 2, 1):
            for dtype in (torch.float32, torch.bfloat16) if name == "causal" else (torch.float32,):
                full = full_inputs(10 + kv_heads, 2, seqlen, H, kv_heads, D, dtype)
                ref = reference_grads(*full, causal=False, mask=allowed)
                for layout in layouts if world == 2 else (layouts[i % 3],):
                    errs = sharded_errors(full, ref, dtype, layout=layout, strategy="ulysses", **kwargs)
                    results.append(((name, layout, kv_heads, str(dtype)), errs))
    return results, _volumes(rank, world), _bad_heads(rank, world)


def _volumes(rank, world):
    """Bytes per phase for MHA and for one KV head."""
    out = {}
    for kv_heads in (4, 1):
        q = torch.randn(1, N_LOCAL, H, D, requires_grad=True)
        k = torch.randn(1, N_LOCAL, kv_heads, D, requires_grad=True)
        v = torch.randn(1, N_LOCAL, kv_heads, D, requires_grad=True)
        with burst.CommStats() as stats:
            burst.attention(q, k, v, strategy="ulysses", causal=True).sum().backward()
        out[kv_heads] = (stats.sent("forward"), stats.sent("backward"))
    q = torch.randn(1, N_LOCAL, H, D)
    for strategy in ("ulysses", "usp", "burst"):  # pairs of all heads: each rank counts its heads' share
        with burst.CommStats() as stats:
            burst.attention(q, q, q, strategy=strategy, causal=True, layout="zigzag")
        out[strategy] = stats.pairs("forward")
    return out


def _bad_heads(rank, world):
    x = torch.randn(1, N_LOCAL, 6, D)
    return value_error_text(lambda: burst.attention(x, x, x, strategy="ulysses"))


_results = results_by_world(_cases, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_float64(world):
    assert_within_bounds([r[0] for r in _results(world)], lambda key: key[-1])


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_volumes(world):
    """Forward: Q, K, V out and O back, (G-1)/G of each; one KV head reaches each of the G ranks once.
    Backward: Q, dO, K, V, D, lse out; dQ, dK, dV (fp32) back."""
    n, g = N_LOCAL, world
    q_blk = n * H * D * 4
    seqlen = n * g
    pairs = {name: sum(volumes.pop(name) for _, volumes, _ in _results(world)) for name in ("ulysses", "usp", "burst")}
    # summed over the ranks, the causal mask's pairs: burst bench's useful FLOPs (Ulysses' had counted G times)
    assert pairs == dict.fromkeys(pairs, seqlen * (seqlen + 1) // 2), pairs
    for rank, (_, volumes, _) in enumerate(_results(world)):
        for kv_heads, (fwd, bwd) in volumes.items():
            kv_sent = n * max(kv_heads, g) * D * 4 // g * (g - 1)  # per K (or V): (G-1) blocks of the per-rank share
            q_sent = q_blk // g * (g - 1)
            stat_sent = n * H * 4 // g * (g - 1)
            assert fwd == 2 * q_sent + 2 * kv_sent + stat_sent, (rank, kv_heads, fwd)
            assert bwd == 3 * q_sent + 4 * kv_sent + 2 * stat_sent, (rank, kv_heads, bwd)


def test_heads_that_do_not_split_raise_on_every_rank():
    for rank, (_, _, message) in enumerate(_results(4)):
        assert message is not None and "valid world sizes" in message, (rank, message)
