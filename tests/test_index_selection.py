"""Index selections (`burst.attention(..., indices=)`, DeepSeek sparse attention's top-k keys per
query) against float64 attention on the full sequence with the selection as a mask built here.

Each query at global position i chooses TOPK keys among 0..i (itself always, so no row is empty), some
slots -1 (none) and one pointing past i (the causal mask must still drop it): most keys are not
selected, so a strategy that ignored the selection would fail. One world per size, cases looped
inside: burst (whole blocks and served chunks: the indices travel with the queries), ring and
allgather, the three layouts, causal and causal with a window, float64 and bf16; out, lse, dq, dk, dv.
Strategies that move queries elsewhere refuse with a clear error, on every rank.
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import TOL, full_inputs, reference_grads, reference_mask, rel_err, strategy_kwargs
from world import results_by_world, value_error_text

N_LOCAL, H, HK, D, B, TOPK = 16, 4, 2, 8, 2, 5
# burst's backward takes the key side by default here (2 KV heads of 4; the chosen keys stay with their
# queries), the query side forced (the chosen keys travel with the queries)
STRATEGIES = ("burst", "burst:chunk_rows=0", "burst:chunk_rows=8", "burst:backward_side=queries", "ring", "allgather")
REFUSING = ("ulysses", "usp", "cqs", "distflash")


def chosen_keys(n: int, seed: int) -> torch.Tensor:
    """(B, n, TOPK) global key positions: self, three earlier keys at random, and -1 or a later key."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n)
    earlier = (torch.rand(B, n, 3, generator=g) * (rows[None, :, None] + 1)).long()  # in 0..i
    last = torch.where(torch.rand(B, n, 1, generator=g) < 0.5, -1, (rows[None, :, None] + 3).clamp(max=n - 1))
    return torch.cat([rows[None, :, None].expand(B, n, 1), earlier, last], dim=2)


def selection_mask(indices: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n, n) bool from the indices, by a loop independent of burst.masks.selection."""
    mask = torch.zeros(B, n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            for j in indices[b, i].tolist():
                if j >= 0:
                    mask[b, i, j] = True
    return mask


def _reference(full, allowed):
    """float64 out, lse, dq, dk, dv with one mask per batch row (reference_grads takes one mask)."""
    rows = [reference_grads(*(t[b : b + 1] for t in full), mask=allowed[b]) for b in range(B)]
    return [torch.cat([r[i] for r in rows]) for i in range(5)]


def _errors(full, ref, indices, dtype, layout, **kwargs):
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    mine = burst.shard(indices, layout=layout)
    with burst.CommStats() as stats:
        out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, indices=mine, **kwargs)
        out.backward(dout.to(dtype))
    theirs = [burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref]
    errors = {
        name: rel_err(x, r)
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (theirs[0], *theirs[2:]))
    }
    errors["lse"] = (lse.double() - theirs[1]).abs().max().item()
    errors["nan"] = any(bool(torch.isnan(t).any()) for t in (out, lse, q.grad, k.grad, v.grad))
    errors["pairs"] = stats.pairs("forward")
    return errors


def _layouts(world, name):
    return ("contiguous", "zigzag", "striped") if world <= 2 else FOUR_RANK_LAYOUTS[name]


def _cases(rank, world):
    n = N_LOCAL * world
    full = full_inputs(31, B, n, H, HK, D, torch.float64)
    indices = chosen_keys(n, world)
    results = []
    for name, mask in (("causal", {"causal": True}), ("window", {"causal": True, "window": (9, 0)})):
        allowed = selection_mask(indices, n) & reference_mask(n, causal=True, window=mask.get("window"))
        ref = _reference(full, allowed)
        for layout in _layouts(world, name):
            for dtype in (torch.float64, torch.bfloat16):
                for strategy in STRATEGIES if dtype == torch.float64 else ("burst", "ring"):
                    errs = _errors(full, ref, indices, dtype, layout, **mask, **strategy_kwargs(strategy))
                    results.append(((strategy, layout, name, str(dtype)), errs))
    q = burst.shard(full[0], layout="zigzag")
    mine = burst.shard(indices, layout="zigzag")
    refusals = {
        s: value_error_text(
            lambda s=s: burst.attention(
                q, q[:, :, :HK], q[:, :, :HK], layout="zigzag", causal=True, strategy=s, indices=mine
            )
        )
        for s in REFUSING
    }
    # another integer dtype on one rank: the rows' choices travel with the queries, one message size per dtype
    # (the queries-side backward died with a size mismatch mid-ring, leaving the other ranks waiting)
    other = mine.int() if rank == 0 else mine
    refusals["int32 on one rank"] = value_error_text(
        lambda: burst.attention(q, q[:, :, :HK], q[:, :, :HK], layout="zigzag", causal=True, indices=other)
    )
    with burst.CommStats() as stats:
        burst.attention(q, q[:, :, :HK], q[:, :, :HK], layout="zigzag", causal=True)
    return results, refusals, stats.pairs("forward")


_results = results_by_world(_cases)

# At 4 ranks (the ring of more than two steps) each layout once: causal on zigzag and striped, the window
# on contiguous shards; at 1 and 2 every layout with every mask.
FOUR_RANK_LAYOUTS = {"causal": ("zigzag", "striped"), "window": ("contiguous",)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_selected_keys_only_in_every_layout(world):
    failures = []
    for rank, (cases, _, causal_pairs) in enumerate(_results(world)):
        for key, errs in cases:
            bound = TOL[getattr(torch, key[-1].removeprefix("torch."))]
            measured = {n: e for n, e in errs.items() if n not in ("nan", "pairs")}
            if errs["nan"] or not all(e <= bound for e in measured.values()):
                failures.append(f"rank {rank} {key}: {errs}")
            if errs["pairs"] >= causal_pairs:  # tiles nothing selected are skipped, the rest counted by selection
                failures.append(f"rank {rank} {key}: {errs['pairs']} pairs, causal {causal_pairs}")
    assert not failures, "\n".join(failures)
    layouts = sum(len(_layouts(world, name)) for name in ("causal", "window"))
    assert len(_results(world)[0][0]) == layouts * (len(STRATEGIES) + 2)


def test_the_selection_changes_the_answer():
    n = 32
    full = full_inputs(31, B, n, H, HK, D, torch.float64)
    selected = _reference(full, selection_mask(chosen_keys(n, 1), n) & reference_mask(n, causal=True))[0]
    causal = reference_grads(*full, causal=True)[0]
    assert rel_err(selected, causal) > 10 * TOL[torch.bfloat16]


@pytest.mark.parametrize("world", [2, 4])
def test_strategies_that_move_queries_elsewhere_and_indices_of_another_dtype_refuse_on_every_rank(world):
    for _, refusals, _ in _results(world):
        for strategy, text in refusals.items():
            assert text is not None and "indices" in text, (strategy, text)
        assert "torch.int32" in refusals["int32 on one rank"], refusals["int32 on one rank"]


def test_bad_indices_raise_before_any_communication():
    q = torch.randn(1, 8, H, D)
    k = q[:, :, :HK]
    for bad, kind in (
        (torch.zeros(1, 8, 2), TypeError),
        (torch.zeros(1, 7, 2, dtype=torch.long), ValueError),
        (torch.full((1, 8, 2), 8), ValueError),
        (torch.full((1, 8, 2), -2), ValueError),
    ):
        with pytest.raises(kind, match="indices"):
            burst.attention(q, k, k, causal=True, indices=bad)
