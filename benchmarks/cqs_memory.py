"""benchmarks/cqs.md, measured section: bytes sent and live-heap peak per rank, cqs vs burst vs ring.

Real ranks (gloo, one thread each), forward + backward, full mask, fp32. Bytes are CommStats's count
(forward and backward phases); the peak is benchmarks/live_heap.py's count (glibc live heap at entry
and exit of every kernel call, merge and transfer; for cqs also its exchanges' waits and its merges),
in units of one rank's q shard; the caller's q, k, v, dO count as the 4 units they are.

    flock /tmp/burst_bench.lock .venv/bin/python benchmarks/cqs_memory.py --worlds 1,2,3,4,5,7,8
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_heap import _live_bytes_reader, _watch  # noqa: E402


def _watch_cqs(live, peak):
    import burst.strategies.cqs as mod

    inner_exchange, inner_merge = mod.exchange, mod.merge_partial

    def exchange(*args, **kwargs):
        handle = inner_exchange(*args, **kwargs)
        inner_wait = handle.wait

        def wait(*a, **k):
            try:
                return inner_wait(*a, **k)
            finally:
                peak[0] = max(peak[0], live())
        handle.wait = wait
        return handle

    def merge_partial(*args, **kwargs):
        peak[0] = max(peak[0], live())
        return inner_merge(*args, **kwargs)
    mod.exchange, mod.merge_partial = exchange, merge_partial


def _rank(rank, world, port, tokens, heads, dim, strategies, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import burst

    live, peak = _live_bytes_reader(), [0]
    _watch(live, peak)
    _watch_cqs(live, peak)
    unit = tokens // world * heads * dim * 4
    gen = torch.Generator().manual_seed(rank)
    for strategy in strategies:
        for measured in (False, True):  # a warm-up pass first
            q, k, v, dout = (torch.randn(1, tokens // world, heads, dim, generator=gen) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            base = live() - 4 * unit
            peak[0] = 0
            with burst.CommStats() as stats:
                burst.attention(q, k, v, strategy=strategy).backward(dout)
            if measured:
                results[(strategy, world, rank)] = ((peak[0] - base) / unit, stats.sent("forward") / unit,
                                                    stats.sent("backward") / unit)
            del q, k, v, dout
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4200)  # divisible by 1..8 except... 4200 = 2^3 3 5^2 7
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--worlds", default="1,2,3,4,5,7,8")
    parser.add_argument("--strategies", default="cqs,burst,ring")
    parser.add_argument("--write", action="store_true", help="replace the measured section of benchmarks/cqs.md")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    results = mp.Manager().dict()
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(world, port, args.tokens, args.heads, args.dim, strategies, results),
                           nprocs=world, start_method="spawn")
    lines = [f"{args.tokens} tokens, {args.heads} heads, dim {args.dim}, fp32, full mask, forward + backward; "
             "in units of one rank's q shard (tokens/G x heads x dim x 4 bytes), max over ranks.", "",
             "| G | strategy | sent forward | sent backward | live-heap peak |", "|---|---|---|---|---|"]
    for world in worlds:
        for strategy in strategies:
            rows = [results[(strategy, world, r)] for r in range(world)]
            peak, fwd, bwd = (max(row[i] for row in rows) for i in range(3))
            lines.append(f"| {world} | {strategy} | {fwd:.1f} | {bwd:.1f} | {peak:.1f} |")
    print("\n".join(lines))
    if args.write:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cqs.md")
        text = open(path).read()
        if MEASURED not in text:
            text += "\n" + "\n".join([MEASURED, "", "(table)", "", END]) + "\n"
        head, _, rest = text.partition(MEASURED)
        body, _, tail = rest.partition(END)
        # Replace the description line and the table; keep the commentary written under it.
        kept = [ln for ln in body.split("\n") if ln and not ln.startswith("|") and not ln.startswith("(table)")
                and "tokens, " not in ln.split(";")[0] and not ln.startswith("Command:")]
        cmd = " ".join(["flock /tmp/burst_bench.lock .venv/bin/python benchmarks/cqs_memory.py"] + sys.argv[1:])
        section = "\n".join([MEASURED, "", *lines, "", *([" ".join(kept), ""] if kept else []),
                              f"Command: `{cmd}`", END])
        with open(path, "w") as f:
            f.write(head + section + tail)


MEASURED = "## Measured on real ranks: bytes and live-heap peak per rank, cqs vs burst vs ring"
END = "<!-- end of the measured section (benchmarks/cqs_memory.py --write) -->"


if __name__ == "__main__":
    main()
