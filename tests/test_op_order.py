"""The order of communication ops on every rank, as NCCL needs it (recorded on a CPU world).

NCCL pairs a send with a receive by their order between two ranks (not by tag, as gloo and the
shared-memory channels do), and runs a collective only when every rank of the group calls it in the
same order. A program that is right on gloo can hang on NCCL. So every strategy's forward and
backward, each layout and mask, runs here with every point-to-point op recorded (burst.comm.OpLog)
and every collective call logged, and for each ordered pair of ranks (a, b) the sends a posts to b
must be exactly the receives b posts from a (tag, shape and dtype, in order), and every rank must
call the same collectives in the same order. One world of 4 ranks, also as 2 nodes of 2 (the double
ring's intra- and inter-node rings).
"""

from __future__ import annotations

import burst
import torch
import torch.distributed as dist
from burst.comm import OpLog

from world import results_by_world

WORLD = 4
SEQ = 128
CASES = [
    (strategy, layout, mask)
    for strategy in (
        "burst",
        "ring",
        "distflash",
        "usp",
        "cqs",
        "ulysses",
        "allgather",
        "burst:double ring",
        "ring:double ring",
    )  # 2 nodes of 2 ranks: the topology-aware rings
    for layout in ("contiguous", "zigzag", "striped")
    for mask in ("causal", "window", "documents", "full")
]
MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(40, 0)),
    "documents": dict(causal=True, cu_seqlens=(0, 30, 50, 128)),
    "full": {},
}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_gather_object",
)


def _log_collectives(log: list) -> None:
    """Wrap torch.distributed's collectives (and burst's own handles on them) to log each call."""
    from burst.comm import collectives

    def logged(name, fn):
        def call(*args, **kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            log.append((name, tuple(tensor.shape) if tensor is not None else None))
            return fn(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, logged(name, getattr(dist, name)))
    collectives.all_gather_flat = logged("all_gather_flat", collectives.all_gather_flat)
    collectives.reduce_scatter_flat = logged("reduce_scatter_flat", collectives.reduce_scatter_flat)


def _record(rank, world):
    calls = []
    _log_collectives(calls)
    torch.manual_seed(0)  # the same inputs on every rank
    results = []
    for strategy, layout, mask in CASES:
        q, k, v = (torch.randn(1, SEQ, 4, 8) for _ in range(3))
        q, k, v = (burst.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
        calls.clear()
        name, _, variant = strategy.partition(":")
        topology = burst.Topology(local_world_size=2) if variant == "double ring" else None
        with OpLog() as log:
            try:
                out = burst.attention(q, k, v, strategy=name, layout=layout, topology=topology, **MASKS[mask])
            except ValueError:  # a strategy that refuses this layout or mask: refused alike on every rank
                results.append(((strategy, layout, mask), None, None))
                continue
            out.sum().backward()
        results.append(((strategy, layout, mask), log.ops, list(calls)))
    return results


_results = results_by_world(_record)


def test_sends_and_receives_pair_up_in_order_between_every_two_ranks():
    by_rank = _results(WORLD)
    checked = 0
    for i, (case, _, _) in enumerate(by_rank[0]):
        logs = [by_rank[r][i][1] for r in range(WORLD)]
        assert all(by_rank[r][i][0] == case for r in range(WORLD))
        if logs[0] is None:
            assert all(log is None for log in logs), case  # refused on every rank, or none
            continue
        for a in range(WORLD):
            for b in range(WORLD):
                sent = [op[2:] for op in logs[a] if op[0] == "send" and op[1] == b]
                received = [op[2:] for op in logs[b] if op[0] == "recv" and op[1] == a]
                assert sent == received, (case, a, b, sent[:4], received[:4])
        checked += case[0].partition(":")[0] in ("burst", "ring") and all(logs)
    assert checked == 4 * 3 * len(MASKS)  # burst and ring (flat and double ring) ran every layout and mask


def test_every_rank_calls_the_same_collectives_in_the_same_order():
    by_rank = _results(WORLD)
    for i, (case, ops, _) in enumerate(by_rank[0]):
        if ops is None:
            continue
        calls = [by_rank[r][i][2] for r in range(WORLD)]
        assert all(c == calls[0] for c in calls), (case, [c[:6] for c in calls])
