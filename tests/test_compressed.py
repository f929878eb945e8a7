"""Compressed entries beside the sharded keys (`burst.attention(..., compressed=burst.CompressedKV)`,
DeepSeek-V4's CSA and HCA) against float64 attention written out here on the full sequence: the raw
keys under a causal sliding window, the entries each query may see (entry w once position
(w+1)*RATE - 1 is reached; with indices, only the chosen ones, some slots -1 and one pointing at an
entry not yet complete, which must be dropped), and the sinks, in one softmax.

One world per size, cases looped inside: burst (whole blocks and served chunks), ring, allgather,
ulysses, usp and cqs (the entries fold in after any strategy's forward), three layouts, HCA-like
(every visible entry) and CSA-like (a pruning choice), with and without sinks, float64 and bf16;
out, lse, dq, dk, dv, and the entries' and sinks' gradients summed over the ranks. Beside them,
values that are the keys (`v is k`, DeepSeek-V4's K = V): exact, and one block travels where two
did.
"""

from __future__ import annotations

import burst
import pytest
import torch
import torch.distributed as dist

from cases import TOL, full_inputs, rel_err, strategy_kwargs
from world import results_by_world

# 8 tokens a rank: two entries complete in each shard, and the window (7) reaches into the shard before
N_LOCAL, H, HK, D, B, RATE, TOPK, WINDOW = 8, 4, 1, 8, 2, 4, 3, 7
# folded after any; burst's backward takes the key side by default here (1 KV head of 4), the query side forced
STRATEGIES = (
    "burst",
    "burst:chunk_rows=4",  # two chunks a shard
    "burst:backward_side=queries",
    "ring",
    "allgather",
    "ulysses",
    "usp",
    "cqs",
)


