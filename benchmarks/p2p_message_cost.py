"""What one exchange costs between 2 local CPU ranks: gloo's send/recv against the shared-memory
channels (burst/comm/shm_p2p.py), by message size. Both ranks send one message to each other and
wait for the other's; a cell is the median over 5 rounds of 50 exchanges, per exchange.

    .venv/bin/python benchmarks/p2p_message_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from burst.comm.p2p import exchange, host_channels, open_host_channels
from burst.launch import run_world

SIZES_KIB = (8, 64, 512, 1024, 4096)
ROUNDS, EXCHANGES = 5, 50


def _per_exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, through_channels: bool) -> float:
    rounds = []
    for _ in range(ROUNDS + 1):  # the first round warms up
        dist.barrier()
        start = time.perf_counter()
        for i in range(EXCHANGES):
            if through_channels:
                exchange(None, "forward", [(send, peer, i)], [(recv, peer, i)], into=[recv]).wait()
            else:
                ops = [dist.P2POp(dist.isend, send, peer, tag=i), dist.P2POp(dist.irecv, recv, peer, tag=i)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        rounds.append((time.perf_counter() - start) / EXCHANGES)
    return statistics.median(rounds[1:])


def _rank(rank, world):
    open_host_channels(None)
    channels = host_channels(None)
    peer = 1 - rank
    rows = []
    for kib in SIZES_KIB:
        send, recv = torch.randn(kib * 256), torch.empty(kib * 256)
        gloo = _per_exchange(send, recv, peer, False)
        shared = _per_exchange(send, recv, peer, True) if channels is not None and channels.carries(send) else None
        rows.append((kib, gloo, shared))
    return rows


def main() -> None:
    rows = run_world(_rank, nproc=2, threads=1)
    print("| message KiB | gloo ms per exchange | channels ms per exchange | gloo / channels |")
    print("|---|---|---|---|")
    for kib, gloo, shared in rows:
        if shared is None:
            print(f"| {kib} | {gloo * 1e3:.3f} | - (over the 1 MiB bound: gloo) | - |")
        else:
            print(f"| {kib} | {gloo * 1e3:.3f} | {shared * 1e3:.3f} | {gloo / shared:.1f}x |")


if __name__ == "__main__":
    main()
