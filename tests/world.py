"""Run a function on every rank of a local gloo world and bring back what each rank returned.

Each test module starts one world per size and loops over its cases inside it (a world per case
would cost seconds of process start-up each). A rank that raises sends back its traceback, and the
parent raises it, so a failure shows where it happened. The same launcher runs the CLI's --nproc.
"""

from __future__ import annotations

import contextlib
import functools
import os

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
    """subprocess.run(cmd) in a session of its own; past `timeout`, the session and every process below it are
    killed (torchrun starts its workers in sessions of their own: a plain timeout, or killing the session, left
    them running and holding the pipes, so the wait never ended) and TimeoutExpired raised."""
    import signal
    import subprocess

    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = descendants(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


def process_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process from /proc/PID/stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), fields[19]


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every process below `root` (the start time tells a reused pid apart)."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := process_stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append(int(entry))
            starts[int(entry)] = stat[2]
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = starts[pid]
        todo += children.get(pid, [])
    return found
