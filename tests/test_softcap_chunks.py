"""Logit softcapping (`softcap=`, Gemma 2) and chunked attention (`chunk_size=`, Llama 4) against
float64 attention on the full sequence.

The reference caps the scores with autograd through tanh (reference.attention), so the kernels'
hand-written backward (the tanh's derivative) is checked against an independent one; chunks are
checked against a mask built here (tokens i, j in one chunk of the global sequence). One world per
size, cases looped inside: every strategy, the three layouts (each setting in all three at 1 and 2 ranks,
in one at 4), causal, window, packed documents and chunks combined; out, lse, dq, dk, dv in float64
and, for burst and ring, bf16 (within the bf16 bound, no NaN). CommStats: chunks skip the off-chunk
block pairs (fewer pairs and bytes than causal).
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import TOL, full_inputs, reference_grads, reference_mask, sharded_errors, strategy_kwargs
from world import results_by_world

N_LOCAL, H, HK, D = 16, 4, 2, 8
CAP, CHUNK = 1.5, 12  # chunks of 12 do not line up with any shard or zigzag half: cuts inside shards
STRATEGIES = ("burst", "burst:chunk_rows=8", "ring", "allgather", "distflash", "ulysses", "usp", "cqs")


def chunk_mask(n: int, chunk: int) -> torch.Tensor:
    """Pairs in one chunk of `chunk` tokens, by global index."""
    block = torch.arange(n) // chunk
    return block[:, None] == block[None, :]


def _settings(n, world):
    cu = [0, 5 * world, n - 3 * world, n]
    return [  # (name, burst.attention's mask keywords, the reference's allowed pairs, softcap)
        ("softcap full", {}, reference_mask(n), CAP),
        ("softcap causal", {"causal": True}, reference_mask(n, causal=True), CAP),
        ("softcap window", {"causal": True, "window": (6, 0)}, reference_mask(n, causal=True, window=(6, 0)), CAP),
        ("softcap documents", {"causal": True, "cu_seqlens": cu}, reference_mask(n, causal=True, cu_seqlens=cu), CAP),
        (
            "chunks causal",
            {"causal": True, "chunk_size": CHUNK},
            reference_mask(n, causal=True) & chunk_mask(n, CHUNK),
            0.0,
        ),
        (
            "chunks + softcap",
            {"causal": True, "chunk_size": CHUNK},
            reference_mask(n, causal=True) & chunk_mask(n, CHUNK),
            CAP,
        ),
        (
            "chunks + documents",
            {"causal": True, "chunk_size": CHUNK, "cu_seqlens": cu},
            reference_mask(n, causal=True, cu_seqlens=cu) & chunk_mask(n, CHUNK),
            0.0,
        ),
    ]


# At 4 ranks (the ring of more than two steps) each setting runs in one layout, every layout in two or three
# settings, "softcap causal" on contiguous shards (the one case distflash takes): a third of the cases.
FOUR_RANK_LAYOUT = {
    "softcap full": "striped",
    "softcap causal": "contiguous",
    "softcap window": "zigzag",
    "softcap documents": "contiguous",
    "chunks causal": "zigzag",
    "chunks + softcap": "striped",
    "chunks + documents": "zigzag",
}


def layouts(world, name):
    return ("contiguous", "zigzag", "striped") if world <= 2 else (FOUR_RANK_LAYOUT[name],)


def _cases(rank, world):
    n = N_LOCAL * world
    plain = full_inputs(21, 2, n, H, HK, D, torch.float64)
    # capped cases: scores well past the cap, so capping changes the answer (x4 keeps bf16 values exact)
    scaled = [plain[0] * 4, *plain[1:]]
    results = []
    for name, mask, allowed, cap in _settings(n, world):
        full = scaled if cap else plain
        ref = reference_grads(*full, mask=allowed, softcap=cap)
        for layout in layouts(world, name):
            for dtype, strategies in ((torch.float64, STRATEGIES), (torch.bfloat16, ("burst", "ring"))):
                for strategy in strategies:
                    try:
                        errs = sharded_errors(
                            full, ref, dtype, layout, softcap=cap, **mask, **strategy_kwargs(strategy)
                        )
                    except (ValueError, NotImplementedError) as err:  # the strategy does not take the case
                        errs = str(err).split("\n")[0]
                    results.append(((strategy, layout, name, str(dtype)), errs))
    results.append((("stats",), _chunk_stats(plain)))
    return results


def _chunk_stats(full):
    """Forward pairs and bytes of burst, causal with and without chunks: zigzag with CHUNK (cut inside
    shards) and contiguous with chunks of one shard (no rank needs another's keys)."""
    out = {}
    for layout, chunk in (("zigzag", CHUNK), ("contiguous", N_LOCAL)):
        q, k, v, _ = (burst.shard(t, layout=layout) for t in full)
        for name, extra in (("causal", {}), ("chunks", {"chunk_size": chunk})):
            with burst.CommStats() as stats:
                burst.attention(q, k, v, layout=layout, causal=True, **extra)
            out[(layout, name)] = (stats.pairs("forward"), stats.sent("forward"))
    return out


_results = results_by_world(_cases)


DISTFLASH_REFUSAL = "strategy='distflash' supports layout='contiguous' with causal=True and no window"


def may_refuse(strategy, layout, name) -> str | None:
    """The refusal's message where a strategy may refuse a case; None where it must run it. Every
    strategy but distflash takes every case, layout and dtype (burst, ring, allgather: all of them,
    ulysses, usp and cqs too at these sizes); distflash takes causal attention on contiguous shards
    only (chunks are documents to it: refused), so of these settings just "softcap causal"."""
    if strategy == "distflash" and (layout, name) != ("contiguous", "softcap causal"):
        return DISTFLASH_REFUSAL
    return None


@pytest.mark.parametrize("world", [1, 2, 4])
def test_softcap_and_chunks_exact_in_every_strategy_and_layout(world):
    failures = []
    names = [s[0] for s in _settings(N_LOCAL * world, world)]
    expected = {
        (strategy, layout, name, str(dtype))
        for name in names
        for layout in layouts(world, name)
        for dtype, strategies in ((torch.float64, STRATEGIES), (torch.bfloat16, ("burst", "ring")))
        for strategy in strategies
    }
    for rank, cases in enumerate(_results(world)):
        cases = [(key, errs) for key, errs in cases if key[0] != "stats"]
        assert {key for key, _ in cases} == expected and len(cases) == len(expected), rank
        for key, errs in cases:
            refusal = may_refuse(*key[:3])
            if isinstance(errs, str):  # refused: only where allowed, and with that refusal's message
                if refusal is None or not errs.startswith(refusal):
                    failures.append(f"rank {rank} {key} refused: {errs!r} (allowed: {refusal!r})")
                continue
            bound = TOL[getattr(torch, key[-1].removeprefix("torch."))]
            measured = {n: e for n, e in errs.items() if n != "nan"}
            if errs["nan"] or not all(e <= bound for e in measured.values()):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures)


