"""RingComm: post the next block's transfer around a ring, compute, then wait (double buffering).

Modelled on ring-flash-attention's RingComm. A strategy loop reads like the papers' algorithms:

    nxt = comm.send_recv(block)   # start moving this block to the next rank, receive the previous one's
    ...compute on block...        # overlaps with the transfer
    comm.wait(); block = nxt      # swap buffers

Ranks are ranks of `group`. Every `send_recv` sends to rank+1 and receives from rank-1 (mod world).
With one rank the ring is a loop-back: `send_recv` returns the tensors themselves and sends nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .stats import record_sent, tensor_bytes


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
        if self.world > 1:
            self.send_to = global_rank(group, (self.rank + 1) % self.world)
            self.recv_from = global_rank(group, (self.rank - 1) % self.world)
        self._requests: list = []
        self._sending: list[torch.Tensor] = []

    def send_recv(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Start sending `tensors` to the next rank; return buffers that `wait()` fills from the previous."""
        if self._requests:
            raise RuntimeError("RingComm.send_recv called twice without wait()")
        if self.world == 1:
            return list(tensors)
        received = [torch.empty_like(t) for t in tensors]
        # Keep the sent tensors alive until wait(): the transfer reads them in the background.
        self._sending = [t.contiguous() for t in tensors]
        ops = []
        for i, (out, inc) in enumerate(zip(self._sending, received)):
            ops.append(dist.P2POp(dist.isend, out, self.send_to, self.group, self.tag + i))
            ops.append(dist.P2POp(dist.irecv, inc, self.recv_from, self.group, self.tag + i))
        self._requests = dist.batch_isend_irecv(ops)
        record_sent(self.phase, sum(tensor_bytes(t) for t in tensors), messages=len(tensors))
        return received

    def wait(self) -> None:
        for req in self._requests:
            req.wait()
        self._requests = []
        self._sending = []


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The default-group rank of `group_rank` in `group` (P2P ops address default-group ranks)."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)
