"""The one way burst starts a world: the one torchrun gave this process, or a local one it spawns.

    result = run_world(fn, nproc=2)    # fn(rank, world) on nproc spawned CPU processes -> rank 0's result
    # under torchrun: fn runs once in this process, in the given world
    results = spawn_world(fn, nproc=4) # always spawned: every rank's result, by rank

`burst bench | check | train | generate`, the benchmark harness, the benchmark scripts and the
tests (tests/world.py) all start their worlds here, so all get the same backend choice and the
same teardown (every rank past its last collective before any closes; see end_rank, leave).

A rank that raises ends the world: it saves its error and leaves at once; the launcher sees it
leave, kills every other rank (which may be waiting on it in a collective, and would wait for
ever), and raises WorldError naming the first rank that failed, its one-line message and its
traceback. A rank killed from outside (kill -9, the OOM killer) ends the world the same way, and is
the one named, not the peer whose collective broke with it.

The launcher ends every rank it started before it returns or raises, whatever ends the world: a
rank's failure, the timeout, an exception or KeyboardInterrupt in the launcher, or SIGTERM / SIGHUP
sent to the launcher alone (they become SystemExit(128 + signal) while a world runs). Ranks are
forked by multiprocessing's forkserver, so they are the forkserver's children, not the launcher's;
it kills them by pid. burst's ranks start no processes of their own (on CUDA, torch.compile's
compile workers may: they exit when their rank does). Each rank is named burst-rank-N (ps, top).

A launcher killed outright (kill -9, the OOM killer, a scheduler's timeout) cannot end anything, so
each rank ends itself within a second of its launcher's death (parent_watch.end_with_launcher): on Linux the
kernel sends it SIGKILL when its parent dies (the forkserver, which exits when the launcher does;
under torchrun, torchrun's agent), and a thread watching the launcher's pid covers the rest.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .agreement import agreement_timeout, collective_left_open, settings_from_environment
from .parent_watch import end_with_launcher
from .devices import backend_for, bind, device_of_backend, resolve_device

POLL_SECONDS = 0.05


class WorldError(RuntimeError):
    """A rank of a spawned world failed. rank: the first rank that failed; summary: its one-line
    error ("ValueError: ..."); details: its traceback. str() holds all three."""

    def __init__(self, rank: int, summary: str, details: str):
        super().__init__(f"rank {rank}: {summary}\n{details}")
        self.rank, self.summary, self.details = rank, summary, details


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(error: BaseException) -> str:
    """'ExceptionType: first line of its message' (the message alone would lose what kind of failure it was)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _backend(kind: str, world: int) -> str:
    """gloo, or nccl when asked for "auto" and every rank has a GPU (devices.resolve_device's rule)."""
    return backend_for(resolve_device("auto", world)) if kind == "auto" else kind


def _save(outdir: str, rank: int, result) -> None:
    """Written under a temporary name, then renamed: the launcher never reads half a file."""
    path = os.path.join(outdir, f"{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)


def _entry(
    rank: int,
    world: int,
    port: int,
    threads: int | None,
    backend: str,
    env: dict,
    fn,
    args,
    outdir: str,
    parent_env: dict | None = None,
    launcher: int | None = None,
) -> None:
    _name_process(f"burst-rank-{rank}")
    end_with_launcher(launcher)
    if parent_env is not None:  # a forkserver's child starts with the server's environment, not ours
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(world)),
    )
    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    try:
        settings_from_environment()  # burst was imported (in the forkserver) before this environment was set
        backend = _backend(backend, world)
        bind(device_of_backend(backend))  # cuda:LOCAL_RANK before NCCL starts, or every rank joins on GPU 0
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
    except BaseException as err:  # noqa: BLE001 - reported by the launcher, which ends the world
        _save(outdir, rank, ("error", one_line(err), traceback.format_exc(), time.time()))
        leave(1)
    _save(outdir, rank, ("ok", result))
    end_rank()


