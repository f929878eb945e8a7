"""Single-device attention kernels returning (out, lse), with a backward that takes lse.

Every backend exposes the same two functions on tensors in burst's layout:

    forward(q, k, v, scale, causal, mask) -> out, lse
    backward(dout, q, k, v, out, lse, scale, causal, mask) -> dq, dk, dv

    q, dout, out: (batch, seqlen_q, nheads, headdim)
    k, v:         (batch, seqlen_k, nheads_k, headdim); nheads divisible by nheads_k (GQA/MQA)
    lse:          (batch, nheads, seqlen_q), float32 (float64 for float64 input)
    causal:       top-left aligned lower triangle on this block (query i sees keys 0..i)
    mask:         None, a bool (seqlen_q, seqlen_k) tensor (True = attend), masks.Bands (the mask as
                  kernel arguments, planned for a backend that sets BANDS = True) or masks.PositionRule
                  (the tile's rule, for one that sets RULES = True); a backend handed one it cannot
                  take builds a dense bias from it (masking.additive_mask, counted in CommStats)

A row with nothing to attend gets out 0 and lse -inf. `backward` needs the *global* out and lse of the
rows (that is what makes ring backward exact); a row whose global lse is -inf gets 0 gradient.
Outputs are in the input dtype; callers accumulate in float32.
"""

from __future__ import annotations

import os

import torch

from . import aten_flash, cpu_flash, cuda_flash_attn, cuda_sdpa, flex, reference
from .accumulators import accumulator_dtype, lse_for_backward, out_from_delta, row_delta
from .softcap import Softcapped


KERNEL_ENV = "BURST_KERNEL"  # auto (the default), or one backend by name: what `burst ... --kernel` sets


def select_kernel(device: torch.device, dtype: torch.dtype, softcap: float = 0.0):
    """The fastest backend module for tensors on `device` with `dtype`, or the one BURST_KERNEL names
    (ValueError when it cannot run here: raised in validation, on every rank, before any collective).
    softcap > 0: the fastest that takes it, with it bound (softcap.Softcapped)."""
    wanted = os.environ.get(KERNEL_ENV, "auto")
    if wanted != "auto":
        kernel = named_kernel(wanted, device, dtype)
        if softcap and not getattr(kernel, "SOFTCAP", False):
            raise ValueError(f"{KERNEL_ENV}={wanted}: takes no softcap (those that do: flash_attn, flex, reference)")
        return Softcapped(kernel, softcap) if softcap else kernel
    if softcap:
        return Softcapped(_fastest_with_softcap(device, dtype), softcap)
    return _fastest(device, dtype)


def _fastest_with_softcap(device: torch.device, dtype: torch.dtype):
    kernel = _fastest(device, dtype)
    if getattr(kernel, "SOFTCAP", False):
        return kernel
    if device.type == "cuda" and dtype != torch.float64 and flex.available():
        return flex
    return reference  # explicit scores, MAX_ROWS at a time (the CPU's path)


def _fastest(device: torch.device, dtype: torch.dtype):
    if device.type == "cpu":
        return cpu_flash
    if device.type == "cuda" and dtype in cuda_flash_attn.DTYPES and cuda_flash_attn.available():
        return cuda_flash_attn
    if device.type == "cuda" and dtype in aten_flash.DTYPES and aten_flash.available():
        return aten_flash  # the FlashAttention-2 inside torch: SDPA's flash backend, with lse in and out
    if device.type == "cuda" and dtype != torch.float64:
        # aten's efficient kernel, not FlexAttention: on an H200 (benchmarks/gpu.md) compiled flex_attention
        # hit dynamo's recompile limit over a run's tile shapes, dtypes and grad modes and fell back to
        # its unfused path (0.03x SDPA); flex serves softcap (_fastest_with_softcap) and BURST_KERNEL=flex
        return cuda_sdpa
    return reference


def kernels_by_name() -> dict:
    """Backends by the names BURST_KERNEL and `--kernel` take."""
    return {"cpu_flash": cpu_flash, "flash_attn": cuda_flash_attn, "aten_flash": aten_flash, "flex": flex,
            "sdpa": cuda_sdpa, "reference": reference}


def named_kernel(name: str, device: torch.device, dtype: torch.dtype):
    known = kernels_by_name()
    if name not in known:
        raise ValueError(f"{KERNEL_ENV}={name!r} is not one of auto, {', '.join(known)}")
    problem = None
    if name == "cpu_flash" and device.type != "cpu":
        problem = f"runs on the CPU, the tensors are on {device.type}"
    elif name in ("flash_attn", "aten_flash", "sdpa") and device.type != "cuda":
        problem = f"needs CUDA tensors, these are on {device.type}"
    elif name == "flash_attn" and not cuda_flash_attn.available():
        problem = ("flash_attn (2.7 or newer) does not import here: pip install flash-attn, or leave "
                   f"{KERNEL_ENV} unset to use the flash kernel inside torch (aten_flash) or SDPA")
    elif name == "flash_attn" and dtype not in cuda_flash_attn.DTYPES:
        problem = f"flash_attn takes float16 and bfloat16, not {dtype}"
    elif name == "aten_flash" and not aten_flash.available():
        problem = (f"this torch ({torch.__version__}) or GPU has no flash attention with window arguments "
                   "(an sm80+ GPU and torch 2.5 or newer built with it)")
    elif name == "aten_flash" and dtype not in aten_flash.DTYPES:
        problem = f"aten's flash kernel takes float16 and bfloat16, not {dtype}"
    elif name == "flex" and not flex.available():
        problem = f"this torch ({torch.__version__}) has no FlexAttention with lse output"
    elif name == "sdpa" and dtype == torch.float64:
        problem = "aten's efficient kernel takes no float64 (reference does)"
    if problem:
        raise ValueError(f"{KERNEL_ENV}={name}: {problem}")
    return known[name]


__all__ = ["KERNEL_ENV", "Softcapped", "accumulator_dtype", "aten_flash", "kernels_by_name", "named_kernel", "select_kernel", "lse_for_backward",
           "out_from_delta", "row_delta", "cpu_flash", "cuda_flash_attn", "cuda_sdpa", "flex", "reference"]
