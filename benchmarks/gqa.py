"""Grouped heads (GQA, MQA): the bytes burst's backward moves on either side, next to ring and Ulysses.

    .venv/bin/python benchmarks/gqa.py [--tokens 2048] [--worlds 2,4,8] [--out benchmarks/gqa.md]

One local world per G (gloo, one thread per rank); in it, for each head shape (q heads / kv heads) at
head_dim 128, float32, and each mask (causal zigzag; a causal window of 1/8 of the sequence, the
4096-token window of a 32K-token sequence at the default 2048 tokens), one forward + backward of
burst.attention per strategy: burst (the default: backward_side="auto"), burst with the query side
forced (what burst sent before the key side existed), ring and ulysses. CommStats gives the bytes one
rank sent per phase, summed over the ranks here. The bytes of every strategy grow linearly with the
tokens at a fixed ratio of window to sequence, so the default 2048 tokens stands for 32K divided by
16; burst's chunks are scaled alike (the chunk a 32K-token shard gets, divided by 16).

Then the planner's step time for the same shapes at 32K tokens (attention only, one layer, causal)
on the papers' clusters, and, with --time, one 8K-token 32/8-head step at 2 ranks on this CPU.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

HEADS = ((32, 32), (32, 8), (64, 8), (16, 1), (128, 128))
STRATEGIES = ("burst", "burst (query side)", "ring", "ulysses")
FULL_TOKENS = 32768


def _kwargs(strategy: str, chunk_rows: int) -> dict:
    if strategy == "burst":
        return {"strategy": "burst", "chunk_rows": chunk_rows}
    if strategy == "burst (query side)":
        return {"strategy": "burst", "chunk_rows": chunk_rows, "backward_side": "queries"}
    return {"strategy": strategy}


def measure(rank, world, tokens, heads_list, dim, scale):
    """On each rank: {(heads, kv, mask, strategy): (forward bytes, backward bytes, side) or the refusal}."""
    import burst
    from burst.kernels import select_kernel
    from burst.schedules.chunk_stream import default_chunk_rows

    # burst's default chunk at the full length, scaled down like the tokens
    full_rows = default_chunk_rows(tokens * scale // world, select_kernel(torch.device("cpu"), torch.float32).MAX_ROWS)
    chunk_rows = max(1, full_rows // scale)
    window = tokens // 8
    out = {}
    for hq, hk in heads_list:
        gen = torch.Generator().manual_seed(hq * 1000 + hk)
        local = tokens // world
        q, dout = (torch.randn(1, local, hq, dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, local, hk, dim, generator=gen) for _ in range(2))
        for mask, mask_kwargs in (
            ("causal", {"causal": True}),
            (f"window {window}", {"causal": True, "window": (window, 0)}),
        ):
            for strategy in STRATEGIES:
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                try:
                    with burst.CommStats() as stats:
                        burst.attention(
                            qq, kk, vv, layout="zigzag", **mask_kwargs, **_kwargs(strategy, chunk_rows)
                        ).backward(dout)
                except ValueError as err:  # refused alike on every rank (Ulysses: heads not divisible)
                    out[(hq, hk, mask, strategy)] = str(err).splitlines()[0][:80]
                    continue
                side = next((c.split("=")[1] for c in stats.choices()), "")
                out[(hq, hk, mask, strategy)] = (stats.sent("forward"), stats.sent("backward"), side)
    return out


def planner_rows(heads_list, dim, tokens):
    """The planner's attention step (one layer, causal, zigzag) on the papers' clusters."""
    from burst.plan.cost import Cluster, Workload, estimate
    from burst.plan.profiles import profile

    clusters = (
        ("8 x A100, NVLink", Cluster(8, 8, profile("A100"))),
        ("4 nodes x 8 A100, InfiniBand", Cluster(32, 8, profile("A100"))),
        ("8 nodes x 8 A100, InfiniBand", Cluster(64, 8, profile("A100"))),
    )
    rows = []
    for name, cluster in clusters:
        for hq, hk in heads_list:
            w = Workload(seq_len=tokens, heads=hq, head_dim=dim, kv_heads=hk, causal=True, dtype_bytes=2)
            est = {s: estimate(s, cluster, w) for s in ("burst", "ring", "ulysses")}
            side = est["burst"].note.rsplit(" ", 1)[-1]
            rows.append(
                (name, f"{hq} / {hk}", *(f"{est[s].wall_s * 1e3:.2f}" for s in ("burst", "ring", "ulysses")), side)
            )
    return rows


def time_step(rank, world, tokens, hq, hk, dim, repeats):
    """Seconds of one forward + backward per strategy (the best of `repeats`), causal zigzag."""
    import burst

    gen = torch.Generator().manual_seed(rank)
    local = tokens // world
    q, dout = (torch.randn(1, local, hq, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, local, hk, dim, generator=gen) for _ in range(2))
    best = {}
    for _ in range(repeats):
        for strategy in ("burst", "burst (query side)", "ring"):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            torch.distributed.barrier()
            start = time.perf_counter()
            burst.attention(qq, kk, vv, layout="zigzag", causal=True, **_kwargs(strategy, None)).backward(dout)
            torch.distributed.barrier()
            best[strategy] = min(best.get(strategy, 1e9), time.perf_counter() - start)
    return best


def _mib(x) -> str:
    return f"{x / 2**20:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--time", action="store_true", help="also time one 8K-token 32/8-head step at 2 ranks")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from burst.launch import spawn_world

    scale = FULL_TOKENS // args.tokens
    lines = [
        "# GQA and MQA: what burst's backward moves",
        "",
        f"Command: `.venv/bin/python benchmarks/gqa.py --tokens {args.tokens} --worlds {args.worlds}"
        + (" --time" if args.time else "")
        + f"{' --out ' + args.out if args.out else ''}`  ",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}; float32, head_dim "
        f"{args.dim}, {args.tokens} tokens (32K / {scale}: bytes scale linearly with the tokens, so x {scale} "
        f"gives 32K), zigzag, one forward + backward, bytes summed over the ranks (MiB). 'side': what burst's "
        "backward moved.",
        "",
    ]
    lines += [
        "| heads q / kv | G | mask | burst fwd + bwd | side | burst (query side) fwd + bwd | ring fwd + bwd "
        "| ulysses fwd + bwd | burst / min(ring, query side) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for world in (int(w) for w in args.worlds.split(",") if w):
        began = time.time()
        per_rank = spawn_world(measure, args.tokens, HEADS, args.dim, scale, nproc=world, threads=1, timeout=3000)
        print(f"G={world}: {time.time() - began:.0f} s", flush=True)
        masks = sorted({key[2] for key in per_rank[0]}, key=lambda m: (m != "causal", m))
        for hq, hk in HEADS:
            for mask in masks:
                cells, totals = [], {}
                for strategy in STRATEGIES:
                    got = [r[(hq, hk, mask, strategy)] for r in per_rank]
                    if isinstance(got[0], str):
                        cells.append("refused")
                        continue
                    fwd, bwd = sum(g[0] for g in got), sum(g[1] for g in got)
                    totals[strategy] = fwd + bwd
                    cells.append(f"{_mib(fwd)} + {_mib(bwd)}")
                    if strategy == "burst":
                        cells.append(got[0][2])
                ratio = totals["burst"] / min(totals["ring"], totals["burst (query side)"])
                worst = max(worst, ratio)
                lines.append(f"| {hq} / {hk} | {world} | {mask} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    lines += ["", f"Worst burst / min(ring, burst's query side): {worst:.3f} (1.000: burst never sends more).", ""]
    lines += [
        "Planner (burst.plan.cost.estimate): one attention layer, forward + backward, causal zigzag, "
        f"{FULL_TOKENS} tokens, bf16, head_dim {args.dim}; milliseconds.",
        "",
        "| cluster | heads q / kv | burst | ring | ulysses | burst's backward moves |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in planner_rows(HEADS, args.dim, FULL_TOKENS)]
    if args.time:
        best = spawn_world(time_step, 8192, 32, 8, args.dim, 2, nproc=2, threads=1, timeout=3000)[0]
        lines += [
            "",
            "This CPU, 2 ranks x 1 thread, 8192 tokens, 32 / 8 heads, causal zigzag, fwd + bwd (best of 2):",
            "",
            "| strategy | seconds |",
            "|---|---|",
        ] + [f"| {s} | {t:.2f} |" for s, t in best.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
