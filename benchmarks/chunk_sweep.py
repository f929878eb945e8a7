"""Burst's backward time by chunk_rows at small shards, against ring's (issue 29 item 2).

2 ranks x 1 thread, fp32, 8 heads, dim 64, best backward of 4 after a warm-up, full (contiguous) and
causal (zigzag). "burst:None" is the default chunk size, "burst:0" the paper's ring of whole blocks.

    .venv/bin/python benchmarks/chunk_sweep.py 1024,2048,4096 default,0,256,512,1024   # rows per shard, chunk sizes
"""
import sys
import time

import torch
import burst
from burst.launch import run_world

def _rank(rank, world, local_lens, chunk_rows_list, repeats):
    torch.manual_seed(0)
    out = {}
    for n in local_lens:
        q, k, v, do = (torch.randn(1, n, 8, 64) for _ in range(4))
        for causal in (False, True):
            layout = "zigzag" if causal else "contiguous"
            for name, kw in [("ring", dict(strategy="ring"))] + [(f"burst:{c}", dict(strategy="burst", chunk_rows=c)) for c in chunk_rows_list]:
                if "chunk_rows" in kw and kw["chunk_rows"] is None:
                    kw = dict(strategy="burst")
                best = float("inf")
                for _ in range(repeats + 1):
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    o = burst.attention(qq, kk, vv, causal=causal, layout=layout, **kw)
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    o.backward(do)
                    torch.distributed.barrier()
                    best = min(best, time.perf_counter() - t0)
                out[(n, causal, name)] = best
    return out

if __name__ == "__main__":
    lens = [int(x) for x in sys.argv[1].split(",")]
    chunks = [None if x == "default" else int(x) for x in sys.argv[2].split(",")]
    r0 = run_world(_rank, lens, chunks, 4, nproc=2, threads=1)
    for key in sorted(r0, key=lambda k: (k[0], k[1], k[2])):
        n, causal, name = key
        print(f"{n:6d} {'causal' if causal else 'full  '} {name:12s} bwd {r0[key]:.3f} s  vs ring {r0[key] / r0[(n, causal, 'ring')]:.3f}")
