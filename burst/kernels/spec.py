"""What a kernel backend declares about itself: `KernelSpec`, one per backend module (its `SPEC`).

The registry (kernels/registry.py) lists the backends fastest first and reads their specs to pick one
for a call's device and dtype, or to say why a named one cannot run. What a backend takes tile by
tile (masks as bands or rules, head dims, softcap) stays beside its code: `BANDS`, `RULES`, `SOFTCAP`,
`MAX_ROWS` and `handles()` are read by the planner and the kernel itself, an optional
`MIN_CHUNK_ROWS_BY_DTYPE` by the chunk stream (schedules/chunk_stream.default_chunk_rows); the spec carries
only what choosing a backend needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF = (torch.float16, torch.bfloat16)
# MAX_ROWS of a kernel with no cap of its own (fresh outputs O(rows), no score matrix): a shard is one
# call, so a one-rank call is one kernel call with no float32 merge (strategies/ring.one_call)
NO_ROW_CAP = 1 << 20


def _always() -> bool:
    return True


@dataclass(frozen=True)
class KernelSpec:
    """name: what BURST_KERNEL and `--kernel` take.
    device: "cpu" or "cuda" (None: any device).
    dtypes: the input dtypes it runs.
    available: () -> bool, whether this torch, build and GPU have it; missing: what to do when not.
    min_capability: the oldest CUDA compute capability it runs on (None: any).
    fastest_from: auto-selection prefers it on GPUs of this capability and newer (None: wherever it runs).
    head_dims: (multiple, largest) of the head dims it runs whole, equal for q and v; None: any. A
        backend may still hand single tiles on (its `handles()`); the registry skips one whose calls
        would all be handed on.
    auto: "always" (a candidate for every call), "softcap" (only for calls with a softcap, which it
        takes) or "never" (only when named).
    proven: exact on its device in a run kept in the repository (benchmarks/gpu.md for CUDA, the
        suite for the CPU). Auto-selection never picks an unproven backend; naming one warns once.
    """

    name: str
    device: str | None
    dtypes: tuple[torch.dtype, ...]
    available: Callable[[], bool] = _always
    missing: str = ""
    min_capability: tuple[int, int] | None = None
    fastest_from: tuple[int, int] | None = None
    auto: str = "always"
    proven: bool = True
    head_dims: tuple[int, int] | None = None

    def __post_init__(self):
        if self.auto not in ("always", "softcap", "never"):
            raise ValueError(f"KernelSpec {self.name}: auto must be always, softcap or never, got {self.auto!r}")

    def why_not(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run tensors of `dtype` on `device`, or None when it can."""
        if self.device is not None and device.type != self.device:
            where = "CUDA tensors" if self.device == "cuda" else "CPU tensors"
            return f"needs {where}, these are on {device.type}"
        if not self.available():
            return self.missing or f"{self.name} is not available in this torch ({torch.__version__})"
        if dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"{self.name} takes {names}, not {str(dtype).removeprefix('torch.')}"
        if self.min_capability and device.type == "cuda" and _capability(device) < self.min_capability:
            return f"{self.name} needs a GPU of compute capability {self.min_capability} or newer"
        return None

    def takes_head_dims(self, head_dim: int | None, v_head_dim: int | None) -> bool:
        """Whether it runs q (and v) head dims of these sizes itself (None: not known, taken)."""
        if self.head_dims is None or head_dim is None:
            return True
        multiple, largest = self.head_dims
        return head_dim % multiple == 0 and head_dim <= largest and v_head_dim in (None, head_dim)

    def preferred_on(self, device: torch.device) -> bool:
        """Whether auto-selection may prefer it on `device` (its fastest_from, for CUDA)."""
        return self.fastest_from is None or device.type != "cuda" or _capability(device) >= self.fastest_from


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)
