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

Which backend runs a call: kernels/registry.py (the backends fastest first, each with its SPEC).
"""

from __future__ import annotations

from . import aten_flash, cpu_flash, cuda_flash_attn, cuda_sdpa, cudnn, flex, reference
from .accumulators import accumulator_dtype, lse_for_backward, out_from_delta, row_delta
from .registry import KERNEL_ENV, kernels_by_name, named_kernel, select_kernel
from .softcap import Softcapped

__all__ = [
    "KERNEL_ENV",
    "Softcapped",
    "accumulator_dtype",
    "aten_flash",
    "cpu_flash",
    "cuda_flash_attn",
    "cuda_sdpa",
    "cudnn",
    "flex",
    "kernels_by_name",
    "lse_for_backward",
    "named_kernel",
    "out_from_delta",
    "reference",
    "row_delta",
    "select_kernel",
]
