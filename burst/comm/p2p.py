"""Asynchronous point-to-point exchange between any ranks of a group, counted in CommStats.

`exchange` posts every send and receive of one step at once (`batch_isend_irecv`) and returns a
`Transfer`; the caller computes, then calls `Transfer.wait()`. Ranks are ranks of `group`.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from . import emulation
from .stats import record_sent, tensor_bytes
from .topology import link_between


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The default-group rank of `group_rank` in `group` (P2P ops address default-group ranks)."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


class Transfer:
    """Posted sends and receives; `received` is filled once `wait()` returns."""

    def __init__(self, requests, sending, received, deadline: float = 0.0):
        self._requests = requests
        self._sending = sending  # kept alive until the transfer is done
        self.received = received
        self._deadline = deadline  # emulated slow links: not done before this (comm/emulation.py)

    def wait(self) -> list[torch.Tensor]:
        for req in self._requests:
            req.wait()
        if self._deadline:
            emulation.wait_until(self._deadline)
        self._requests, self._sending, self._deadline = [], [], 0.0
        return self.received


def exchange(
    group: dist.ProcessGroup | None,
    phase: str,
    sends: Sequence[tuple[torch.Tensor, int, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int, int]] = (),
    into: Sequence[torch.Tensor] | None = None,
    topology=None,
) -> Transfer:
    """Send each (tensor, peer, tag) and receive into a new buffer like each (tensor, peer, tag).

    Asynchronous. A send matches the receive with the same tag on the peer (gloo matches by tag;
    NCCL by the order of the ops between two ranks, so list them in tag order). `into` gives the
    receive buffers instead of new ones. Returns a Transfer whose `received` holds the buffers, in
    `recvs` order. `topology` (a burst.Topology) classifies the bytes by link for CommStats.
    """
    posted = time.perf_counter()
    sending = [t.contiguous() for t, _, _ in sends]
    # Receive buffers are contiguous whatever the strides of `like` (a transposed view from a
    # (batch, heads, seq, dim) model, a slice): gloo and NCCL refuse strided buffers.
    received = list(into) if into is not None else [
        torch.empty(like.shape, dtype=like.dtype, device=like.device) for like, _, _ in recvs]
    ops = [dist.P2POp(dist.isend, t, global_rank(group, peer), group, tag)
           for t, (_, peer, tag) in zip(sending, sends)]
    ops += [dist.P2POp(dist.irecv, buf, global_rank(group, peer), group, tag)
            for buf, (_, peer, tag) in zip(received, recvs)]
    requests = dist.batch_isend_irecv(ops) if ops else []
    deadline = 0.0
    for t, (_, peer, _) in zip(sending, sends):
        link = link_between(topology, group, peer)
        record_sent(phase, tensor_bytes(t), link=link)
        if emulation.active():
            deadline = max(deadline, emulation.reserve(link, tensor_bytes(t), posted, "out"))
    if emulation.active():
        for buf, (_, peer, _) in zip(received, recvs):
            deadline = max(deadline, emulation.reserve(link_between(topology, group, peer), tensor_bytes(buf),
                                                       posted, "in"))
    return Transfer(requests, sending, received, deadline)
