"""The float32 lse's own rounding at very large attention scores (docs/numerics.md), measured.

    PYTHONPATH=. .venv/bin/python benchmarks/lse_rounding.py [--out benchmarks/lse_rounding.md]

Tied scores: every key of a row is the same vector, so every score of the row is exactly S and the exact
output is the mean of the values; one-process SDPA meets no rounding but its own sum's. For S from 1e2 to
3e4, burst.attention (float32, full mask, contiguous) at G = 1, 2, 4 and 8 local ranks (gloo, one thread
each) with burst, ring, allgather, CQS and Ulysses, against float64 attention on the full sequence: the
output's max abs error relative to the largest value. Then random queries and keys scaled so that the
scores reach ~1e3, causal: the same error for each, and one-process float32 SDPA's beside it.
"""

from __future__ import annotations

import argparse
import platform

import torch

TOKENS, HEADS, DIM = 64, 8, 16
SCORES = (1e2, 1e3, 1e4, 3e4)
WORLDS = (1, 2, 4, 8)


def _tied(score: float, dtype=torch.float64):
    """q, k, v (1, TOKENS, HEADS, DIM): every key one vector, q . k = score * sqrt(DIM) (the scale undoes it)."""
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(HEADS, DIM, generator=gen, dtype=torch.float64)
    key = key / key.norm(dim=-1, keepdim=True)
    k = key.expand(1, TOKENS, HEADS, DIM).contiguous()
    q = (key * score * DIM**0.5).expand(1, TOKENS, HEADS, DIM).contiguous()
    v = torch.randn(1, TOKENS, HEADS, DIM, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _large(scale: float):
    """Random q, k, v (1, TOKENS, HEADS, DIM) with q scaled so that the scores reach about `scale`."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, TOKENS, HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    return q * scale / DIM**0.5, k, v


def _reference(q, k, v, causal: bool) -> torch.Tensor:
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / DIM**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def measure(rank, world):
    """{(case, strategy): error of the whole output} from this world (each rank sends its shard's error
    against the same rows of the reference; the max over ranks is taken by the caller)."""
    import burst

    results = {}
    cases = [(f"tied S={s:g}", _tied(s), False) for s in SCORES]
    cases.append(("random, scores ~1e3, causal", _large(1e3), True))
    for case, (q, k, v), causal in cases:
        ref = burst.shard(_reference(q, k, v, causal), layout="contiguous")
        local = [burst.shard(t.float(), layout="contiguous") for t in (q, k, v)]
        for strategy in ("burst", "ring", "allgather", "cqs", "ulysses"):
            out = burst.attention(*local, causal=causal, strategy=strategy, layout="contiguous")
            results[(case, strategy)] = _error(out, ref)
    return results


def _sdpa_errors() -> dict:
    out = {}
    for s in SCORES:
        q, k, v = _tied(s)
        ref = _reference(q, k, v, False)
        got = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
        out[f"tied S={s:g}"] = _error(got.transpose(1, 2), ref)
    q, k, v = _large(1e3)
    got = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True
    )
    out["random, scores ~1e3, causal"] = _error(got.transpose(1, 2), _reference(q, k, v, True))
    return out


def main():
    from burst.launch import spawn_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/lse_rounding.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sdpa = _sdpa_errors()
    by_world = {}
    for world in WORLDS:
        per_rank = spawn_world(measure, nproc=world, threads=1, timeout=600)
        by_world[world] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    cases = list(sdpa)
    lines = [
        "# The float32 lse's rounding at very large scores",
        "",
        f"Made by `PYTHONPATH=. .venv/bin/python benchmarks/lse_rounding.py` ({platform.machine()} CPU, torch "
        f"{torch.__version__}). {TOKENS} tokens, {HEADS} heads of {DIM}, float32 inputs; each cell is the output's max "
        "abs error against float64 attention on the full sequence, relative to its largest value (the worst rank). "
        "Tied: every key of a row the same vector, every score exactly S. Why: docs/numerics.md.",
        "",
        "| case | strategy | one-process SDPA | " + " | ".join(f"G={g}" for g in WORLDS) + " |",
        "|---|---|---|" + "---|" * len(WORLDS),
    ]
    for case in cases:
        for strategy in ("burst", "ring", "allgather", "cqs", "ulysses"):
            cells = " | ".join(f"{by_world[g][(case, strategy)]:.1e}" for g in WORLDS)
            lines.append(f"| {case} | {strategy} | {sdpa[case]:.1e} | {cells} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
