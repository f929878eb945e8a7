"""Attention sinks (`burst.attention(..., sinks=s)`, gpt-oss's s_aux) against float64 attention with the
sink column on the full sequence (reference.attention: concatenate, softmax, drop the column).

One world per size (1-3 ranks: 3 is odd and a ring of more than two steps; 4 took no other path, and
ulysses, which 3 ranks refuse, runs at 1 and 2), cases looped inside: every strategy, the three layouts, causal or
not, a sliding window, packed documents cut per document, GQA; out, lse, dq, dk, dv and the sinks'
gradient (each rank's share, summed over the ranks) in float64 and, for burst, ring and ulysses, in
bfloat16 (within the bf16 bound of reference.BOUNDS, no NaN); decode_attention with sinks on a
sharded cache with invalid entries; bad sinks refused; burst.check with sinks.
"""

from __future__ import annotations

import burst
import pytest
import torch
import torch.distributed as dist
from burst.inference import decode_attention
from burst.kernels.reference import attention as reference_attention

from cases import TOL, full_inputs, reference_grads, reference_mask, rel_err, strategy_kwargs
from world import results_by_world

N_LOCAL, H, HK, D = 16, 4, 2, 8
STRATEGIES = ("burst", "burst:chunk_rows=8", "ring", "allgather", "distflash", "ulysses", "usp", "cqs")
BF16_STRATEGIES = ("burst", "ring", "ulysses")  # bf16 rounding is the kernels' and the merge's: one of each path


def _sinks(dtype):
    return (torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2).to(dtype)


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to(torch.float64).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _case(full, ref, dtype, layout, **kwargs):
    """This rank's errors of out, lse, dq, dk, dv and of the summed dsinks; None when refused."""
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    sinks = _sinks(dtype).requires_grad_()
    try:
        out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, sinks=sinks, **kwargs)
    except (ValueError, NotImplementedError) as err:  # every rank alike: the strategy does not take the case
        return None, str(err).split("\n")[0]
    out.backward(dout.to(dtype))
    r_out, r_lse, r_dq, r_dk, r_dv = (burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref[:5])
    errors = {
        name: rel_err(x, r)
        for name, x, r in (("out", out, r_out), ("dq", q.grad, r_dq), ("dk", k.grad, r_dk), ("dv", v.grad, r_dv))
    }
    errors["lse"] = (lse.double() - r_lse).abs().max().item()  # finite everywhere: the sink is in every row
    errors["dsinks"] = rel_err(_sum_over_ranks(sinks.grad), ref[5])
    errors["nan"] = any(bool(torch.isnan(t).any()) for t in (out, lse, q.grad, k.grad, v.grad, sinks.grad))
    return errors, ""


def _cases(rank, world):
    results = []
    n = N_LOCAL * world
    full = full_inputs(11, 2, n, H, HK, D, torch.float64)
    settings = [("full", {}), ("causal", {"causal": True}), ("window", {"causal": True, "window": (5, 0)})]
    for dtype in (torch.float64, torch.bfloat16):
        for name, mask in settings:
            allowed = reference_mask(n, causal=mask.get("causal", False), window=mask.get("window"))
            ref = reference_grads(*full, mask=allowed, sinks=_sinks(dtype))
            for layout in ("contiguous", "zigzag", "striped"):
                for strategy in STRATEGIES if dtype == torch.float64 else BF16_STRATEGIES:
                    errs, note = _case(full, ref, dtype, layout, **mask, **strategy_kwargs(strategy))
                    results.append(((strategy, layout, name, str(dtype)), errs, note))
    # packed documents, each cut on its own (doc_zigzag), with a window: rows of a 2-token document
    # at the window's edge, and a sliding+full pair of calls as gpt-oss alternates them
    cu = [0, 2 * world, n - 2 * world * 2, n] if n - 4 * world > 2 * world else [0, n]
    for window in (None, (3, 0)):
        allowed = reference_mask(n, causal=True, window=window, cu_seqlens=cu)
        ref = reference_grads(*full, mask=allowed, sinks=_sinks(torch.float64))
        layout = burst.DocumentLayout(tuple(cu), "zigzag")
        for strategy in ("burst", "ring", "allgather"):
            errs, note = _case(full, ref, torch.float64, layout, causal=True, window=window, strategy=strategy)
            results.append(((strategy, "doc_zigzag", f"documents window={window}", str(torch.float64)), errs, note))
    results.append((("decode",), _decode_errors(rank, world), ""))
    return results


