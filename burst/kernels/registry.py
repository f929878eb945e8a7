"""Which kernel backend runs a call: the backends fastest first, each with its `SPEC` (kernels/spec.py).

A new backend is a module beside this one with forward/backward, its planning attributes and a SPEC,
and one line in BACKENDS at the place its speed earns. Auto-selection takes the first backend that
runs the call's device, dtype and head dims, that is preferred on this GPU (its fastest_from), that
is proven on its device, and that serves this kind of call (softcap or not). BURST_KERNEL (what `--kernel`
sets) names one instead: one that cannot run here is a ValueError raised in validation, on every rank
before any collective; one not yet proven runs with a one-time warning.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import aten_flash, cpu_flash, cuda_flash_attn, cuda_sdpa, cudnn, flex, reference
from .softcap import Softcapped

KERNEL_ENV = "BURST_KERNEL"  # auto (the default), or one backend by name: what `burst ... --kernel` sets

# Fastest first, where each runs (benchmarks/gpu.md has the measurements).
BACKENDS = (cpu_flash, cudnn, cuda_flash_attn, aten_flash, cuda_sdpa, flex, reference)


def kernels_by_name() -> dict:
    """Backends by the names BURST_KERNEL and `--kernel` take, fastest first."""
    return {kernel.SPEC.name: kernel for kernel in BACKENDS}


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    softcap: float = 0.0,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
):
    """The backend module for tensors on `device` with `dtype` (and these head dims, when given), or
    the one BURST_KERNEL names; softcap > 0: one that takes it, with it bound (softcap.Softcapped)."""
    wanted = os.environ.get(KERNEL_ENV, "auto")
    if wanted != "auto":
        kernel = named_kernel(wanted, device, dtype)
        if not kernel.SPEC.takes_head_dims(head_dim, v_head_dim):
            multiple, largest = kernel.SPEC.head_dims
            raise ValueError(
                f"{KERNEL_ENV}={wanted}: takes equal q and v head dims that are multiples of {multiple} "
                f"up to {largest}, not {head_dim} and {v_head_dim}"
            )
        if softcap and not kernel.SOFTCAP:
            takers = ", ".join(name for name, k in kernels_by_name().items() if k.SOFTCAP)
            raise ValueError(f"{KERNEL_ENV}={wanted}: takes no softcap (those that do: {takers})")
    else:
        kernel = _fastest(device, dtype, bool(softcap), head_dim, v_head_dim)
    return Softcapped(kernel, softcap) if softcap else kernel


def _fastest(device: torch.device, dtype: torch.dtype, softcapped: bool, head_dim, v_head_dim):
    for kernel in BACKENDS:
        spec = kernel.SPEC
        serves = spec.auto == "always" or (spec.auto == "softcap" and softcapped)
        if (
            serves
            and spec.proven
            and (kernel.SOFTCAP or not softcapped)
            and spec.preferred_on(device)
            and spec.takes_head_dims(head_dim, v_head_dim)
            and spec.why_not(device, dtype) is None
        ):
            return kernel
    raise ValueError(f"no attention kernel runs {dtype} on {device.type}")  # reference runs everything


def check_kernel_name(name: str) -> None:
    """ValueError unless `name` is "auto" or a backend's name (what BURST_KERNEL and --kernel take)."""
    known = kernels_by_name()
    if name != "auto" and name not in known:
        raise ValueError(f"{KERNEL_ENV}={name!r} is not one of auto, {', '.join(known)}")


def named_kernel(name: str, device: torch.device, dtype: torch.dtype):
    """The backend `name` (ValueError saying why when it cannot run here); an unproven one warns once."""
    check_kernel_name(name)
    kernel = kernels_by_name()[name]
    problem = kernel.SPEC.why_not(device, dtype)
    if problem:
        raise ValueError(f"{KERNEL_ENV}={name}: {problem}")
    if not kernel.SPEC.proven:
        _warn_unproven(name)
    return kernel


_warned: set[str] = set()


def _warn_unproven(name: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"burst: {KERNEL_ENV}={name} runs a kernel path not yet checked on a GPU (benchmarks/gpu.md); "
            "run `burst check --device cuda` with it before trusting a run",
            stacklevel=3,
        )
