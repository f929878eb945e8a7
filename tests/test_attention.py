"""burst.attention on real local gloo worlds against float64 attention on the full sequence.

One world per size; every strategy x causal x (MHA, GQA, MQA) x dtype runs inside it at 1 and 2 ranks,
and at 3 (odd, a ring of more than two steps; 4 took no other path) in the two dtypes the merge rounds
differently (float32 and bfloat16; float16 and float64 take their paths at 1 and 2).
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import assert_within_bounds, full_inputs, reference_grads, sharded_errors
from world import results_by_world

STRATEGIES = ("burst", "ring", "allgather", "auto")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADS = 4


def _dtypes(world):
    return DTYPES if world <= 2 else DTYPES[:2]


def _all_cases(rank, world):
    results = []
    seqlen = 6 * world
    for causal in (False, True):
        for kv_heads in (4, 2, 1):
            for dtype in _dtypes(world):
                full = full_inputs(1000 + kv_heads, 2, seqlen, HEADS, kv_heads, 8, dtype)
                ref = reference_grads(*full, causal=causal)
                for strategy in STRATEGIES:
                    if strategy == "auto" and dtype != torch.float32:
                        continue
                    errs = sharded_errors(full, ref, dtype, strategy=strategy, causal=causal)
                    results.append(((strategy, causal, kv_heads, str(dtype)), errs))
    # One token per rank: distflash's last step on an even world splits a block of one into halves of 0 and 1
    # rows (a 0-row kernel call killed the rank: SIGFPE in aten's CPU flash op).
    full = full_inputs(7, 1, world, HEADS, 1, 8, torch.float32)
    one_each = sharded_errors(
        full, reference_grads(*full, causal=True), torch.float32, strategy="distflash", causal=True
    )
    results.append((("distflash, one token a rank", True, 1, "torch.float32"), one_each))
    return results


_results = results_by_world(_all_cases)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_matches_float64_reference(world):
    results = _results(world)  # per rank: ((strategy, causal, kv_heads, dtype), errors)
    assert sum(len(cases) for cases in results) == world * (2 * 3 * (3 * len(_dtypes(world)) + 1) + 1)
    assert_within_bounds(results, lambda key: key[3])


def test_the_backward_keeps_dout_as_handed():
    """The backward neither writes into the gradient autograd hands it nor copies it when its width is
    the output's (F.pad copied it whole even when it padded nothing: a dout-sized tensor at the peak,
    1.12x SDPA's peak on the H200); MLA's narrower values still get a padded copy."""
    from burst.strategies.base import _as_wide_as

    dout, out = torch.randn(2, 16, 4, 8), torch.empty(2, 16, 4, 8)
    assert _as_wide_as(dout, out) is dout
    narrow = torch.randn(2, 16, 4, 6)
    wide = _as_wide_as(narrow, out)
    assert wide.shape == out.shape and torch.equal(wide[..., :6], narrow) and not wide[..., 6:].any()
    q, k, v, g = full_inputs(5, 1, 32, 4, 2, 8, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    handed = g.clone()
    burst.attention(q, k, v, causal=True).backward(handed)
    assert torch.equal(handed, g)


def test_what_a_port_from_flash_attn_meets_is_refused_with_the_way():
    """flash_attn's varlen shape (total_tokens, heads, headdim) and a length the layout cannot split are refused
    naming what to do instead, and the padding advice holds for full attention too (its own document)."""
    q = torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match=r"q must be 4-D .*q.unsqueeze\(0\) with cu_seqlens="):
        burst.attention(q, q, q, cu_seqlens=[0, 5, 12])
    with pytest.raises(ValueError, match=r"must be 4-D") as refused:
        burst.attention(q[None, None], q[None, None], q[None, None])
    assert "unsqueeze" not in str(refused.value)
    with pytest.raises(ValueError, match=r"pad the batch at the end to 6 tokens.*cu_seqlens=\[0, 5, 6\]"):
        burst.shard(torch.randn(1, 5, 2, 8), layout="zigzag")
    # the advice itself: the padding as its own document leaves the real tokens' full attention as it was
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    padded = burst.attention(q, k, v, causal=False, cu_seqlens=[0, 5, 6])[:, :5]
    weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q[:, :5], k[:, :5]) / 8**0.5, dim=-1)
    alone = torch.einsum("bhqk,bkhd->bqhd", weights, v[:, :5])  # float64 attention on the real tokens alone
    assert torch.allclose(padded, alone, atol=1e-12)
