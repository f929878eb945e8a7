"""Index selections per KV head and in blocks (`indices=` of shape (batch, seqlen, kv_heads, topk), and
`burst.BlockIndices(blocks, block_size)`) against float64 attention on the full sequence.

The reference runs each KV head's group of query heads on its own, with that head's selection as a
mask built here by a loop independent of burst.masks.selection. Each query chooses, per KV head,
keys (or blocks) of its own drawing, itself always (so no row is empty), some -1 and one past the
causal edge. One world per size (1-3 ranks: 3 is odd and a ring of more than two steps; 4 took no
other path), cases looped inside: burst (both backward sides, served chunks), ring
and allgather; causal, a window and documents; GQA 4/2 and 8/1; float64; out, lse, dq, dk, dv. A block
choice travels in burst's query-side backward as fewer bytes than the same choice as key positions.
"""

from __future__ import annotations

import burst
import pytest
import torch
from burst.kernels.reference import full_reference

from cases import TOL, full_inputs, reference_mask, rel_err, strategy_kwargs
from world import results_by_world

N_LOCAL, D, B, TOPK, BLOCK = 16, 8, 2, 3, 4
STRATEGIES = ("burst", "burst:backward_side=queries", "burst:chunk_rows=8", "ring", "allgather")


def masks(n: int) -> dict:
    return {
        "causal": {"causal": True},
        "window": {"causal": True, "window": (9, 0)},
        "documents": {"causal": True, "cu_seqlens": (0, n // 3, 2 * n // 3 + 1, n)},
    }


def chosen(n: int, kv_heads: int, block: int, seed: int) -> torch.Tensor:
    """(B, n, kv_heads, TOPK + 2) entries: the query's own key (block), TOPK earlier at random per head,
    and -1 or one past the causal edge."""
    g = torch.Generator().manual_seed(seed)
    own = torch.arange(n)[None, :, None, None].expand(B, n, kv_heads, 1) // block
    earlier = (torch.rand(B, n, kv_heads, TOPK, generator=g) * (own + 1)).long()
    beyond = torch.where(torch.rand(B, n, kv_heads, 1, generator=g) < 0.5, -1, (own + 1).clamp(max=(n - 1) // block))
    return torch.cat([own, earlier, beyond], dim=3)


def selection_mask(entries: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """(B, kv_heads, n, n) bool: query i attends key j when it chose j's block (block 1: j itself)."""
    mask = torch.zeros(B, entries.shape[2], n, n, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            for h in range(entries.shape[2]):
                for e in entries[b, i, h].tolist():
                    if e >= 0:
                        mask[b, h, i, e * block : min(n, (e + 1) * block)] = True
    return mask


def reference(full, allowed):
    """float64 out, lse, dq, dk, dv: each batch row and KV head's group of query heads on its own mask."""
    q, k, v, dout = full
    hk = k.shape[2]
    group = q.shape[2] // hk
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for b in range(B):
        for h in range(hk):
            heads = slice(h * group, (h + 1) * group)
            o, l, gq, gk, gv = full_reference(
                q[b : b + 1, :, heads],
                k[b : b + 1, :, h : h + 1],
                v[b : b + 1, :, h : h + 1],
                dout[b : b + 1, :, heads],
                mask=allowed[b, h],
            )
            out[b : b + 1, :, heads], lse[b : b + 1, heads], dq[b : b + 1, :, heads] = o, l, gq
            dk[b : b + 1, :, h : h + 1], dv[b : b + 1, :, h : h + 1] = gk, gv
    return out, lse, dq, dk, dv


def _errors(full, ref, selection, layout, **kwargs):
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if isinstance(selection, burst.BlockIndices):
        mine = burst.BlockIndices(burst.shard(selection.blocks, layout=layout), selection.block_size)
    else:
        mine = burst.shard(selection, layout=layout)
    with burst.CommStats() as stats:
        out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, indices=mine, **kwargs)
        out.backward(dout)
    theirs = [burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref]
    errors = {
        name: rel_err(x, r)
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (theirs[0], *theirs[2:]))
    }
    errors["lse"] = (lse.double() - theirs[1]).abs().max().item()
    return errors, stats.sent("backward")


def _cases(rank, world):
    n = N_LOCAL * world
    results, sent = [], {}
    for heads, kv_heads in ((4, 2), (8, 1)):
        full = full_inputs(41, B, n, heads, kv_heads, D, torch.float64)
        for form, block in (("per head", 1), ("blocks per head", BLOCK), ("blocks", BLOCK)):
            entries = chosen(n, kv_heads, block, seed=world + block)
            if form == "blocks":  # one choice for every head: the (batch, seqlen, topk) form
                entries = entries[:, :, 0]
            per_head = entries if entries.dim() == 4 else entries[:, :, None].expand(B, n, kv_heads, -1)
            selection = entries if block == 1 else burst.BlockIndices(entries, block)
            for name, mask in masks(n).items():
                allowed = selection_mask(per_head, n, block) & reference_mask(n, **mask)
                ref = reference(full, allowed)
                for strategy in STRATEGIES:
                    for layout in ("contiguous", "zigzag") if strategy == "burst" else ("contiguous",):
                        errs, _ = _errors(full, ref, selection, layout, **mask, **strategy_kwargs(strategy))
                        results.append(((heads, kv_heads, form, name, strategy, layout), errs))
        # the query side carries each row's choice: blocks against the same choice as key positions
        blocks = chosen(n, kv_heads, BLOCK, seed=world)
        positions = (blocks[..., None] * BLOCK + torch.arange(BLOCK)).flatten(-2)
        positions = torch.where(
            blocks[..., None].expand(*blocks.shape, BLOCK).flatten(-2) < 0, -1, positions.clamp(max=n - 1)
        )
        for label, selection in (("blocks", burst.BlockIndices(blocks, BLOCK)), ("positions", positions)):
            side = {"strategy": "burst", "backward_side": "queries", "causal": True}
            allowed = selection_mask(blocks, n, BLOCK) & reference_mask(n, causal=True)
            errs, sent[(heads, kv_heads, label)] = _errors(
                full, reference(full, allowed), selection, "contiguous", **side
            )
            results.append(((heads, kv_heads, "bytes", label, "burst:backward_side=queries", "contiguous"), errs))
    return results, sent


_results = results_by_world(_cases)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_selections_per_kv_head_and_in_blocks_are_exact(world):
    failures = []
    for rank, (cases, _) in enumerate(_results(world)):
        for key, errs in cases:
            if not all(e <= TOL[torch.float64] for e in errs.values()):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_a_block_choice_travels_in_fewer_bytes_than_its_key_positions(world):
    total = {}  # over the ranks: under causal masks only the later ranks' queries travel
    for _, sent in _results(world):
        for key, value in sent.items():
            total[key] = total.get(key, 0) + value
    for heads, kv_heads in ((4, 2), (8, 1)):
        assert 0 < total[(heads, kv_heads, "blocks")] < total[(heads, kv_heads, "positions")], total


def test_each_head_sees_only_its_own_choice():
    """The per-head answer differs from every head attending head 0's choice (a selection read for one
    head only would pass the shared-form tests)."""
    n = 32
    full = full_inputs(41, B, n, 4, 2, D, torch.float64)
    entries = chosen(n, 2, 1, seed=3)
    mine = reference(full, selection_mask(entries, n, 1) & reference_mask(n, causal=True))[0]
    shared = entries[:, :, :1].expand(B, n, 2, -1)
    wrong = reference(full, selection_mask(shared, n, 1) & reference_mask(n, causal=True))[0]
    assert rel_err(mine, wrong) > 0.1
    out = burst.attention(*(t.float() for t in full[:3]), causal=True, indices=entries)
    assert rel_err(out, mine) < TOL[torch.float32]


def test_bad_selections_raise_before_any_communication():
    q = torch.randn(1, 8, 4, D)
    k = q[:, :, :2]
    for bad, kind, words in (
        (torch.zeros(1, 8, 3, 2, dtype=torch.long), ValueError, "kv_heads"),
        (burst.BlockIndices(torch.full((1, 8, 2), 2), 4), ValueError, "blocks of 4 keys"),
        (burst.BlockIndices(torch.zeros(1, 8, 2), 4), TypeError, "BlockIndices blocks"),
    ):
        with pytest.raises(kind, match=words):
            burst.attention(q, k, k, causal=True, indices=bad)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        burst.BlockIndices(torch.zeros(1, 8, 2, dtype=torch.long), 0)