def _name_process(name: str) -> None:
    """Show this process as `name` in ps and top (Linux; elsewhere nothing): the ranks' command lines
    are the forkserver's, the same for every rank and for the server itself."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])  # the kernel keeps 15 characters


def _close_world() -> None:
    """Every rank past its last collective before any closes (a rank tearing down while a peer reads an
    all-reduce's tail aborts it, gloo); not after a check timed out here (the barrier could never pair up).
    The barrier waits the agreement's timeout at most: a peer stuck in a check this rank never makes (it ran
    out of batches first) would otherwise wait here with it, neither ever ending."""
    try:
        if not collective_left_open():
            wait = agreement_timeout()
            dist.barrier(async_op=True).wait(**({"timeout": datetime.timedelta(seconds=wait)} if wait else {}))
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer that failed is gone, or never came; the launcher reports it
        pass


def end_rank() -> None:
    """How a rank of a gloo world ends cleanly (spawn_world's ranks; scripts under torchrun too): past
    its last collective with every peer, the process group destroyed, then leave(0)."""
    _close_world()
    leave(0)


def leave(code: int) -> None:
    """End a spawned rank whose result is saved, skipping interpreter finalization: there gloo's
    worker threads can still drop tensors that need the GIL and abort the process (SIGABRT,
    "terminate called without an active exception", seen about once in 40 worlds; burst's own
    per-group caches no longer hold a group into it: comm/group_cache.py), which would fail a world
    that succeeded. A failed rank leaves at once (code 1) without waiting for peers."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_world(
    fn: Callable[..., Any],
    *args,
    nproc: int = 2,
    threads: int | None = None,
    timeout: float | None = None,
    backend: str = "gloo",
    env: dict | None = None,
) -> list[Any]:
    """fn(rank, world, *args) on `nproc` new local processes; every rank's result, by rank.

    threads per process: default cores // nproc. backend: "gloo", "nccl", or "auto" (nccl when
    every rank has a GPU). env: variables set in each rank before it starts. A rank that raises
    ends the world promptly (WorldError, a RuntimeError, naming it); a world still running after
    `timeout` seconds is killed (TimeoutError). Whatever ends the call (those, an exception or
    KeyboardInterrupt here, SIGTERM or SIGHUP: _signals_exit), every rank is dead before it returns.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory() as outdir, _signals_exit():
        context = _rank_context()
        entry_args = (nproc, free_port(), threads, backend, dict(env or {}), fn, args, outdir, dict(os.environ))
        ranks = [
            context.Process(target=_entry, args=(rank, *entry_args, os.getpid()), daemon=False) for rank in range(nproc)
        ]
        try:  # from the first start on: whatever leaves this block, no rank outlives it
            for process in ranks:
                process.start()
            left = _wait(ranks, timeout)
        finally:
            _kill(ranks)
        results = {
            r: torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
            for r in range(nproc)
            if os.path.exists(os.path.join(outdir, f"{r}.pt"))
        }
    _raise_first_error(ranks, results, left)
    return [results[r][1] for r in range(nproc)]


@contextlib.contextmanager
def _signals_exit():
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the block, so the launcher's `finally`
    ends the world's ranks: by default they end the launcher on the spot and the ranks run on (a
    `kill PID`, a scheduler's stop, a closed terminal). Only a signal nobody handles yet, and only in
    the main thread (the one place Python runs handlers); a second one while the ranks end is ignored."""

    def exit_on(signum, frame):
        signal.signal(signum, signal.SIG_IGN)  # the teardown it starts runs once, to its end
        raise SystemExit(128 + signum)

    taken = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if signum is not None and signal.getsignal(signum) == signal.SIG_DFL:
                taken[signum] = signal.signal(signum, exit_on)
    try:
        yield
    finally:
        for signum, previous in taken.items():
            signal.signal(signum, previous)


PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "burst"]
# what ranks import to run transformers' models (~4 s of CPU each); read the environment once, in the server
PRELOAD_HF = [
    "torch._dynamo",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "burst.integrations.transformers",
]


def _rank_context():
    """How ranks start: forked from a server that has imported torch and burst (multiprocessing's
    forkserver), sparing each rank the seconds of CPU a fresh interpreter spends importing them, and
    PRELOAD_HF too where the launcher has loaded transformers; like spawn, each rank is a clean process
    that unpickles its function and arguments. Spawn where forkserver does not exist (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    dynamo = ["torch._dynamo"] if "torch._dynamo" in sys.modules else []  # ~2 s, where the launcher has it
    context.set_forkserver_preload(PRELOAD + (PRELOAD_HF if "transformers" in sys.modules else dynamo))
    return context


def _wait(ranks, timeout: float | None) -> dict[int, int]:
    """Until every rank has left, or one has left with a failure, or the time is up; {rank: exit
    code} of the ranks that had left by then, before the launcher killed any."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = {rank: code for rank, code in enumerate(p.exitcode for p in ranks) if code is not None}
        if len(left) == len(ranks) or any(left.values()):
            return left
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"world of {len(ranks)} did not finish in {timeout}s (a rank hung?)")
        time.sleep(POLL_SECONDS)


