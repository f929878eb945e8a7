"""`burst bench --calibrate`: measure this machine for the planner's `local` profile.

The attention FLOP/s one rank sustains through burst's whole forward + backward at 4K tokens on two
ranks (the kernel and the loop around it; the kernel alone is kept as `kernel_flops`), and the
point-to-point bandwidth and latency between two local gloo ranks sending to each other at once
(as a ring step does). Saved as JSON where
burst.plan.profiles.calibrated_local() finds it, so `burst plan --profile local` and
`strategy="auto"` use what was measured.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from ..kernels import cpu_flash
from ..launch import run_world
from ..plan.cost import pair_flops
from ..plan.profiles import CALIBRATION_FILE


def measure_flops(tokens: int = 2048, heads: int = 8, head_dim: int = 64, repeats: int = 3) -> float:
    """Attention FLOP/s of this process's CPU kernel: forward + backward of one full block."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, tokens, heads, head_dim, generator=g) for _ in range(4))
    scale = head_dim**-0.5
    best = float("inf")
    for _ in range(repeats + 1):  # one warm-up
        start = time.perf_counter()
        out, lse = cpu_flash.forward(q, k, v, scale, False)
        cpu_flash.backward(dout, q, k, v, out, lse, scale, False)
        best = min(best, time.perf_counter() - start)
    return sum(pair_flops(tokens * tokens, 1, heads, head_dim)) / best


def _exchange_seconds(nbytes: int, repeats: int) -> float:
    """Best time of both ranks sending `nbytes` to each other at once."""
    rank = dist.get_rank()
    peer = 1 - rank
    send = torch.ones(max(1, nbytes // 4))
    recv = torch.empty_like(send)
    best = float("inf")
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
        for r in reqs:
            r.wait()
        best = min(best, time.perf_counter() - start)
    return best


def measure_ring_flops(tokens: int = 4096, heads: int = 8, head_dim: int = 64, repeats: int = 2) -> float:
    """Attention FLOP/s per rank of burst's whole forward + backward on this world (full mask):
    the kernel plus what the loop around it costs (merges, accumulation, transfers at this size)."""
    import burst

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v, dout = (torch.randn(1, tokens // world, heads, head_dim, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    best = float("inf")
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        burst.attention(q, k, v, strategy="burst").backward(dout)
        best = min(best, time.perf_counter() - start)
    return sum(pair_flops(tokens * tokens, 1, heads, head_dim)) / world / best


def _link_on_rank(rank, world, sizes):
    times = {n: _exchange_seconds(n, repeats=5) for n in sizes}
    return times, measure_flops(), measure_ring_flops()


def calibrate(threads: int = 1, path: str | None = CALIBRATION_FILE) -> dict:
    """Measure on 2 local ranks x `threads` threads; save to `path` (None: do not save)."""
    small, large = 4096, 16 << 20
    times, kernel_flops, ring_flops = run_world(_link_on_rank, (small, large), nproc=2, threads=threads)
    bandwidth = (large - small) / max(1e-9, times[large] - times[small])
    latency = max(0.0, times[small] - small / bandwidth)
    # The planner's rate is the whole loop's (a ring step's merges and accumulation cost ~10-20% on
    # CPU beyond the kernel); the kernel's own rate is kept for reference.
    result = {
        "flops": ring_flops,
        "kernel_flops": kernel_flops,
        "bandwidth": bandwidth,
        "latency": latency,
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result
