"""Asynchronous point-to-point exchange between any ranks of a group, counted in CommStats.

`exchange` posts every send and receive of one step at once (`batch_isend_irecv`) and returns a
`Transfer`; the caller computes, then calls `Transfer.wait()`. Ranks are ranks of `group`.

gloo sends and receives host memory only (it hands the tensor's pointer to its TCP transport), so
on a gloo group device tensors travel through host copies: sent from a host copy, received into a
host buffer and copied onto the device buffer in `wait()`. That lets several ranks share one GPU
(NCCL refuses two ranks on one device), at host-copy speed: for checking, not for speed.

CPU tensors between ranks of one host travel through shared memory instead, once
`open_host_channels(group)` has set that up (comm/shm_p2p.py; burst.attention does it on its first
call on a gloo group): one copy in, one copy out, instead of gloo's socket round.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from . import emulation
from .group_cache import GroupCache
from .shm_p2p import HostChannels
from .stats import record_sent, tensor_bytes
from .topology import link_between

_CHANNELS = GroupCache()  # process group -> its HostChannels, or None where they cannot be had
_OP_LOGS: list["OpLog"] = []


class OpLog:
    """The point-to-point operations this rank posts, in order, while the context is active.

    NCCL matches a send with a receive by their order between two ranks, not by tag: a program is
    safe on NCCL when, for every ordered pair of ranks (a, b), the sends a posts to b and the receives
    b posts from a are the same sequence (tags, shapes and dtypes pairwise equal). gloo and the
    shared-memory channels match by tag and would not notice a mismatch; record the ops on each rank
    of a CPU world and compare them (tests/test_op_order.py does, for every strategy).

    ops: ("send" | "recv", peer's global rank, tag, shape, dtype name), in the order exchange posts them.
    """

    def __init__(self) -> None:
        self.ops: list[tuple[str, int, int, tuple[int, ...], str]] = []

    def __enter__(self) -> "OpLog":
        _OP_LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OP_LOGS.remove(self)


def _log_ops(group, sends, recvs) -> None:
    ops = [("send", global_rank(group, peer), tag, tuple(t.shape), str(t.dtype)) for t, peer, tag in sends]
    ops += [("recv", global_rank(group, peer), tag, tuple(t.shape), str(t.dtype)) for t, peer, tag in recvs]
    for log in _OP_LOGS:
        log.ops.extend(ops)


def open_host_channels(group: dist.ProcessGroup | None) -> None:
    """Collective over `group`, the first time for each group (later calls return at once): set up
    shared-memory channels for `exchange` between its ranks when they are all on this host and the
    group is gloo's. Every rank of the group must call it at the same point of its program."""
    if _CHANNELS.holds(group):
        return
    usable = dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"
    _CHANNELS.put(group, HostChannels.create(group) if usable else None)


def host_channels(group: dist.ProcessGroup | None) -> HostChannels | None:
    """The group's shared-memory channels, if open_host_channels set them up."""
    return _CHANNELS.of(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The default-group rank of `group_rank` in `group` (P2P ops address default-group ranks)."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


class Transfer:
    """Posted sends and receives; `received` is filled once `wait()` returns."""

    def __init__(
        self, requests, sending, received, deadline: float = 0.0, host_received=None, channels=None, shared=()
    ):
        self._requests = requests
        self._channels, self._shared = channels, shared  # receives posted on HostChannels
        self._sending = sending  # kept alive until the transfer is done
        self.received = received
        self._deadline = deadline  # emulated slow links: not done before this (comm/emulation.py)
        self._host_received = host_received  # gloo with device tensors: copied onto `received` on wait

    def wait(self) -> list[torch.Tensor]:
        for recv in self._shared:
            self._channels.complete(recv)
        for req in self._requests:
            req.wait()
        if self._deadline:
            emulation.wait_until(self._deadline)
        if self._host_received is not None:
            for buf, host in zip(self.received, self._host_received):
                buf.copy_(host)
        self._requests, self._sending, self._deadline, self._host_received = [], [], 0.0, None
        self._shared = ()
        return self.received


def through_host(group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor]) -> bool:
    """True when `tensors` must travel through host copies: device tensors on a gloo group."""
    return any(t.device.type != "cpu" for t in tensors) and dist.get_backend(group) == "gloo"


def tagged(tensors: Sequence[torch.Tensor], peer: int, tag: int) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, peer, tag + i) for the i-th tensor: one transfer of several tensors, as `exchange`
    takes it (comm/tags.py leaves room after each base tag for a loop's largest set)."""
    return [(t, peer, tag + i) for i, t in enumerate(tensors)]


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
    if _OP_LOGS:
        _log_ops(group, sends, recvs)
    sending = [t.contiguous() for t, _, _ in sends]
    # Receive buffers are contiguous whatever the strides of `like` (a transposed view from a
    # (batch, heads, seq, dim) model, a slice): gloo and NCCL refuse strided buffers.
    received = (
        list(into)
        if into is not None
        else [torch.empty(like.shape, dtype=like.dtype, device=like.device) for like, _, _ in recvs]
    )
    wire_sent, wire_received, host_received = sending, received, None
    if through_host(group, sending + received):
        wire_sent = [t.to("cpu", copy=True) for t in sending]
        wire_received = host_received = [torch.empty(b.shape, dtype=b.dtype) for b in received]
    # Through shared memory where the group has channels: a send is copied now (None), or went to gloo
    # because its ring was full (a request); a receive is completed in Transfer.wait.
    channels = host_channels(group) if host_received is None else None
    carried = channels.carries if channels is not None else lambda t: False
    redirected = [channels.send(t, peer, tag) for t, (_, peer, tag) in zip(wire_sent, sends) if carried(t)]
    shared = [channels.post_recv(buf, peer, tag) for buf, (_, peer, tag) in zip(wire_received, recvs) if carried(buf)]
    ops = [
        dist.P2POp(dist.isend, t, global_rank(group, peer), group, tag)
        for t, (_, peer, tag) in zip(wire_sent, sends)
        if not carried(t)
    ]
    ops += [
        dist.P2POp(dist.irecv, buf, global_rank(group, peer), group, tag)
        for buf, (_, peer, tag) in zip(wire_received, recvs)
        if not carried(buf)
    ]
    requests = [r for r in redirected if r is not None] + (dist.batch_isend_irecv(ops) if ops else [])
    deadline = 0.0
    for t, (_, peer, _) in zip(sending, sends):
        link = link_between(topology, group, peer)
        record_sent(phase, tensor_bytes(t), link=link)
        if emulation.active():
            deadline = max(deadline, emulation.reserve(link, tensor_bytes(t), posted, "out"))
    if emulation.active():
        for buf, (_, peer, _) in zip(received, recvs):
            deadline = max(
                deadline, emulation.reserve(link_between(topology, group, peer), tensor_bytes(buf), posted, "in")
            )
    return Transfer(requests, wire_sent, received, deadline, host_received, channels, shared)
