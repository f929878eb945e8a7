"""This process's memory, the one way burst reads it: held now, and the peak since a reset.

On a GPU: PyTorch's CUDA allocator (bytes in tensors). On the CPU: the resident set (VmRSS / VmHWM),
which also counts the allocator's and the runtime's own pages. Below both `burst bench`
(bench/memory.py, which adds the live-heap ruler) and the engine's training metrics.

    floor = held_bytes(device)          # before the inputs: what the call adds is above this
    reset_peak(device)
    run()
    peak = peak_bytes(device) - floor
"""

from __future__ import annotations

import resource

import torch


def held_bytes(device: torch.device) -> int:
    """Bytes held now: allocated CUDA tensors, or this process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak(device: torch.device) -> None:
    """Start a new peak window (on the CPU, Linux >= 4.0: writing 5 to clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_bytes(device: torch.device) -> int:
    """The peak since the last reset_peak (or since the process started)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
