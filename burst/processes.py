"""What a process is doing, read from /proc: whether a peer or a launcher still runs, or has been stopped.

A zombie (exited, not yet reaped by its parent) does not run, though kill(pid, 0) still succeeds on it. Where
there is no /proc (not Linux), a signal 0 tells only whether the pid exists.
"""

from __future__ import annotations

import os


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter from /proc (R, S, D, T stopped, t traced, Z, X...), None when it is
    gone; "?" where /proc cannot tell (unreadable, or not Linux): then it is taken to run."""
    if not os.path.isdir("/proc/self"):
        return _exists_by_signal(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
    except OSError:
        return "?"


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not)."""
    return process_state(pid) not in ("Z", "X", None)


def _exists_by_signal(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, someone else's
        pass
    return "?"
