"""RingComm: post the next block's transfer around a ring, compute, then wait (double buffering).

Modelled on ring-flash-attention's RingComm. A strategy loop reads like the papers' algorithms:

    nxt = comm.send_recv(block)   # start moving this block to the next rank, receive the previous one's
    ...compute on block...        # overlaps with the transfer
    comm.wait(); block = nxt      # swap buffers

Ranks are ranks of `group`. `send_recv(tensors, offset)` sends to rank+offset and receives from
rank-offset (mod world); offset 1 is the ring, -1 the ring backwards, and a larger offset sends an
accumulator straight home when a ring stops early. An offset of 0 (mod world) is a loop-back: the
tensors themselves come back and nothing is sent.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from .membership import group_rank, group_size
from .p2p import Transfer, exchange, tagged


class RingComm:
    """Asynchronous ring exchange on `group`; bytes go to CommStats under `phase`.

    `tag` separates two rings that run at once between the same pair of ranks (gloo matches messages
    by tag; NCCL orders them by issue order, which our loops keep identical on every rank).
    """

    def __init__(self, group: dist.ProcessGroup | None, phase: str, tag: int = 0, topology=None):
        self.group = group
        self.topology = topology
        self.phase = phase
        self.tag = tag
        self.world = group_size(group)
        self.rank = group_rank(group)
        self._transfer: Transfer | None = None
        # The last two buffer sets this ring received into, held weakly: an accumulator the caller has
        # dropped must be freed, not kept alive by this bookkeeping.
        self._filled: list[list[weakref.ref]] = []
        self._sent: list[torch.Tensor] = []
        self._spare: list[torch.Tensor] | None = None

    def send_recv(
        self, tensors: Sequence[torch.Tensor], offset: int = 1, to: int | None = None, frm: int | None = None
    ) -> list[torch.Tensor]:
        """Start sending `tensors` to rank+offset; return buffers that `wait()` fills from rank-offset.
        `to` and `frm` name the peers instead (group ranks), for rings that are not rank-ordered
        (the double ring's sub-rings); to == frm == this rank is a loop-back.

        Double buffering: when `tensors` is a set this ring received before (a block passed on), it is
        received into again once sent, so passing blocks around allocates two buffer sets in all
        instead of one per step (glibc keeps much of what a per-step allocation frees). A received
        set must therefore not be used after it has been sent on and the next step has begun.
        """
        if self._transfer is not None:
            raise RuntimeError("RingComm.send_recv called twice without wait()")
        to = (self.rank + offset) % self.world if to is None else to
        frm = (self.rank - offset) % self.world if frm is None else frm
        if to == self.rank and frm == self.rank:
            return list(tensors)
        into, self._spare = self._spare, None
        self._transfer = exchange(
            self.group,
            self.phase,
            tagged(tensors, to, self.tag),
            tagged(tensors, frm, self.tag),
            into=into if into is not None and _same_layout(into, tensors) else None,
            topology=self.topology,
        )
        self._sent = list(tensors)
        self._filled = [*self._filled[-1:], [weakref.ref(t) for t in self._transfer.received]]
        return self._transfer.received

    def wait(self) -> None:
        if self._transfer is not None:
            self._transfer.wait()
            self._transfer = None
            if any(_same_tensors(self._sent, filled) for filled in self._filled):
                self._spare = self._sent  # sent on and no longer ours to read: receive into it next
            self._sent = []


def _same_tensors(a: Sequence[torch.Tensor], b: Sequence[weakref.ref]) -> bool:
    return len(a) == len(b) and all(x is y() for x, y in zip(a, b))


def _same_layout(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b)
    )
