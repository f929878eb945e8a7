"""Where a CLI command runs: the world torchrun gave it, or a local gloo world it spawns itself.

    result = run_world(fn, nproc=2)    # fn(rank, world) on nproc spawned CPU processes -> rank 0's result
    # under torchrun: fn runs once in this process, in the given world

`burst bench | check | train | generate` all take `--nproc N` this way.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, threads: int | None, fn, args, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if threads:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    if dist.is_initialized():
        try:  # every rank past its last collective before any closes its connections: a rank that
            # tears down while a peer still reads the tail of an all-reduce aborts that peer (gloo)
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer that failed is gone; its error is already saved
            pass
        dist.destroy_process_group()
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End a spawned rank whose result is saved, skipping interpreter finalization: there gloo's
    worker threads can still drop tensors that need the GIL and abort the process (SIGABRT,
    "terminate called without an active exception", seen about once in 40 worlds), which would
    fail a world that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_world(fn: Callable[..., Any], *args, nproc: int = 2, threads: int | None = None,
                timeout: float | None = None) -> list[Any]:
    """fn(rank, world, *args) on `nproc` new local CPU processes (gloo); every rank's result, by rank.

    threads per process: default cores // nproc. A rank that raises makes this raise RuntimeError
    with its traceback; a world still running after `timeout` seconds is killed (TimeoutError).
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(nproc, free_port(), threads, fn, args, outdir), nprocs=nproc,
                                 join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"world of {nproc} did not finish in {timeout}s (a rank hung?)")
        results = [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(nproc)]
    errors = [f"rank {r}:\n{res}" for r, (status, res) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [res for _, res in results]


def run_world(fn: Callable[..., Any], *args, nproc: int = 2, threads: int | None = None) -> Any:
    """fn(rank, world, *args) on every rank; returns rank 0's result (this rank's under torchrun).

    Without torchrun, spawns `nproc` local CPU processes on gloo (spawn_world).
    """
    if under_torchrun():
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    return spawn_world(fn, *args, nproc=nproc, threads=threads)[0]
