"""Run a function on every rank of a local gloo world and bring back what each rank returned.

Each test module starts one world per size and loops over its cases inside it (a world per case
would cost seconds of process start-up each). A rank that raises sends back the traceback, and the
parent raises it, so a failure shows where it happened.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - sent to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(world: int, fn, *args, timeout: float = 600):
    """fn(rank, world, *args) on `world` local processes; returns the list of results by rank."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, _free_port(), fn, args, outdir), nprocs=world,
                                 join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"world of {world} did not finish in {timeout}s (a rank hung?)")
        results = [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]
    errors = [f"rank {r}:\n{res}" for r, (status, res) in enumerate(results) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res for _, res in results]
