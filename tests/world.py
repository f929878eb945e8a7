"""Run a function on every rank of a local gloo world and bring back what each rank returned.

Each test module starts one world per size and loops over its cases inside it (a world per case
would cost seconds of process start-up each). A rank that raises sends back its traceback, and the
parent raises it, so a failure shows where it happened. The same launcher runs the CLI's --nproc.
"""

from __future__ import annotations

import functools

from burst.launch import spawn_world


def run_world(world: int, fn, *args, timeout: float = 600):
    """fn(rank, world, *args) on `world` local processes of one thread each; the results by rank."""
    return spawn_world(fn, *args, nproc=world, threads=1, timeout=timeout)


def results_by_world(fn, *args, timeout: float = 600):
    """results(world): run_world(world, fn, *args) the first time a world size is asked for, the
    same results after, so every test of a module reads one world per size."""

    @functools.lru_cache(maxsize=None)
    def results(world: int):
        return run_world(world, fn, *args, timeout=timeout)

    return results


def value_error_text(call) -> str | None:
    """The text of the ValueError `call()` raises; None when it raises none (other errors propagate)."""
    try:
        call()
    except ValueError as err:
        return str(err)
    return None


def value_errors(cases: dict) -> dict:
    """{case: value_error_text(call)} for each call of `cases`, in order: what each refusal said."""
    return {case: value_error_text(call) for case, call in cases.items()}


def run_torchrun(script, nproc: int, *args: str, timeout: float = 240) -> str:
    """`torchrun --standalone --nproc-per-node nproc script args` as a user runs it (one thread per
    rank); its stdout. Fails with the tail of stderr when it exits non-zero."""
    import os
    import pathlib
    import sys

    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    done = run_process_group(
        [str(torchrun), "--standalone", f"--nproc-per-node={nproc}", str(script), *args],
        timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_process_group(cmd, timeout: float, env=None):
    """subprocess.run(cmd) in a session of its own; past `timeout`, the whole session is killed (torchrun's
    workers too, which a plain timeout would leave running) and TimeoutExpired raised."""
    import os
    import signal
    import subprocess

    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)
