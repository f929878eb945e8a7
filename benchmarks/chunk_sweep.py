"""Burst's backward time by chunk_rows at small shards, against ring's (issue 29 item 2).

2 ranks x 1 thread, fp32 (or DTYPE: bfloat16, float16), 8 heads, dim 64, full (contiguous) and
causal (zigzag). Each repetition runs ring and every burst variant once, one after another, so that
the machine's drift reaches all of them alike; a variant's figure is the median over repetitions of
its backward time over ring's in the same repetition, with the 25th-75th percentile range.
"default" is burst's default chunk size, "0" the paper's ring of whole blocks.

    .venv/bin/python benchmarks/chunk_sweep.py 1024,2048,4096 default,0,256,512,1024 [REPEATS [DTYPE]]
"""

import statistics
import sys
import time

import torch

import burst
from burst.launch import run_world


def _backward_seconds(q, k, v, do, causal: bool, options: dict) -> float:
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o = burst.attention(qq, kk, vv, causal=causal, layout="zigzag" if causal else "contiguous", **options)
    torch.distributed.barrier()
    start = time.perf_counter()
    o.backward(do)
    torch.distributed.barrier()
    return time.perf_counter() - start


def _rank(rank, world, local_lens, chunk_rows_list, repeats, dtype=torch.float32):
    torch.manual_seed(0)
    variants = [("ring", dict(strategy="ring"))] + [
        (f"burst:{c}", dict(strategy="burst") if c == "default" else dict(strategy="burst", chunk_rows=int(c)))
        for c in chunk_rows_list
    ]
    ratios = {}
    for n in local_lens:
        q, k, v, do = (torch.randn(1, n, 8, 64).to(dtype) for _ in range(4))
        for causal in (False, True):
            for _, options in variants:  # warm-up
                _backward_seconds(q, k, v, do, causal, options)
            for _ in range(repeats):
                times = {name: _backward_seconds(q, k, v, do, causal, options) for name, options in variants}
                for name, t in times.items():
                    ratios.setdefault((n, causal, name), []).append(t / times["ring"])
                ratios.setdefault((n, causal, "ring seconds"), []).append(times["ring"])
    return ratios


def main() -> None:
    lens = [int(x) for x in sys.argv[1].split(",")]
    chunks = sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    if repeats < 2:
        sys.exit("chunk_sweep.py: REPEATS must be at least 2 (a cell is a median with quartiles)")
    dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
    ratios = run_world(_rank, lens, chunks, repeats, dtype, nproc=2, threads=1)
    names = [f"burst:{c}" for c in chunks]
    print(f"| rows per shard | mask | {' | '.join(chunks)} | ring bwd s (median) |")
    print("|---|---|" + "---|" * (len(chunks) + 1))
    for n in lens:
        for causal in (False, True):
            cells = []
            for name in names:
                q1, q2, q3 = statistics.quantiles(ratios[(n, causal, name)], n=4)
                cells.append(f"{q2:.3f} ({q1:.2f}-{q3:.2f})")
            ring_s = statistics.median(ratios[(n, causal, "ring seconds")])
            print(f"| {n} | {'causal' if causal else 'full'} | {' | '.join(cells)} | {ring_s:.3f} |")


if __name__ == "__main__":
    main()