def test_the_cap_changes_the_answer():
    """The bound above would not pass a kernel that ignored the cap: capped and uncapped differ."""
    full = full_inputs(21, 1, 32, H, HK, D, torch.float64)
    full[0] = full[0] * 4
    capped = reference_grads(*full, causal=True, softcap=CAP)[0]
    plain = reference_grads(*full, causal=True)[0]
    assert (capped - plain).abs().max() / plain.abs().max() > 10 * TOL[torch.bfloat16]


@pytest.mark.parametrize("world", [2, 4])
def test_chunks_skip_off_chunk_pairs(world):
    """Pairs computed (summed over ranks) are the attended pairs only, in the ratio of the masks' counts;
    chunks of one shard send no K, V at all (the ring stops before its first step)."""
    stats = [cases[-1][1] for cases in _results(world)]
    n = N_LOCAL * world
    for layout, chunk in (("zigzag", CHUNK), ("contiguous", N_LOCAL)):
        causal, chunks = (sum(s[(layout, name)][0] for s in stats) for name in ("causal", "chunks"))
        attended = reference_mask(n, causal=True) & chunk_mask(n, chunk)
        assert chunks / causal == pytest.approx(int(attended.sum()) / int(reference_mask(n, causal=True).sum()))
    assert sum(s[("contiguous", "causal")][1] for s in stats) > 0
    assert sum(s[("contiguous", "chunks")][1] for s in stats) == 0


def test_bad_softcap_and_chunk_size_raise_before_any_communication():
    q = torch.randn(1, 8, H, D)
    for kwargs in (
        {"softcap": -1.0},
        {"softcap": float("inf")},
        {"softcap": True},
        {"chunk_size": 0},
        {"chunk_size": 2.5},
    ):
        with pytest.raises(ValueError, match="softcap|chunk_size"):
            burst.attention(q, q[:, :, :HK], q[:, :, :HK], **kwargs)
