"""burst's backward on either side (strategies/burst.py: backward_side), against float64 attention on
the full sequence, and the bytes of its default against both sides and ring.

One world per size; in it every side x chunking x layout x mask x head shape, sinks included, and
keys reused as values (`v is k`: one block and one gradient travel).
"""

from __future__ import annotations

import burst
import pytest
import torch
from burst.strategies.burst import side_bytes_per_row

from cases import TOL, full_inputs, reference_grads, reference_mask, rel_err
from world import results_by_world

N_LOCAL, H, D, B = 12, 4, 8, 2
SIDES = ("queries", "keys")
CHUNKS = (None, 3, 0)  # default chunks (one per shard here), chunks of 3 rows, whole blocks on the ring
MASKS = {
    "causal": {"causal": True},
    "window": {"causal": True, "window": (5, 0)},
    "documents": {"causal": True, "cu_seqlens": None},
    "sinks": {"causal": True},
}
HEADS = ((4, 4), (4, 2), (4, 1), (4, "1 shared"))  # q heads / kv heads; "shared": one tensor as k and v


def _documents(n: int) -> torch.Tensor:
    return torch.tensor([0, n // 3, n // 3 + 5, n], dtype=torch.int32)


def _case_inputs(n: int, kv):
    shared = kv == "1 shared"
    full = full_inputs(31, B, n, H, 1 if shared else kv, D, torch.float64)
    if shared:
        full = (full[0], full[1], full[1], full[3])
    return full, shared


def _mask_kwargs(name: str, n: int) -> dict:
    kwargs = dict(MASKS[name])
    if "cu_seqlens" in kwargs:
        kwargs["cu_seqlens"] = _documents(n)
    return kwargs


def _reference(full, name: str, n: int, sinks):
    kwargs = _mask_kwargs(name, n)
    allowed = reference_mask(
        n,
        causal=True,
        window=kwargs.get("window"),
        cu_seqlens=kwargs["cu_seqlens"].tolist() if "cu_seqlens" in kwargs else None,
    )
    return reference_grads(*full, mask=allowed, sinks=sinks)


def _run(full, shared, layout, sinks, **kwargs):
    """This rank's out, lse, dq, dk, dv (dk holding dk + dv when shared), dsinks, and the bytes sent."""
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q = q.clone().requires_grad_()
    k = k.clone().requires_grad_()
    v = k if shared else v.clone().requires_grad_()
    s = sinks.clone().requires_grad_() if sinks is not None else None
    with burst.CommStats() as stats:
        out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, sinks=s, **kwargs)
        out.backward(dout)
    return (out, lse, q.grad, k.grad, None if shared else v.grad, s.grad if s is not None else None), stats


def _errors(got, ref, shared, layout, world):
    theirs = [burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref[:5]]
    if shared:  # one tensor as k and v: its gradient is dk + dv
        theirs[3] = theirs[3] + theirs[4]
    errors = {
        name: rel_err(x, r)
        for name, x, r in zip(("out", "dq", "dk"), (got[0], got[2], got[3]), (theirs[0], theirs[2], theirs[3]))
    }
    if not shared:
        errors["dv"] = rel_err(got[4], theirs[4])
    finite = torch.isfinite(theirs[1])
    errors["lse"] = (got[1].double() - theirs[1])[finite].abs().max().item()
    if got[5] is not None:
        total = got[5].detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        errors["dsinks"] = rel_err(total, ref[5])
    return errors


def _selected(world, kv, name, layout, side, rows) -> bool:
    """Every side x chunking x layout x mask x head shape at 1 and 2 ranks. At 4 (a ring of more than two
    steps, where the suite's 2 cores make each case ~10x dearer than at 2) every side, mask and layout in
    default chunks for many heads and for one k = v head (the two cases auto tells apart), and burst's other
    chunkings on each forced side, every mask, on zigzag: 3 rows with 2 kv heads, whole blocks with 1."""
    if world <= 2:
        return True
    if rows is None:
        return kv in FOUR_RANK_HEADS
    return kv == {3: 2, 0: 1}[rows] and side in SIDES and (layout == "zigzag" or name == "documents")


FOUR_RANK_HEADS = (4, "1 shared")  # default chunks and the byte comparison at 4 ranks


def _keys(world):
    """The (kv, mask, layout, side, rows) cases a world of this size runs, in order."""
    return [
        (kv, name, layout, side, rows)
        for _, kv in HEADS
        for name in MASKS
        # documents are cut by position: one layout shows the side's routing
        for layout in (("contiguous",) if name == "documents" else ("contiguous", "zigzag", "striped"))
        for side in ("auto", *SIDES)
        for rows in CHUNKS
        if _selected(world, kv, name, layout, side, rows)
    ]


def _cases(rank, world):
    n = N_LOCAL * world
    results, sent = [], {}
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for _, kv in HEADS:  # H query heads throughout
        full, shared = _case_inputs(n, kv)
        for name in MASKS:
            with_sinks = sinks if name == "sinks" else None
            ref = _reference(full, name, n, with_sinks)
            for layout in ("contiguous", "zigzag", "striped"):
                if name == "documents" and layout != "contiguous":
                    continue  # documents are cut by position: one layout shows the side's routing
                for side in ("auto", *SIDES):
                    for rows in CHUNKS:
                        if not _selected(world, kv, name, layout, side, rows):
                            continue
                        got, stats = _run(
                            full,
                            shared,
                            layout,
                            with_sinks,
                            strategy="burst",
                            backward_side=side,
                            chunk_rows=rows,
                            **_mask_kwargs(name, n),
                        )
                        results.append(((kv, name, layout, side, rows), _errors(got, ref, shared, layout, world)))
                        sent[(kv, name, layout, side, rows)] = (stats.sent("backward"), stats.choices())
                if not _selected(world, kv, name, layout, "auto", None):
                    continue
                _, stats = _run(full, shared, layout, with_sinks, strategy="ring", **_mask_kwargs(name, n))
                sent[(kv, name, layout, "ring", None)] = (stats.sent("backward"), {})
    return results, sent


_results = results_by_world(_cases)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_both_sides_match_float64_reference(world):
    every = _keys(1)
    assert len(every) == len(HEADS) * (3 * 3 + 1) * 3 * len(CHUNKS)
    for part in range(5):  # each head shape, mask, layout, side and chunking runs at every size
        assert {key[part] for key in _keys(world)} == {key[part] for key in every}, part
    failures = []
    for rank, (cases, _) in enumerate(_results(world)):
        assert [key for key, _ in cases] == _keys(world)
        for key, errs in cases:
            if not all(e <= TOL[torch.float64] for e in errs.values()):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world", [2, 4])
def test_the_default_sends_no_more_than_either_side_or_ring(world):
    """Summed over the ranks: auto's backward bytes are the smaller side's, never more than ring's, and
    the side it took is the one side_bytes_per_row names (multi-head: the queries, grouped: the keys)."""
    per_rank = [sent for _, sent in _results(world)]
    keys = {key[:3] for key in per_rank[0] if key[3] == "ring"}
    assert {kv for kv, _, _ in keys} == ({kv for _, kv in HEADS} if world <= 2 else set(FOUR_RANK_HEADS))
    for kv, name, layout in keys:
        total = {
            side: sum(r[(kv, name, layout, side, rows)][0] for r in per_rank)
            for side in ("auto", *SIDES)
            for rows in (None,)
        }
        ring = sum(r[(kv, name, layout, "ring", None)][0] for r in per_rank)
        assert total["auto"] == min(total["queries"], total["keys"]), (kv, name, layout, total)
        assert total["auto"] <= ring, (kv, name, layout, total, ring)
        taken = per_rank[0][(kv, name, layout, "auto", None)][1]
        expected = "queries" if kv == 4 else "keys"
        assert taken == {f"backward_side={expected}": 1}, (kv, name, layout, taken)


def test_side_bytes_per_row_counts_what_travels():
    q = torch.zeros(1, 3, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 3, 8, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 3, 8, 128, dtype=torch.bfloat16)
    # Q, dO in bf16, dQ in float32, D and lse in float32; K, V in bf16 with their float32 gradients
    assert side_bytes_per_row(q, q, k, v) == {"queries": 32 * 128 * 8 + 32 * 8, "keys": 2 * 8 * 128 * 6}
    assert side_bytes_per_row(q, q, k, k)["keys"] == 8 * 128 * 6  # keys that are the values: once
    indices = torch.zeros(1, 3, 5, dtype=torch.int64)  # an index selection's chosen keys travel with queries
    assert side_bytes_per_row(q, q, k, v, indices)["queries"] == 32 * 128 * 8 + 32 * 8 + 5 * 8


def test_an_unknown_side_is_refused_before_any_communication():
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="backward_side must be one of"):
        burst.attention(q, q, q, strategy="burst", backward_side="values")
    with pytest.raises(ValueError, match="takes no option 'backward_side'"):
        burst.attention(q, q, q, strategy="ring", backward_side="keys")


def test_a_misspelt_keyword_is_refused_with_the_name_it_resembles():
    """burst.attention hands the keywords it does not name to the strategy as options: a misspelt one is
    refused there, naming the keyword it is close to (burst.attention's own or the strategy's)."""
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"takes no option 'casual' .*did you mean 'causal' for 'casual'\?"):
        burst.attention(q, q, q, casual=True)
    with pytest.raises(ValueError, match=r"did you mean 'chunk_rows' for 'chunk_row'\?"):
        burst.attention(q, q, q, strategy="burst", chunk_row=4)
    with pytest.raises(ValueError) as refused:
        burst.attention(q, q, q, zzz=1)
    assert "did you mean" not in str(refused.value)
    # strategy="auto" names the keyword no strategy takes (a peer's, ported as is), or the refusal of those that take it
    with pytest.raises(ValueError, match=r"none takes 'window_size'; did you mean 'window' for 'window_size'\?"):
        burst.attention(q, q, q, strategy="auto", window_size=(4, 0))
    with pytest.raises(ValueError, match=r"no strategy takes this call; burst: chunk_rows must be a non-negative int"):
        burst.attention(q, q, q, strategy="auto", chunk_rows=-1)
