"""Single-device attention kernels returning (out, lse), with a backward that takes lse.

Every backend exposes the same two functions on tensors in burst's layout:

    forward(q, k, v, scale, causal, mask) -> out, lse
    backward(dout, q, k, v, out, lse, scale, causal, mask) -> dq, dk, dv

    q, dout, out: (batch, seqlen_q, nheads, headdim)
    k, v:         (batch, seqlen_k, nheads_k, headdim); nheads divisible by nheads_k (GQA/MQA)
    lse:          (batch, nheads, seqlen_q), float32 (float64 for float64 input)
    causal:       top-left aligned lower triangle on this block (query i sees keys 0..i)
    mask:         None, a bool (seqlen_q, seqlen_k) tensor (True = attend), or masks.Bands: the mask
                  as kernel arguments, given only to a backend that sets BANDS = True (the others
                  would build a dense bias from it: masking.additive_mask, counted in CommStats)

A row with nothing to attend gets out 0 and lse -inf. `backward` needs the *global* out and lse of the
rows (that is what makes ring backward exact); a row whose global lse is -inf gets 0 gradient.
Outputs are in the input dtype; callers accumulate in float32.
"""

from __future__ import annotations

import torch

from . import cpu_flash, cuda_flash_attn, cuda_sdpa, flex, reference
from .accumulators import accumulator_dtype, lse_for_backward, out_from_delta, row_delta


def select_kernel(device: torch.device, dtype: torch.dtype):
    """The fastest backend module for tensors on `device` with `dtype`."""
    if device.type == "cpu":
        return cpu_flash
    if device.type == "cuda" and dtype in cuda_flash_attn.DTYPES and cuda_flash_attn.available():
        return cuda_flash_attn
    if device.type == "cuda" and dtype != torch.float64:
        return flex if flex.available() else cuda_sdpa
    return reference


__all__ = ["accumulator_dtype", "select_kernel", "lse_for_backward", "out_from_delta", "row_delta", "cpu_flash",
           "cuda_flash_attn", "cuda_sdpa", "flex", "reference"]
