"""Run a function on every rank of a local gloo world and bring back what each rank returned.

Each test module starts one world per size and loops over its cases inside it (a world per case
would cost seconds of process start-up each). A rank that raises sends back its traceback, and the
parent raises it, so a failure shows where it happened. The same launcher runs the CLI's --nproc.
"""

from __future__ import annotations

from burst.launch import spawn_world


def run_world(world: int, fn, *args, timeout: float = 600):
    """fn(rank, world, *args) on `world` local processes of one thread each; the results by rank."""
    return spawn_world(fn, *args, nproc=world, threads=1, timeout=timeout)
