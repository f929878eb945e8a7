"""Peak memory for the benchmarks: held_bytes, reset_peak and peak_bytes (burst/memory.py, which the
engine's training metrics read too), and the live-heap ruler.

On the CPU the resident set moves with glibc's retained pages, not only with what a step holds; the
ruler that sees tensors there is the live heap (live_heap_bytes: bytes malloc has handed out and not
got back), read after every op by HeapPeak (benchmarks/engine_memory.py, benchmarks/live_heap.py).
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import held_bytes, peak_bytes, reset_peak  # below both bench and the engine

__all__ = ["held_bytes", "peak_bytes", "reset_peak", "live_heap_bytes", "HeapPeak"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.lru_cache(maxsize=1)
def _mallinfo2():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def live_heap_bytes() -> int:
    """Bytes malloc has handed out and not got back (glibc mallinfo2: in-use arena chunks + mmapped
    chunks): what this process's CPU tensors (and Python objects) hold now, without the pages glibc
    keeps after frees that the resident set also counts. Linux/glibc only (OSError elsewhere)."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


class HeapPeak(TorchDispatchMode):
    """The live heap's peak over a region, read after every tensor op (a ruler that sees tensors).

        with HeapPeak() as ruler:
            loss = model(x); loss.backward()
        ruler.peak["forward"], ruler.peak["backward"], ruler.peak_op[...], ruler.at_backward

    Peaks are kept apart for ops run outside and inside an autograd backward ("forward" and
    "backward"); at_backward is the live heap when the first backward op ran, i.e. what the forward
    keeps for the backward (plus the loss). peak_s says when each peak came (seconds from the start).
    Reading mallinfo2 after each op costs microseconds per op: a measurement tool, not for timed runs.
    A peak inside one op (its scratch) is not seen, only what the op returns while its inputs are alive.

    With `interval_s`, the ruler also keeps a timeline: each interval's highest live heap, as
    (seconds at the interval's end, phase, bytes), and calls `on_interval(ruler)` after each, so a
    run too long to finish can leave what it measured so far.
    """

    def __init__(self, interval_s: float = 0.0, on_interval=None):
        super().__init__()
        self._t0 = time.perf_counter()
        self.start = live_heap_bytes()
        self.peak = {"forward": self.start, "backward": self.start}
        self.peak_op = {"forward": None, "backward": None}
        self.peak_s = {"forward": 0.0, "backward": 0.0}
        self.at_backward = None
        self.interval_s, self.on_interval = interval_s, on_interval
        self.timeline: list[tuple[float, str, int]] = []
        self._interval_top, self._interval_end, self._phase = 0, interval_s, "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if phase == "backward" and self.at_backward is None:
            self.at_backward = live_heap_bytes()
        out = func(*args, **(kwargs or {}))
        live = live_heap_bytes()
        if live > self.peak[phase]:
            self.peak[phase], self.peak_op[phase] = live, str(func)
            self.peak_s[phase] = time.perf_counter() - self._t0
        if self.interval_s > 0:
            self._keep_timeline(phase, live)
        return out

    def _keep_timeline(self, phase: str, live: int, closing: bool = False) -> None:
        self._interval_top, self._phase = max(self._interval_top, live), phase
        now = time.perf_counter() - self._t0
        if now >= self._interval_end or closing:
            self.timeline.append((now, phase, self._interval_top))
            self._interval_top, self._interval_end = 0, now + self.interval_s
            if self.on_interval is not None:
                self.on_interval(self)

    def __exit__(self, *exc):
        if self.interval_s > 0 and self._interval_top:  # the last, unfinished interval
            self._keep_timeline(self._phase, live_heap_bytes(), closing=True)
        return super().__exit__(*exc)