def entries_and_sinks(n_entries: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ck = torch.randn(B, n_entries, HK, D, generator=g, dtype=torch.float64)
    cv = torch.randn(B, n_entries, HK, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return ck, cv, sinks


def chosen_entries(n: int, n_entries: int, seed: int) -> torch.Tensor:
    """(B, n, TOPK) entry numbers: one complete entry at random, -1, and the entry that contains the
    query itself (not complete before the window's last token: the visibility rule must drop it)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n)
    complete = (rows + 1) // RATE  # entries 0 .. complete-1 have ended at or before the row
    earlier = (torch.rand(B, n, 1, generator=g) * complete[None, :, None]).long()
    earlier = torch.where(complete[None, :, None] > 0, earlier, -1)
    own = (rows // RATE).clamp(max=n_entries - 1)[None, :, None].expand(B, n, 1)
    return torch.cat([earlier, torch.full((B, n, 1), -1), own], dim=2)


def allowed_pairs(n: int, n_entries: int, indices) -> torch.Tensor:
    """(B, n, n + n_entries) bool, by loops independent of burst.masks."""
    allowed = torch.zeros(B, n, n + n_entries, dtype=torch.bool)
    for i in range(n):
        for j in range(max(0, i - WINDOW), i + 1):
            allowed[:, i, j] = True
        for w in range(n_entries):
            if (w + 1) * RATE - 1 <= i:
                allowed[:, i, n + w] = (
                    True if indices is None else torch.tensor([w in indices[b, i].tolist() for b in range(B)])
                )
    return allowed


def reference(full, ck, cv, sinks, allowed):
    """float64 (out, lse, dq, dk, dv, dck, dcv, dsinks) by autograd through a softmax written here."""
    q, k, v, dout = (t.detach().clone().requires_grad_() for t in full)
    ck, cv, sinks = (t.detach().clone().requires_grad_() if t is not None else None for t in (ck, cv, sinks))
    keys, values = torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
    keys, values = (t.repeat_interleave(H // HK, dim=2) for t in (keys, values))
    scores = torch.einsum("bihd,bjhd->bhij", q, keys) * D**-0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(B, H, scores.shape[2], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])[..., : keys.shape[1]]
    out = torch.einsum("bhij,bjhd->bihd", probs, values)
    out.backward(dout)
    grads = [t.grad for t in (q, k, v, ck, cv)] + [sinks.grad if sinks is not None else None]
    return [out.detach(), lse.detach()] + grads


def _errors(full, ref, ck, cv, sinks, indices, dtype, layout, strategy):
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    ck_, cv_ = (t.detach().to(dtype).requires_grad_() for t in (ck, cv))
    sinks_ = sinks.detach().to(dtype).requires_grad_() if sinks is not None else None
    mine = burst.shard(indices, layout=layout) if indices is not None else None
    compressed = burst.CompressedKV(ck_, cv_, RATE, indices=mine)
    out, lse = burst.attention(
        q,
        k,
        v,
        layout=layout,
        causal=True,
        window=(WINDOW, 0),
        return_lse=True,
        sinks=sinks_,
        compressed=compressed,
        **strategy_kwargs(strategy),
    )
    out.backward(dout.to(dtype))
    summed = [t.grad.double() for t in (ck_, cv_)] + ([sinks_.grad.double()] if sinks is not None else [])
    for g in summed:
        dist.all_reduce(g)
    theirs = [burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref[:5]]
    errors = {
        name: rel_err(x, r)
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (theirs[0], *theirs[2:]))
    }
    errors["lse"] = (lse.double() - theirs[1]).abs().max().item()
    errors["dck"], errors["dcv"] = rel_err(summed[0], ref[5]), rel_err(summed[1], ref[6])
    if sinks is not None:
        errors["dsinks"] = rel_err(summed[2], ref[7])
    errors["nan"] = any(bool(torch.isnan(t).any()) for t in (out, lse, q.grad, k.grad, v.grad))
    return errors


def _cases(rank, world):
    n = N_LOCAL * world
    n_entries = n // RATE
    full = full_inputs(41, B, n, H, HK, D, torch.float64)
    ck, cv, sinks = entries_and_sinks(n_entries, 7)
    results = []
    for kind, indices in (("hca", None), ("csa", chosen_entries(n, n_entries, world))):
        allowed = allowed_pairs(n, n_entries, indices)
        for with_sinks in _sinks_options(kind, world):
            s = sinks if with_sinks else None
            ref = reference(full, ck, cv, s, allowed)
            for layout in ("contiguous", "zigzag", "striped"):
                for dtype in (torch.float64, torch.bfloat16):
                    for strategy in STRATEGIES if dtype == torch.float64 else ("burst",):
                        errs = _errors(full, ref, ck, cv, s, indices, dtype, layout, strategy)
                        results.append(((strategy, layout, kind, with_sinks, str(dtype)), errs))
    return results, _values_are_keys(full), _no_entries_yet(full)


def _no_entries_yet(full):
    """Zero entries (B, 0, HK, D), a prompt shorter than one entry's span: plain windowed attention, by strategy
    (its first tile of no keys killed the process with SIGFPE in aten's CPU op)."""
    none = torch.zeros(B, 0, HK, D, dtype=torch.float64)
    ref = reference(full, none, none, None, allowed_pairs(full[0].shape[1], 0, None))
    errors = {}
    for strategy in STRATEGIES:
        q, k, v, dout = (burst.shard(t).detach().requires_grad_() for t in full)
        entries = burst.CompressedKV(none.clone().requires_grad_(), none.clone().requires_grad_(), RATE)
        out = burst.attention(q, k, v, causal=True, window=(WINDOW, 0), compressed=entries, **strategy_kwargs(strategy))
        out.backward(dout)
        theirs = [burst.shard(t) for t in (ref[0], *ref[2:5])]
        errors[strategy] = max(rel_err(x, r) for x, r in zip((out, q.grad, k.grad, v.grad), theirs))
    return errors


def _sinks_options(kind, world):
    """Each kind with and without sinks at 1 and 2 ranks; at 4 (the ring of more than two steps) HCA with
    the sinks and CSA without: each kind and each sinks option still meets every layout and strategy."""
    if world <= 2:
        return (False, True)
    return (kind == "hca",)


def _values_are_keys(full):
    """v is k (DeepSeek-V4's shared K = V): one block travels. Against the reference with v = k
    (the tensor's gradient: the sum of both roles), and the bytes against the same values copied."""
    q_full, k_full, _, dout_full = full
    none = torch.zeros(B, 0, HK, D, dtype=torch.float64)  # no entries
    ref = reference([q_full, k_full, k_full, dout_full], none, none, None, allowed_pairs(q_full.shape[1], 0, None))
    out = {}
    for strategy in ("burst", "burst:chunk_rows=0", "ring", "allgather"):
        for layout in ("contiguous", "zigzag"):
            q, k, dout = (burst.shard(t, layout=layout).detach() for t in (q_full, k_full, dout_full))
            sent = {}
            for shared in (True, False):
                qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
                with burst.CommStats() as stats:
                    got = burst.attention(
                        qq,
                        kk,
                        kk if shared else kk.clone(),
                        layout=layout,
                        causal=True,
                        window=(WINDOW, 0),
                        **strategy_kwargs(strategy),
                    )
                    got.backward(dout)
                sent[shared] = (stats.sent("forward"), stats.sent("backward"))
                if shared:
                    theirs = [burst.shard(t, layout=layout) for t in (ref[0], ref[2], ref[3] + ref[4])]
                    errors = [rel_err(x, r) for x, r in zip((got, qq.grad, kk.grad), theirs)]
            out[(strategy, layout)] = (max(errors), sent[True], sent[False])
    return out


_results = results_by_world(_cases)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_entries_join_the_sharded_keys_exactly(world):
    failures = []
    for rank, (cases, _, _) in enumerate(_results(world)):
        for key, errs in cases:
            bound = TOL[getattr(torch, key[-1].removeprefix("torch."))]
            measured = {n: e for n, e in errs.items() if n != "nan"}
            if errs["nan"] or not all(e <= bound for e in measured.values()):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures)
    assert len(_results(world)[0][0]) == (2 * 2 if world <= 2 else 2) * 3 * (len(STRATEGIES) + 1)


@pytest.mark.parametrize("world", [2, 4])
def test_values_that_are_the_keys_travel_once(world):
    for rank, (_, shared, _) in enumerate(_results(world)):
        for (strategy, layout), (error, (fwd, bwd), (fwd_copy, bwd_copy)) in shared.items():
            assert error <= TOL[torch.float64], (rank, strategy, layout, error)
            assert fwd_copy > 0 and 2 * fwd == fwd_copy or strategy == "allgather", (
                rank,
                strategy,
                layout,
                fwd,
                fwd_copy,
            )
            # ring's backward, and burst's key side (its default with 1 KV head of 4), move K, V and their
            # gradients: one block and one gradient
            if strategy != "allgather":
                assert 2 * bwd == bwd_copy, (rank, strategy, layout, bwd, bwd_copy)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_no_entries_yet_is_plain_attention(world):
    for rank, (_, _, errors) in enumerate(_results(world)):
        assert errors and all(e <= TOL[torch.float64] for e in errors.values()), (rank, errors)


def test_the_entries_change_the_answer():
    """Without the entries, or with every visible entry in place of the choice, the reference moves."""
    n = 4 * N_LOCAL
    full = full_inputs(41, B, n, H, HK, D, torch.float64)
    ck, cv, _ = entries_and_sinks(n // RATE, 7)
    chosen = allowed_pairs(n, n // RATE, chosen_entries(n, n // RATE, 4))
    every = allowed_pairs(n, n // RATE, None)
    window_only = every.clone()
    window_only[:, :, n:] = False
    outs = [reference(full, ck, cv, None, a)[0] for a in (chosen, every, window_only)]
    assert rel_err(outs[0], outs[1]) > 10 * TOL[torch.bfloat16]
    assert rel_err(outs[1], outs[2]) > 10 * TOL[torch.bfloat16]
    assert (chosen[:, :, n:].sum(-1) < every[:, :, n:].sum(-1)).float().mean() > 0.5  # the choice prunes


def test_bad_entries_raise_before_any_communication():
    q = torch.randn(1, 8, H, D)
    k = q[:, :, :HK]
    ck = torch.randn(1, 2, HK, D)
    for bad, kind, text in (
        (burst.CompressedKV(ck, ck, 0), ValueError, "rate"),
        (burst.CompressedKV(ck[..., :4], ck, RATE), ValueError, "headdim"),
        (burst.CompressedKV(ck.double(), ck.double(), RATE), ValueError, "float"),
        (burst.CompressedKV(torch.randn(1, 3, HK, D), torch.randn(1, 3, HK, D), RATE), ValueError, "cover"),
        (burst.CompressedKV(ck, ck, RATE, torch.zeros(1, 8, 2)), TypeError, "indices"),
        (burst.CompressedKV(ck, ck, RATE, torch.full((1, 8, 2), 2)), ValueError, "indices"),
        ((ck, ck), TypeError, "CompressedKV"),
    ):
        with pytest.raises(kind, match=text):
            burst.attention(q, k, k, causal=True, compressed=bad)
