"""Point-to-point transfers between the CPU ranks of one host through shared memory.

gloo moves a CPU tensor through a TCP socket on the loopback: the sending thread writes it into the
kernel, the receiver's reads it out, and each message pays a round of system calls and thread
wake-ups. Measured here on 2 local ranks: ~0.15 ms per exchange of anything up to 512 KiB, 2.3 ms for
4 MiB, and in a 2-rank masked backward the posting of sends and receives took ~8% of the step.
Through a shared-memory channel a message is one copy in and one copy out.

Each ordered pair of ranks (src -> dst) has a channel: a byte ring that src writes and dst reads,
with two counters (bytes ever written, bytes ever read), each written by one side only. A message is
a 64-byte header (tag, bytes, kind) and its payload; src writes the payload, then the header, then
publishes the written count, so dst (spinning on that count) never reads a half-written message
(stores are seen in program order on x86-64, as comm/shm.py's all-gather relies on).

Sends complete at once: the message is copied into the ring when posted. When the ring lacks room
(the receiver has not read what came before), the message goes through gloo instead and a header-only
"redirect" in the ring tells the receiver to post a gloo receive for it, so a sender never waits on
its receiver, as with gloo. Receives match by (peer, tag) in order, as gloo's do: a message whose
receive is not posted yet waits in the ring, and is copied aside only when a receive waits for a
message behind it. Messages larger than `largest` bytes always
go through gloo (both sides know a message's size, so both decide alike); so do device tensors.

    channels = HostChannels.create(group)        # collective; None off one host or unsupported
    channels.send(t, peer, tag)                  # None, or a gloo request (redirected)
    r = channels.post_recv(buf, peer, tag)
    channels.complete(r)                         # buf holds the message

The rings take `capacity` bytes of shared memory per ordered pair of ranks, reserved when the
channels are made; where /dev/shm cannot hold them (a container's 64 MiB default, with many ranks)
no rank uses channels. Environment: BURST_HOST_CHANNELS_MB sets the capacity (0 turns them off).
"""

from __future__ import annotations

import collections
import mmap
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from .shm import (
    SPINS_BEFORE_YIELD,
    HostAllGather,
    PeerWatch,
    create_private,
    map_private,
    peer_facts,
    private_name,
    remove_dead,
)

HEADER = 64  # bytes: (tag, payload bytes, kind) as int64, padded to a cache line
COUNTERS = 128  # written count, then read count, on separate cache lines
DATA, REDIRECT, PAD = 0, 1, 2
REDIRECT_ROOM = 64 * HEADER  # kept free for redirect headers when data would fill the ring
SLEEP_AFTER_S, SLEEP_S = 0.002, 0.0002  # a wait longer than this is long: sleep between looks


def default_capacity_mb() -> int:
    """BURST_HOST_CHANNELS_MB (default 4), read when the channels open: a spawned rank's environment is the
    launcher's by then (launch.spawn_world's env= included). ValueError naming it for what is not a whole
    number of MiB >= 0."""
    given = os.environ.get("BURST_HOST_CHANNELS_MB", "4")
    try:
        mb = int(given)
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"BURST_HOST_CHANNELS_MB={given!r} is not a whole number of MiB >= 0 (0 turns them off)")
    return mb


def _check_one_capacity(capacities: list[int]) -> None:
    """ValueError on every rank (each holds every rank's) when the ranks' ring sizes differ: a ring is mapped by
    its reader's size, and a writer of another size misreads it."""
    if len(set(capacities)) > 1:
        mib = ", ".join(f"rank {r}: {c >> 20}" for r, c in enumerate(capacities))
        raise ValueError(f"BURST_HOST_CHANNELS_MB differs across the ranks (MiB {mib}): give every rank the same")