def _decode_errors(rank, world):
    """decode_attention with sinks: two new queries over a cache of 5 entries per rank, some invalid."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 5 * world, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.rand(2, 5 * world, generator=g) > 0.3
    sinks = _sinks(torch.float64)
    mine = slice(5 * rank, 5 * rank + 5)
    out = decode_attention(q, k[:, mine], v[:, mine], valid[:, mine], sinks=sinks)
    expected = torch.cat(
        [
            reference_attention(q[b : b + 1], k[b : b + 1, valid[b]], v[b : b + 1, valid[b]], sinks=sinks)[0]
            for b in range(2)
        ]
    )
    return {"out": rel_err(out, expected), "nan": bool(torch.isnan(out).any())}


_results = results_by_world(_cases)


DISTFLASH_REFUSAL = "strategy='distflash' supports layout='contiguous' with causal=True and no window"
ULYSSES_REFUSAL = f"strategy='ulysses' splits heads over the 3 ranks: {H} query heads and {HK} KV heads cannot be"


def may_refuse(strategy, layout, name, world) -> str | None:
    """The refusal's message where a strategy may refuse a case; None where it must run it. burst,
    ring and allgather take every case, layout and dtype (packed documents too), as do
    burst:chunk_rows=8, usp and cqs; distflash takes causal attention on contiguous shards only;
    ulysses splits the 4 query and 2 KV heads over 1, 2 or 4 ranks, not 3."""
    if strategy == "distflash" and (layout, name) != ("contiguous", "causal"):
        return DISTFLASH_REFUSAL
    if strategy == "ulysses" and world == 3:
        return ULYSSES_REFUSAL
    return None


def _expected_cases(world):
    keys = {
        (strategy, layout, name, str(dtype))
        for dtype in (torch.float64, torch.bfloat16)
        for name in ("full", "causal", "window")
        for layout in ("contiguous", "zigzag", "striped")
        for strategy in (STRATEGIES if dtype == torch.float64 else BF16_STRATEGIES)
    }
    keys |= {
        (strategy, "doc_zigzag", f"documents window={window}", str(torch.float64))
        for window in (None, (3, 0))
        for strategy in ("burst", "ring", "allgather")
    }
    return keys | {("decode",)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sinks_exact_in_every_strategy_and_layout(world):
    failures = []
    expected = _expected_cases(world)
    for rank, cases in enumerate(_results(world)):
        assert {key for key, _, _ in cases} == expected and len(cases) == len(expected), rank
        for key, errs, note in cases:
            refusal = None if key[0] == "decode" else may_refuse(*key[:3], world)
            if errs is None:  # refused: only where allowed, and with that refusal's message
                if refusal is None or not note.startswith(refusal):
                    failures.append(f"rank {rank} {key} refused: {note!r} (allowed: {refusal!r})")
                continue
            dtype = key[-1] if key[0] != "decode" else "torch.float64"
            measured = {n: e for n, e in errs.items() if n != "nan"}
            bound = TOL[getattr(torch, dtype.removeprefix("torch."))]
            if errs["nan"] or not all(e <= bound for e in measured.values()):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures)


def test_bad_sinks_raise_before_any_communication():
    q = torch.randn(1, 8, H, D)
    for bad, kind in (
        (torch.zeros(H + 1), ValueError),
        (torch.zeros(H, dtype=torch.long), ValueError),
        ([0.0] * H, TypeError),
    ):
        with pytest.raises(kind, match="sinks"):
            burst.attention(q, q[:, :, :HK], q[:, :, :HK], sinks=bad)


def test_burst_check_compares_the_sinks_gradient():
    report = burst.check(
        strategies=("burst", "ring"), layouts=("contiguous",), seq_len=32, heads=H, kv_heads=HK, head_dim=D, sinks=True
    )
    assert report.ok and all("dsinks" in r.errors for r in report.rows if r.status == "ok"), report.table()
    assert "dsinks" in report.table()
