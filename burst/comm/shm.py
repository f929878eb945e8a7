"""All-gather of small CPU tensors between the ranks of one host, through shared memory.

Decode merges every layer's partial (out, lse) across ranks: a few hundred bytes per rank, once per
layer per token. On gloo such an all-gather costs ~0.25 ms at the median and ~0.7-1.4 ms on average
on 2 local ranks (a TCP round trip and thread wake-ups, with a long tail after compute); through
shared memory it is a write, a flag and a read: ~5 us at the median, ~10-20 us on average
(benchmarks/generate.md). DeepSpeed's CPU inference takes the same road for its all-reduce.

    gather = HostAllGather.create(1024, torch.float32, group)   # collective; None off one host
    every = gather(tensor)                                      # (world, tensor.numel()), rank order

Each rank owns two slots (one per parity of the call number): it writes its payload, then
publishes the call number; the others spin until they see it, then copy. Two slots suffice: a rank
writes call s + 2 into the slot of call s only after it read every rank's call s + 1, which each
rank published after reading call s. Publishing after the payload relies on stores becoming visible
in program order (x86-64's TSO), so other platforms keep the process group's collective.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from ..processes import process_state, running

SHM_DIR = "/dev/shm"
SPINS_BEFORE_YIELD = 2000  # then sched_yield between looks, for ranks that share a core


def private_name(kind: str, directory: str = SHM_DIR) -> str:
    """A fresh name for a shared-memory file: burst-KIND-PID-RANDOM. The random part makes it
    unguessable; the creating process's pid lets a later start tell a dead world's file (remove_dead)."""
    return os.path.join(directory, f"burst-{kind}-{os.getpid()}-{uuid.uuid4().hex}")


def remove_dead(directory: str = SHM_DIR) -> list[str]:
    """Remove the shared-memory files this user's dead processes left (a world killed with SIGKILL
    between creating its files and unlinking them, which it does as soon as every rank has mapped
    them); returns their paths. Files of live processes, and other users' files, are left alone."""
    removed = []
    for name in sorted(left_by_dead(directory)):
        if not name.startswith("burst-"):  # torch's are torch's to clean
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except FileNotFoundError:  # another rank cleaned it first
            continue
    return removed


def names(directory: str = SHM_DIR) -> set[str]:
    """The files in `directory` (none where it does not exist)."""
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def left_by_dead(directory: str = SHM_DIR) -> set[str]:
    """The names of this user's shared-memory files whose creating process has exited: burst's
    (burst-KIND-PID-RANDOM) and torch's (torch_PID_...). Files of processes still running are in use,
    not left behind: a check for what a finished run left reads this, not all that is new."""
    left = set()
    for name in names(directory):
        pid = _creator(name)
        try:
            if pid is not None and os.lstat(os.path.join(directory, name)).st_uid == os.geteuid() and not running(pid):
                left.add(name)
        except FileNotFoundError:  # unlinked meanwhile
            continue
    return left


def _creator(name: str) -> int | None:
    """The pid a shared-memory file's name holds: burst-KIND-PID-RANDOM (private_name), torch_PID_..."""
    parts = name.split("-")
    if len(parts) == 4 and parts[0] == "burst" and parts[2].isdigit():
        return int(parts[2])
    parts = name.split("_")
    if len(parts) >= 3 and parts[0] == "torch" and parts[1].isdigit():
        return int(parts[1])
    return None


LIVENESS_S = 1.0  # how often a long wait looks at its peers' processes


def host_identity() -> str:
    """This machine: its name and, where Linux tells it, its boot id (containers on two machines can
    share a host name, never a boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def pid_namespace() -> str | None:
    """This process's PID namespace (Linux: "pid:[inode]"), or None: a pid names a peer's process only inside
    one (containers that share /dev/shm need not share it)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class PeerWatch:
    """The peers' processes, looked at every LIVENESS_S of a long wait on one: a peer that has exited fails the wait
    at once (as gloo's socket would), one stopped (SIGSTOP, SIGTSTP, a debugger) for longer than the agreement
    timeout (burst.set_agreement_timeout) is named; a computing one is waited for. Peers in another PID namespace
    are not looked at (their pids name other processes here, or none)."""

    def __init__(self, owner: str, pids: list[int], namespaces: list[str | None]):
        mine = pid_namespace()
        self.owner = owner  # for messages: "HostChannels (rank 0)"
        self._pids = [pid if mine is not None and ns == mine else None for pid, ns in zip(pids, namespaces)]
        self._looked = 0.0
        self._stopped_since: dict[int, float] = {}  # peer -> when its process was first seen stopped

    def begin(self, now: float) -> None:
        """A long wait starts now: its first look comes LIVENESS_S later."""
        self._looked = now

    def look(self, peer: int, now: float, what: str) -> None:
        """Raise when `peer`'s process has exited, or has been stopped past the agreement timeout (once per
        LIVENESS_S of waiting; `what` the wait, for messages)."""
        if now - self._looked <= LIVENESS_S:
            return
        self._looked = now
        pid = self._pids[peer]
        if pid is None:
            return
        if not running(pid):
            raise RuntimeError(
                f"{self.owner}: rank {peer} (pid {pid}) has exited while this rank waited on it ({what})"
            )
        from ..agreement import agreement_timeout

        if process_state(pid) not in ("T", "t"):
            self._stopped_since.pop(peer, None)
            return
        since = self._stopped_since.setdefault(peer, now)
        limit = agreement_timeout()
        if limit and now - since > limit:
            raise TimeoutError(
                f"{self.owner}: rank {peer} (pid {pid}) has been stopped (SIGSTOP, SIGTSTP or a debugger) for "
                f"{now - since:.0f} s while this rank waited on it ({what}); the limit is the agreement timeout, "
                "burst.set_agreement_timeout(s) or BURST_AGREEMENT_TIMEOUT"
            )


