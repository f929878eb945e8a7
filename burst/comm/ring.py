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

from typing import Sequence

import torch
import torch.distributed as dist

from .p2p import Transfer, exchange


class RingComm:
    """Asynchronous ring exchange on `group`; bytes go to CommStats under `phase`.

    `tag` separates two rings that run at once between the same pair of ranks (gloo matches messages
    by tag; NCCL orders them by issue order, which our loops keep identical on every rank).
    """

    def __init__(self, group: dist.ProcessGroup | None, phase: str, tag: int = 0):
        self.group = group
        self.phase = phase
        self.tag = tag
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self._transfer: Transfer | None = None

    def send_recv(self, tensors: Sequence[torch.Tensor], offset: int = 1) -> list[torch.Tensor]:
        """Start sending `tensors` to rank+offset; return buffers that `wait()` fills from rank-offset."""
        if self._transfer is not None:
            raise RuntimeError("RingComm.send_recv called twice without wait()")
        if offset % self.world == 0:
            return list(tensors)
        to = (self.rank + offset) % self.world
        frm = (self.rank - offset) % self.world
        self._transfer = exchange(self.group, self.phase, [(t, to, self.tag + i) for i, t in enumerate(tensors)],
                                  [(t, frm, self.tag + i) for i, t in enumerate(tensors)])
        return self._transfer.received

    def wait(self) -> None:
        if self._transfer is not None:
            self._transfer.wait()
            self._transfer = None
