"""How a rank ends when whatever started it dies: spawn_world's launcher, or torchrun's agent.

A launcher killed outright (kill -9, the OOM killer, a scheduler's timeout) cannot end its ranks, so each rank
ends itself within a second of its launcher's death: on Linux the kernel sends it SIGKILL when its parent dies
(the forkserver, which exits when the launcher does; under torchrun, torchrun's agent), and a thread watching
the launcher's pid covers the rest. burst.launch's ranks arm it as they start; the transformers integration's
`register` arms it under torchrun (a Trainer's ranks never pass through burst.launch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from .processes import running

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_SECONDS = 0.5


def end_with_launcher(launcher: int | None) -> None:
    """End this process (SIGKILL / exit 1) within WATCH_SECONDS of its launcher's death, whatever
    killed the launcher: the parent-death signal on Linux (the parent is the forkserver, which exits
    when the launcher does, or torchrun's agent), and a daemon thread that polls the launcher's pid
    (`launcher`: None under torchrun, whose agent is the parent itself)."""
    parent = os.getppid()
    with contextlib.suppress(Exception):  # not Linux, or no libc: the watcher alone
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)
    if launcher is not None:
        threading.Thread(target=_watch, args=(launcher,), name="burst-launcher-watch", daemon=True).start()


def _watch(launcher: int) -> None:
    while True:
        time.sleep(WATCH_SECONDS)
        if not running(launcher):  # a zombie does not: a launcher killed and not yet reaped
            os._exit(1)