def peer_facts() -> tuple:
    """What a rank tells its peers of itself when shared memory joins them: (host, pid, PID namespace)."""
    return host_identity(), os.getpid(), pid_namespace()


def create_private(path: str, size: int, reserve: bool = False) -> bool:
    """Create `path` for this user alone (mode 0600, O_EXCL: an existing file, or a link planted at
    the name, raises FileExistsError) with `size` bytes. reserve: allocate the memory now
    (posix_fallocate) and return False where the filesystem lacks the room, instead of a SIGBUS at the
    first write through a mapping; the file is left for the caller to remove."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if not reserve:
            os.ftruncate(fd, size)
            return True
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def map_private(path: str, size: int) -> mmap.mmap:
    """Map a file made by create_private, refusing (PermissionError) one that another user owns or
    that others may read or write: activations and gradients go through these pages."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"{path}: owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}; burst maps "
                "only its own user's files of mode 0600"
            )
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class HostAllGather:
    """All-gather of CPU tensors of one dtype and up to `capacity` elements among the ranks of `group`."""

    def __init__(
        self,
        buffer: mmap.mmap,
        rank: int,
        world: int,
        capacity: int,
        dtype: torch.dtype,
        timeout_s: float,
        watch: PeerWatch | None = None,
    ):
        self._buffer, self.rank, self.world, self.capacity, self.timeout_s = buffer, rank, world, capacity, timeout_s
        self.dtype = dtype
        self._watch = watch
        self._published = np.ndarray((2, world), dtype=np.int64, buffer=buffer)
        self._slots = np.ndarray((2, world, capacity), dtype=_numpy_dtype(dtype), buffer=buffer, offset=2 * world * 8)
        self._calls = 0

    @staticmethod
    def supported() -> bool:
        """Shared memory and stores seen in program order: Linux on x86-64."""
        return os.path.isdir(SHM_DIR) and platform.machine() in ("x86_64", "AMD64")

    @classmethod
    def create(
        cls, capacity: int, dtype: torch.dtype = torch.float32, group=None, timeout_s: float = 300.0
    ) -> "HostAllGather | None":
        """Collective over `group`: the gather, or None on every rank when the ranks are not all on
        this host or the platform is not supported (then use the process group's all-gather)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        facts = [None] * world
        dist.all_gather_object(facts, (*peer_facts(), cls.supported()), group=group)
        if len({f[0] for f in facts}) != 1 or not all(f[3] for f in facts):
            return None
        watch = PeerWatch(f"HostAllGather (rank {rank})", [f[1] for f in facts], [f[2] for f in facts])
        size = 2 * world * (8 + _numpy_dtype(dtype).itemsize * capacity)
        name = [None]
        if rank == 0:
            remove_dead()
            name[0] = private_name("gather")
            try:
                create_private(name[0], size)
            except OSError:  # /dev/shm read-only or full: every rank keeps the group's all-gather, none waits
                name[0] = None
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if name[0] is None:
            return None
        try:
            gather = cls(map_private(name[0], size), rank, world, capacity, dtype, timeout_s, watch)
            if rank == 0:
                gather._published[:] = -1
        except OSError:  # not mapped here: raised on one rank, it would leave the others in the collective below
            gather = None
        mapped = [None] * world
        dist.all_gather_object(mapped, gather is not None, group=group)  # also: rank 0's reset comes before any use
        if rank == 0:  # every rank has it mapped (or failed): the memory lives until the last unmaps it
            os.unlink(name[0])
        return gather if all(mapped) else None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (this gather's dtype, CPU, the same numel on each), stacked in rank
        order: (world, numel), a fresh tensor."""
        n = tensor.numel()
        if n > self.capacity or tensor.dtype != self.dtype or tensor.device.type != "cpu":
            raise ValueError(
                f"HostAllGather of capacity {self.capacity} {self.dtype} CPU elements got "
                f"{n} {tensor.dtype} on {tensor.device}"
            )
        call, parity = self._calls, self._calls % 2
        self._slots[parity, self.rank, :n] = tensor.detach().reshape(-1).numpy()
        self._published[parity, self.rank] = call
        for peer in range(self.world):
            self._wait_for(peer, parity, call)
        self._calls += 1
        return torch.from_numpy(self._slots[parity, :, :n].copy())

    def _wait_for(self, peer: int, parity: int, call: int) -> None:
        published, spins, started = self._published, 0, None
        while published[parity, peer] != call:
            spins += 1
            if spins <= SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if started is None:
                started = time.monotonic()
                if self._watch is not None:
                    self._watch.begin(started)
            elif spins % 1000 == 0:
                now = time.monotonic()
                if now - started > self.timeout_s:
                    raise RuntimeError(
                        f"HostAllGather: rank {peer} did not reach call {call} within {self.timeout_s:.0f} s (did it "
                        "fail?)"
                    )
                if self._watch is not None:
                    self._watch.look(peer, now, f"its call {call}")

    def close(self) -> None:
        """Unmap (after the last call on this rank; the others keep theirs)."""
        del self._published, self._slots
        self._buffer.close()


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
