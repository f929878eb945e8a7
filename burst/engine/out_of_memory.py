"""Running out of device memory in `burst train`: one line that says what to do, not a traceback.

The line names the length asked, the memory the step needed (the planner's estimate for these
settings, and what the allocator held when its request failed) and, for each of the memory options
(plan/lengths.py), the longest length the planner expects to fit on this device. train() raises it
after the failed step's tensors are gone (its traceback dropped, model and optimizer released, the
CUDA cache emptied), so nothing of the run is left on the device when the process ends.
"""

from __future__ import annotations

import gc
import os
import re

import torch


class TrainOutOfMemory(RuntimeError):
    """A step ran out of device memory; str() is the one line."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def device_capacity(device: torch.device) -> tuple[str, float]:
    """(profile name, memory in bytes) of `device`: H100 / H200 by the GPU's name, else `local`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        total = torch.cuda.get_device_properties(device).total_memory
        return next((p for p in ("H200", "H100", "A100") if p in name), "H100"), float(total)
    return "local", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def host_capacity() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def out_of_memory(cfg, device: torch.device, message: str) -> TrainOutOfMemory:
    """The one-line error for cfg's step that failed with torch.OutOfMemoryError `message`, after
    releasing what the run still holds on the device."""
    gc.collect()
    from ..memory import peak_bytes

    held = peak_bytes(device)  # the allocator's peak on a GPU, the resident set's on the CPU
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tried = re.search(r"Tried to allocate ([0-9.]+) (GiB|MiB)", message)
    failed = f", a {tried.group(1)} {tried.group(2)} allocation failed with {_gib(held)} held" if tried else ""
    name, capacity = device_capacity(device)
    needed, rows = _planner(cfg, name, capacity)
    longest = "; ".join(f"{r['option']} {r['longest']}" for r in rows)
    return TrainOutOfMemory(
        f"out of memory at --seq-len {cfg.seq_len} on {device} ({_gib(capacity)}): the step needs about "
        f"{_gib(needed)} (the planner's estimate for these settings){failed}; the longest the planner expects "
        f"to fit here, per memory option: {longest} (burst plan --model {cfg.model} --gpus 1 --profile {name} "
        f"--longest shows each option's flags)"
    )


def _planner(cfg, profile_name: str, capacity: float):
    from dataclasses import replace

    from ..devices import parse_dtype
    from ..plan import Cluster, Training, profile
    from ..plan.lengths import option_rows, speed_at
    from ..plan.models import PRESETS

    prof = replace(profile(profile_name), memory_bytes=capacity)
    cluster, model = Cluster(gpus=1, gpus_per_node=1, profile=prof), PRESETS[cfg.model]
    b = 2 if parse_dtype(cfg.dtype) == torch.bfloat16 else 4
    t = Training(
        model,
        cfg.seq_len,
        batch=cfg.batch,
        checkpointing=cfg.checkpointing,
        split=cfg.checkpoint_split,
        fused_loss=cfg.fused_loss,
        fsdp=False,
        offload_optimizer=cfg.offload_optimizer,
        optimizer_in_backward=cfg.offload_optimizer,
        offload_activations=cfg.offload_activations,
        offload_layers=cfg.offload_layers,
        ffn_chunk=cfg.ffn_chunk,
        dtype_bytes=b,
    )
    needed = speed_at("burst", cluster, t)["mem_bytes"]
    return needed, option_rows(model, cluster, host_memory_bytes=host_capacity(), dtype_bytes=b)
