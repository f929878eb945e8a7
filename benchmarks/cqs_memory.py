"""benchmarks/cqs.md, measured section: bytes sent and live-heap peak per rank, cqs vs burst vs ring.

Real ranks (gloo, one thread each), forward + backward, full mask, fp32. Bytes are CommStats's count
(forward and backward phases); the peak is benchmarks/live_heap.py's count (glibc live heap after
every tensor op, burst.bench.memory.HeapPeak), in units of one rank's q shard; the caller's q, k, v,
dO count as the 4 units they are.

    flock /tmp/burst_bench.lock .venv/bin/python benchmarks/cqs_memory.py --worlds 1,2,3,4,5,7,8
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_heap import measure_worlds  # noqa: E402


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
    results = measure_worlds(worlds, args.tokens, args.heads, args.dim, strategies, causal=False)
    lines = [
        f"{args.tokens} tokens, {args.heads} heads, dim {args.dim}, fp32, full mask, forward + backward; "
        "in units of one rank's q shard (tokens/G x heads x dim x 4 bytes), max over ranks.",
        "",
        "| G | strategy | sent forward | sent backward | live-heap peak |",
        "|---|---|---|---|---|",
    ]
    for world in worlds:
        for strategy in strategies:
            rows = [rank_results[strategy] for rank_results in results[world]]
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
        kept = [
            ln
            for ln in body.split("\n")
            if ln
            and not ln.startswith("|")
            and not ln.startswith("(table)")
            and "tokens, " not in ln.split(";")[0]
            and not ln.startswith("Command:")
        ]
        cmd = " ".join(["flock /tmp/burst_bench.lock .venv/bin/python benchmarks/cqs_memory.py"] + sys.argv[1:])
        section = "\n".join(
            [MEASURED, "", *lines, "", *([" ".join(kept), ""] if kept else []), f"Command: `{cmd}`", END]
        )
        with open(path, "w") as f:
            f.write(head + section + tail)


MEASURED = "## Measured on real ranks: bytes and live-heap peak per rank, cqs vs burst vs ring"
END = "<!-- end of the measured section (benchmarks/cqs_memory.py --write) -->"


if __name__ == "__main__":
    main()