def _kill(ranks) -> None:
    """SIGKILL every started rank still running, then reap each: none is left when this returns."""
    started = [p for p in ranks if p.pid is not None]
    for process in started:
        if process.exitcode is None:
            process.kill()
    for process in started:
        process.join()


def _raise_first_error(ranks, results: dict, left: dict[int, int]) -> None:
    """WorldError for the rank whose failure ended the world. `left`: the exit codes of the ranks that
    had left before the launcher killed the rest.

    First a rank killed by a signal (kill -9, the OOM killer, a crash): its peers' errors ("Connection
    reset by peer") are its echo, and they may save them before the launcher sees it gone. Then the
    rank that raised first (the others' errors are mostly its echo too: a peer gone in the middle of a
    collective). Then a rank that left without a word."""
    silent = {rank: code for rank, code in sorted(left.items()) if rank not in results}  # left without a word
    for rank, code in silent.items():
        if code < 0:
            raise _died(rank, code)
    errors = sorted((res[3], r, res[1], res[2]) for r, res in results.items() if res[0] == "error")
    if errors:
        _, rank, summary, details = errors[0]
        raise WorldError(rank, summary, details)
    for rank, code in silent.items():
        raise _died(rank, code)
    for rank, process in enumerate(ranks):
        if rank not in results:
            raise _died(rank, process.exitcode)


def _died(rank: int, code: int | None) -> WorldError:
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    if code == -9:  # SIGKILL: nothing of the rank's own said why
        how += ": SIGKILL, sent by `kill -9` or by the kernel's out-of-memory killer (`dmesg` names it)"
    return WorldError(rank, f"rank {rank} died without a result ({how})", "")


def run_world(
    fn: Callable[..., Any],
    *args,
    nproc: int = 2,
    threads: int | None = None,
    backend: str | None = None,
    env: dict | None = None,
) -> Any:
    """fn(rank, world, *args) on every rank; returns rank 0's result (this rank's under torchrun).

    Without torchrun, spawns `nproc` local processes (spawn_world; backend default gloo; env set in
    each). Under torchrun, joins its world in this process (nproc and env are torchrun's business;
    backend default: NCCL on this rank's GPU when there is one, else gloo; threads still apply).
    A verb's --device gives the backend (devices.backend_for); the rank binds its GPU first.
    """
    if under_torchrun():
        return _in_torchrun_world(fn, args, threads, backend)
    return spawn_world(fn, *args, nproc=nproc, threads=threads, backend=backend or "gloo", env=env)[0]


def _attempt_store():
    """torchrun's store under a prefix of this restart attempt, or None (not an elastic agent's store).
    After `--max-restarts` restarts a world, the agent's store still holds the dead attempt's keys
    (each rank's gloo address): a rank of the new attempt that reads one before its peer rewrites it
    connects to a port nobody listens on and the restart fails. Keys of one attempt cannot meet another's."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=datetime.timedelta(minutes=30),
    )
    return dist.PrefixStore(f"burst/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _in_torchrun_world(fn: Callable[..., Any], args: tuple, threads: int | None, backend: str | None = None) -> Any:
    """fn(rank, world, *args) in torchrun's world: NCCL on this rank's GPU (cuda:LOCAL_RANK, bound
    before the group starts) when there is one or backend says so, else gloo. A group this call
    starts, it also closes (after a barrier, as a spawned rank does); one the caller started stays open."""
    starts = not dist.is_initialized()
    end_with_launcher(None)  # torchrun's agent killed outright: this worker goes too (prctl, Linux)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    bind(device_of_backend(backend))
    if starts:
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(
                backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
            )
    if threads:
        torch.set_num_threads(threads)
    result = fn(dist.get_rank(), dist.get_world_size(), *args)
    if starts:
        _close_world()
    return result