def _round_up(n: int, to: int = HEADER) -> int:
    return -(-n // to) * to


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8, shape (nbytes,)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class _Ring:
    """One direction of one pair: the mapped ring, its counters, and the data region as a tensor."""

    def __init__(self, buffer: mmap.mmap, capacity: int):
        self.buffer, self.capacity = buffer, capacity
        self.counters = np.ndarray((2, COUNTERS // 16), dtype=np.int64, buffer=buffer)  # [0,0] written, [1,0] read
        self.data = torch.frombuffer(buffer, dtype=torch.uint8, offset=COUNTERS, count=capacity)
        self.headers = np.ndarray((capacity // 8,), dtype=np.int64, buffer=buffer, offset=COUNTERS)

    @property
    def written(self) -> int:
        return int(self.counters[0, 0])

    @property
    def read(self) -> int:
        return int(self.counters[1, 0])

    def header(self, position: int) -> tuple[int, int, int]:
        i = (position % self.capacity) // 8
        return int(self.headers[i]), int(self.headers[i + 1]), int(self.headers[i + 2])

    def put_header(self, position: int, tag: int, nbytes: int, kind: int) -> None:
        i = (position % self.capacity) // 8
        self.headers[i], self.headers[i + 1], self.headers[i + 2] = tag, nbytes, kind


class Receive:
    """A posted receive: `buf` is filled once `HostChannels.complete` returns."""

    __slots__ = ("buf", "peer", "tag", "done", "work")

    def __init__(self, buf: torch.Tensor, peer: int, tag: int):
        self.buf, self.peer, self.tag, self.done, self.work = buf, peer, tag, False, None


class _Inbox:
    """What one peer sent us: its ring, posted receives and messages not yet asked for, by tag."""

    def __init__(self, ring: _Ring):
        self.ring = ring
        self.posted: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.early: dict[int, collections.deque] = collections.defaultdict(collections.deque)


def _create_rings(paths, size: int) -> tuple[list[str], bool]:
    """Create each of `paths` as this user's ring file of `size` bytes, reserved, until one cannot be:
    (the paths created, for the caller to remove; whether every one was, with its memory). Errors are not
    raised: raised on one rank alone (a name taken by someone else, /dev/shm full or read-only), one would
    leave the other ranks waiting in the collective that follows; every rank keeps gloo instead."""
    created = []
    for path in paths:
        try:
            reserved = create_private(path, size, reserve=True)
        except OSError:
            return created, False  # not made (a name that exists is not ours to remove)
        created.append(path)
        if not reserved:
            return created, False
    return created, True


class HostChannels:
    """Shared-memory point-to-point channels between the ranks of `group` (all on this host)."""

    def __init__(
        self,
        group,
        rank: int,
        world: int,
        capacity: int,
        outgoing: dict,
        incoming: dict,
        timeout_s: float,
        watch: PeerWatch,
    ):
        self.group, self.rank, self.world, self.capacity = group, rank, world, capacity
        self.largest = capacity // 4  # larger messages go through gloo
        self.timeout_s = timeout_s
        self.sleeps = world * torch.get_num_threads() > len(os.sched_getaffinity(0))
        self._watch = watch  # a peer that exits fails our wait at once, as gloo's socket would
        self._out = outgoing  # peer -> _Ring we write
        self._in = {peer: _Inbox(ring) for peer, ring in incoming.items()}  # peer -> what it sent us

    @classmethod
    def create(cls, group=None, capacity_mb: int | None = None, timeout_s: float = 1800.0) -> "HostChannels | None":
        """Collective over `group`: the channels, or None on every rank when the ranks are not all on
        this host, the platform lacks shared memory in program order, /dev/shm cannot hold the rings,
        or the capacity is 0."""
        capacity = _round_up((default_capacity_mb() if capacity_mb is None else capacity_mb) << 20)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ok = capacity > 0 and HostAllGather.supported()
        if ok:
            remove_dead()
        prefix = private_name("p2p") if ok else ""
        paths = {src: f"{prefix}.from{src}" for src in range(world) if src != rank} if ok else {}
        # Our incoming rings, made (this user's alone, their memory reserved) before anyone looks for them.
        # False where /dev/shm lacks the room (a container's 64 MiB): a write to a mapped page it cannot
        # back would kill the process (SIGBUS), so every rank then keeps the process group's transport.
        created, ok = _create_rings(paths.values(), COUNTERS + capacity) if ok else ([], False)
        try:
            facts = [None] * world
            dist.all_gather_object(facts, (*peer_facts(), ok, prefix, capacity), group=group)
            _check_one_capacity([f[5] for f in facts])
            usable = len({f[0] for f in facts}) == 1 and all(f[3] for f in facts)
            channels = None
            if usable:
                try:
                    incoming = {src: _Ring(_map(path, COUNTERS + capacity), capacity) for src, path in paths.items()}
                    outgoing = {
                        dst: _Ring(_map(f"{facts[dst][4]}.from{rank}", COUNTERS + capacity), capacity)
                        for dst in range(world)
                        if dst != rank
                    }
                    watch = PeerWatch(f"HostChannels (rank {rank})", [f[1] for f in facts], [f[2] for f in facts])
                    channels = cls(group, rank, world, capacity, outgoing, incoming, timeout_s, watch)
                except OSError:  # a peer's rings are not here after all: every rank keeps gloo
                    channels = None
            mapped = [None] * world
            dist.all_gather_object(mapped, channels is not None, group=group)  # every rank has mapped its rings
        finally:  # mapped where needed (the memory lives until the last unmaps it), or failed: none left behind
            for path in created:
                _remove(path)
        return channels if all(mapped) else None

    def carries(self, t: torch.Tensor) -> bool:
        """Whether a message of this tensor travels here (the same answer on both sides)."""
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.largest

    # -- sending --------------------------------------------------------------------------------

    def send(self, t: torch.Tensor, peer: int, tag: int):
        """Copy contiguous `t` into the ring to group rank `peer`. Returns None, or the gloo request
        of a message redirected because the ring was full (wait on it like any gloo send)."""
        ring, nbytes = self._out[peer], t.numel() * t.element_size()
        position = self._make_room(ring, HEADER + _round_up(nbytes), HEADER + _round_up(nbytes) + REDIRECT_ROOM)
        if position is not None:
            start = position % self.capacity + HEADER
            ring.data[start : start + nbytes].copy_(_bytes_of(t))
            ring.put_header(position, tag, nbytes, DATA)
            ring.counters[0, 0] = position + HEADER + _round_up(nbytes)
            return None
        position = self._make_room(ring, HEADER, HEADER, wait=True, peer=peer)
        ring.put_header(position, tag, nbytes, REDIRECT)
        ring.counters[0, 0] = position + HEADER
        return dist.isend(t, self._global(peer), self.group, tag)

    def _make_room(self, ring: _Ring, size: int, needed: int, wait: bool = False, peer: int = -1) -> int | None:
        """The position to write a record of `size` bytes at, padding to the ring's start when it would
        straddle the end, once `needed` bytes (with the padding) are free; None when they are not and
        not `wait`."""
        written, started, spins = ring.written, None, 0
        tail = self.capacity - written % self.capacity
        pad = tail if tail < size else 0
        while self.capacity - (written - ring.read) < pad + needed:
            if not wait:
                return None
            for inbox in self._in.values():  # a peer stuck the same way on its ring to us gets room
                self._drain(inbox, aside=True)
            spins, started = self._spin(spins, started, peer, "its ring stays full: is it still receiving?")
        if pad:
            ring.put_header(written, -1, pad - HEADER, PAD)
            written += pad
            ring.counters[0, 0] = written
        return written

    # -- receiving ------------------------------------------------------------------------------

    def post_recv(self, buf: torch.Tensor, peer: int, tag: int) -> Receive:
        """Receive the next message with `tag` from group rank `peer` into contiguous `buf`."""
        recv, inbox = Receive(buf, peer, tag), self._in[peer]
        early = inbox.early.get(tag)
        if early:
            self._deliver(recv, early.popleft())
        else:
            inbox.posted[tag].append(recv)
            self._drain(inbox)
        return recv

    def complete(self, recv: Receive) -> torch.Tensor:
        """Wait until `recv`'s message is in its buffer."""
        inbox, spins, started = self._in[recv.peer], 0, None
        while not recv.done:
            # Messages not asked for yet stay in the ring (no copy) unless ours may be behind them.
            if not (self._drain(inbox) or self._drain(inbox, aside=True)):
                spins, started = self._spin(spins, started, recv.peer, f"no message with tag {recv.tag} from it")
        if recv.work is not None:
            recv.work.wait()
            recv.work = None
        return recv.buf

    def _drain(self, inbox: _Inbox, aside: bool = False) -> bool:
        """Take the peer's messages in order into their posted receives, stopping at one not asked for
        yet, or (`aside`) copying such a one aside when another message follows it. True if any taken."""
        ring, took = inbox.ring, False
        read, written = ring.read, ring.written
        while read < written:
            tag, nbytes, kind = ring.header(read)
            size = HEADER + _round_up(nbytes) if kind != REDIRECT else HEADER
            start = read % self.capacity + HEADER
            message = ring.data[start : start + nbytes] if kind == DATA else REDIRECT
            waiting = inbox.posted.get(tag) if kind != PAD else None
            if kind == PAD:
                pass
            elif waiting:
                self._deliver(waiting.popleft(), message)
            elif aside and read + size < written:
                inbox.early[tag].append(message.clone() if kind == DATA else REDIRECT)
            else:
                break
            read += size
            ring.counters[1, 0] = read
            took = True
        return took

    def _deliver(self, recv: Receive, message) -> None:
        """Fill `recv` from a message's bytes (in the ring or set aside), or post its gloo receive."""
        if isinstance(message, torch.Tensor):
            _bytes_of(recv.buf).copy_(message)
        else:  # redirected through gloo: receive it there
            recv.work = dist.irecv(recv.buf, self._global(recv.peer), self.group, recv.tag)
        recv.done = True

    def _global(self, peer: int) -> int:
        """The default-group rank of group rank `peer` (gloo's isend/irecv address those)."""
        return dist.get_global_rank(self.group or dist.group.WORLD, peer)

    def _spin(self, spins: int, started: float | None, peer: int, what: str) -> tuple[int, float | None]:
        """One look more: spin, then yield; where the host's ranks have fewer cores than threads, sleep
        between looks past SLEEP_AFTER_S of waiting, so that ranks sharing a core with waiting ones keep
        it (a sleep wakes up to ~0.1 ms late: on the critical path where every rank has its core).
        The watch looks at the peer's process every LIVENESS_S of waiting (shm.PeerWatch)."""
        spins += 1
        if spins <= SPINS_BEFORE_YIELD:
            return spins, started
        now = time.monotonic()
        if started is None:
            started = now
            self._watch.begin(now)
        waited = now - started
        if waited > self.timeout_s:
            raise RuntimeError(f"HostChannels (rank {self.rank}): rank {peer}: {what} ({self.timeout_s:.0f} s)")
        self._watch.look(peer, now, what)
        if self.sleeps and waited > SLEEP_AFTER_S:
            time.sleep(SLEEP_S)
        else:
            os.sched_yield()
        return spins, started


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _map(path: str, size: int) -> mmap.mmap:
    return map_private(path, size)
