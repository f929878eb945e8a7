"""Packed documents sharded per document (doc_contiguous, doc_zigzag), against float64 attention.

The peers' own cases (ring-flash-attention's varlen ring: cu_seqlens [0, 120, 1248, 4232] cut 1/G per
rank; its zigzag varlen and TransformerEngine's THD: [0, 128, 1248, 4240] cut into 2G parts), given
as global offsets and in the peers' local form, and our own (uneven documents, one document longer
than a shard, GQA, bf16), for every strategy that takes the layout; out, lse and dq/dk/dv against
float64 attention on the whole packed sequence. Also the planner's balance and bytes. One world per size.
"""

from __future__ import annotations

import burst
import pytest
import torch
from burst.layout import DocumentLayout, segments

from cases import full_inputs, reference_grads, reference_mask, sharded_errors, within_bounds
from world import results_by_world

PEERS = {"doc_contiguous": (0, 120, 1248, 4232), "doc_zigzag": (0, 128, 1248, 4240)}
STRATEGIES = ("burst", "ring", "allgather", "ulysses", "usp")


def _case(world, cu, split, forms, dtype=torch.float32, heads=2, kv_heads=1, seed=1):
    """forms: {local form: strategies}; the same {local form: (errors by strategy, tokens per rank)}. The
    local form passes the peers' per-rank cu_seqlens besides the layout; every form and strategy is held to
    one float64 reference on the whole packed sequence."""
    layout = DocumentLayout(cu, split)
    full = full_inputs(seed, 1, cu[-1], heads, kv_heads, 8, torch.float64)
    ref = _reference_once(full, reference_mask(cu[-1], causal=True, cu_seqlens=list(cu)))
    n = cu[-1] // world
    done = {}
    for local_form, strategies in forms.items():
        extra = {"cu_seqlens": [c // world for c in cu]} if local_form else {}
        errors = {}
        for strategy in strategies:
            try:
                errors[strategy] = sharded_errors(
                    full, ref, dtype, layout=layout, causal=True, strategy=strategy, **extra
                )
            except (ValueError, NotImplementedError) as err:
                errors[strategy] = str(err)
        done[local_form] = errors, n
    return done


def _reference_once(full, mask):
    """reference_grads on rank 0, sent to the others: the same float64 attention on the whole packed
    sequence every rank would compute (the peers' 4K tokens made that the world's largest cost)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reference_grads(*full, causal=False, mask=mask)
    box = [reference_grads(*full, causal=False, mask=mask) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _own_cases(world):
    """Uneven documents in multiples of 2G (both splits take them): 15 units of 2G tokens, a shard
    holds 30 tokens, the third document (18G tokens) is longer than a shard."""
    unit = 2 * world
    lengths = (3 * unit, 1 * unit, 9 * unit, 2 * unit)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def _compiled_and_context_parallel(cu):
    """The same doc_zigzag attention three ways: burst.attention, torch.compile'd (dynamo must not trace
    into the per-tile kernel calls: one graph, no recompiles), and an SDPA call in burst.context_parallel."""
    import torch._dynamo

    full = full_inputs(4, 1, cu[-1], 4, 2, 8, torch.float32)
    layout = DocumentLayout(cu, "zigzag")
    q, k, v = (burst.shard(t, layout=layout) for t in full[:3])
    eager = burst.attention(q, k, v, layout=layout, causal=True)
    torch._dynamo.reset()
    previous = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        compiled = torch.compile(
            lambda a, b, c: burst.attention(a, b, c, layout=layout, causal=True) * 2, backend="aot_eager"
        )
        twice = [compiled(q, k, v), compiled(q + 1, k, v)]
    finally:
        torch._dynamo.config.error_on_recompile = previous
    heads_first = [t.transpose(1, 2).contiguous() for t in full[:3]]
    with burst.context_parallel(
        buffers=heads_first, buffer_seq_dims=[2, 2, 2], layout="doc_zigzag", cu_seqlens=list(cu)
    ):
        routed = torch.nn.functional.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True)
    return {
        "compiled": (twice[0] / 2 - eager).abs().max().item(),
        "compiled again": (twice[1] / 2 - burst.attention(q + 1, k, v, layout=layout, causal=True)).abs().max().item(),
        "context_parallel": (routed.transpose(1, 2) - eager).abs().max().item(),
    }


def _run(rank, world):
    torch.set_num_threads(1)
    results = {}
    if world == 4:  # the peers' cases at their usual world; 4K tokens each, so one world only
        for name, cu in PEERS.items():
            split = name.removeprefix("doc_")
            forms = _case(world, cu, split, {False: ("burst", "ring"), True: ("burst",)})
            results[f"peers {name}"], results[f"peers {name} local form"] = forms[False], forms[True]
    cu = _own_cases(world)
    if world == 2:
        results["compiled and context_parallel"] = _compiled_and_context_parallel(cu)
    for split in ("contiguous", "zigzag"):
        results[f"own {split}"] = _case(world, cu, split, {False: STRATEGIES}, heads=4, kv_heads=2)[False]
        results[f"own {split} bf16"] = _case(
            world, cu, split, {False: ("burst", "ring")}, dtype=torch.bfloat16, heads=4, kv_heads=2
        )[False]
    return results


_results = results_by_world(_run, timeout=500)


def _ok(errors, dtype) -> bool:
    """Every quantity within the dtype's bound (reference.BOUNDS; lse's error is absolute), as every
    other module holds them (cases.within_bounds), and no NaN."""
    return not errors["nan"] and within_bounds({n: errors[n] for n in ("out", "lse", "dq", "dk", "dv")}, dtype)


def test_compiled_and_context_parallel_take_document_layouts():
    for rank, results in enumerate(_results(2)):
        r = results["compiled and context_parallel"]
        assert max(r.values()) < 1e-6, (rank, r)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_document_layouts_equal_float64(world):
    for rank, results in enumerate(_results(world)):
        for name, (errors, _) in ((n, r) for n, r in results.items() if n != "compiled and context_parallel"):
            dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
            for strategy, e in errors.items():
                if strategy in ("ulysses", "usp") and isinstance(e, str):
                    # refused for the head split at this world size, never for the layout
                    assert "head" in e and "layout" not in e, (rank, name, strategy, e)
                    continue
                assert not isinstance(e, str), (rank, name, strategy, e)
                assert _ok(e, dtype), (rank, name, strategy, e)


def test_per_document_zigzag_balances_packed_causal_work():
    """Every document's causal triangle is split evenly: the planner's pairs per rank are equal
    (within one row per document) for doc_zigzag, and not for the whole-sequence contiguous cut."""
    from burst.masks import MaskSpec, plan_tiles

    cu = (0, 40, 48, 200, 256)
    spec = MaskSpec(causal=True, cu_seqlens=cu)

    def pairs_per_rank(layout, world):
        n = cu[-1] // world
        return [
            sum(
                t.pairs
                for k in range(world)
                for t in plan_tiles(segments(layout, q, world, n), segments(layout, k, world, n), spec)
            )
            for q in range(world)
        ]

    world = 4
    doc = pairs_per_rank(DocumentLayout(cu, "zigzag"), world)
    whole = pairs_per_rank("contiguous", world)
    assert sum(doc) == sum(whole)
    assert max(doc) / (sum(doc) / world) < 1.02, doc
    assert max(whole) / (sum(whole) / world) > 1.3, whole


def test_bad_document_layouts_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        DocumentLayout((0, 6, 10), "contiguous").check(4, 10)
    with pytest.raises(ValueError, match="pass the documents. cu_seqlens"):
        burst.shard(torch.zeros(1, 8), layout="doc_zigzag")
    with pytest.raises(ValueError, match="rise strictly"):
        DocumentLayout((0, 5, 5, 8))
    with pytest.raises(ValueError, match="split"):
        DocumentLayout((0, 8), "striped")
    # cu_seqlens is read by one rule everywhere: floats are refused, not rounded down (0, 4.9, 8 had become 0, 4, 8)
    for floats in (torch.tensor([0.0, 4.9, 8.0]), (0, 4.0, 8)):
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            burst.shard(torch.zeros(1, 8), layout="doc_zigzag", cu_seqlens=floats)
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            DocumentLayout(floats)
    x = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match="pass it as layout="):  # had been a TypeError naming nothing
        burst.attention(x, x, x, cu_seqlens=DocumentLayout((0, 4, 8)))
    assert DocumentLayout(torch.tensor([0, 4, 8])).cu_seqlens == (0, 4, 8)
