"""Single-device attention kernels returning (out, lse), with a backward that takes lse.

Every backend exposes the same two functions on tensors in burst's layout:

    forward(q, k, v, scale, causal, mask) -> out, lse
    backward(dout, q, k, v, out, lse, scale, causal, mask) -> dq, dk, dv

    q, dout, out: (batch, seqlen_q, nheads, headdim)
    k, v:         (batch, seqlen_k, nheads_k, headdim); nheads divisible by nheads_k (GQA/MQA)
    lse:          (batch, nheads, seqlen_q), float32 (float64 for float64 input)
    causal:       top-left aligned lower triangle on this block (query i sees keys 0..i)
    mask:         None or a bool (seqlen_q, seqlen_k) tensor, True = attend

A row with nothing to attend gets out 0 and lse -inf. `backward` needs the *global* out and lse of the
rows (that is what makes ring backward exact); a row whose global lse is -inf gets 0 gradient.
Outputs are in the input dtype; callers accumulate in float32.
"""

from __future__ import annotations

import torch

from . import cpu_flash, cuda_flash_attn, cuda_sdpa, reference


def select_kernel(device: torch.device, dtype: torch.dtype):
    """The fastest backend module for tensors on `device` with `dtype`."""
    if device.type == "cpu":
        return cpu_flash
    if device.type == "cuda" and dtype in cuda_flash_attn.DTYPES and cuda_flash_attn.available():
        return cuda_flash_attn
    if device.type == "cuda" and dtype != torch.float64:
        return cuda_sdpa
    return reference


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows with nothing to attend) replaced by +inf, so exp(s - lse) = 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def out_from_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for `out` whose rowsum(dout * out) equals `delta`.

    Flash backward kernels take `out` only to compute delta = rowsum(dout * out). BurstAttention's
    backward (burstengine.md Alg. 2) moves delta instead of out around the ring, so on arrival we
    rebuild the projection of out onto dout: (delta / |dout|^2) * dout. Its norm never exceeds |out|,
    so it is as safe in half precision as out itself.

    dout: (batch, seqlen, nheads, headdim); delta: (batch, nheads, seqlen) float32.
    """
    acc = accumulator_dtype(dout.dtype)
    norm2 = torch.linalg.vector_norm(dout, dim=-1, dtype=acc).square_()  # (b, s, h), no full-size temporary
    coef = torch.where(norm2 > 0, delta.transpose(1, 2) / norm2.clamp_min(torch.finfo(acc).tiny), 0.0)
    if dout.dtype == acc:
        return dout * coef.unsqueeze(-1)
    return (dout.to(acc) * coef.unsqueeze(-1)).to(dout.dtype)


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) in float32 (float64 for float64 input), (batch, nheads, seqlen)."""
    acc = accumulator_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: float32 for every input dtype but float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


__all__ = ["accumulator_dtype", "select_kernel", "lse_for_backward", "out_from_delta", "row_delta", "cpu_flash", "cuda_flash_attn", "cuda_sdpa", "reference"]
