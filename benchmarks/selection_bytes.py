"""Bytes of an index selection in burst's query-side backward: blocks (burst.BlockIndices) against the
same choice spelled as key positions, per KV head (MiniMax-style: 16 blocks of 64 keys per KV head).

    .venv/bin/python benchmarks/selection_bytes.py > benchmarks/selection_bytes.md

Each row is measured (CommStats on every rank of a local gloo world, summed), not computed: float32, batch 1,
16 query heads, 4 KV heads, head dim 64, causal, burst with backward_side="queries" (the side that
carries each row's choice with it), the forward included for reference.
"""

from __future__ import annotations

import torch

import burst
from burst.launch import spawn_world

HEADS, KV_HEADS, DIM, TOPK, BLOCK = 16, 4, 64, 16, 64


def choice(n: int) -> torch.Tensor:
    """(1, n, KV_HEADS, TOPK) blocks: the query's own and TOPK - 1 earlier ones at random, per KV head."""
    g = torch.Generator().manual_seed(0)
    own = (torch.arange(n) // BLOCK)[None, :, None, None].expand(1, n, KV_HEADS, 1)
    return torch.cat([own, (torch.rand(1, n, KV_HEADS, TOPK - 1, generator=g) * (own + 1)).long()], dim=3)


def as_positions(blocks: torch.Tensor) -> torch.Tensor:
    return (blocks[..., None] * BLOCK + torch.arange(BLOCK)).flatten(-2)


def measure(rank: int, world: int, n: int) -> dict:
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    q, k, v, dout = (burst.shard(t) for t in full)
    blocks = choice(n)
    sent = {}
    for form, indices in (
        ("blocks", burst.BlockIndices(burst.shard(blocks), BLOCK)),
        ("key positions", burst.shard(as_positions(blocks))),
    ):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with burst.CommStats() as stats:
            out = burst.attention(qq, kk, vv, causal=True, indices=indices, backward_side="queries")
            out.backward(dout)
        sent[form] = (stats.sent("forward"), stats.sent("backward"))
    return sent


def main() -> None:
    print(__doc__.split("\n\n")[0].replace('"""', ""))
    print("\nCommand: `.venv/bin/python benchmarks/selection_bytes.py > benchmarks/selection_bytes.md`\n")
    print(
        f"{HEADS} query heads, {KV_HEADS} KV heads, head dim {DIM}, {TOPK} blocks of {BLOCK} keys per KV head "
        "and query; bytes all ranks sent (under a causal mask the first rank's queries go nowhere).\n"
    )
    print("| tokens | ranks | selection | index bytes per row | forward MiB | backward MiB |")
    print("|---|---|---|---|---|---|")
    for n, world in ((4096, 2), (4096, 4), (8192, 4)):
        ranks = spawn_world(measure, n, nproc=world, threads=1)
        for form in ranks[0]:
            fwd, bwd = (sum(r[form][phase] for r in ranks) for phase in (0, 1))
            per_row = KV_HEADS * TOPK * (1 if form == "blocks" else BLOCK) * 8
            print(f"| {n} | {world} | {form} | {per_row} | {fwd / 2**20:.2f} | {bwd / 2**20:.2f} |")


if __name__ == "__main__":
    main()
