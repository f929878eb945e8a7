"""lse's gradient through any strategy's backward, unchanged: one more channel.

d lse_i / d s_ij = P_ij, so a loss that reads lse (a caller merging burst's (out, lse) with another
partial attention) adds dlse_i P_ij to the scores' gradient: dS = P ∘ (dP − D + dlse). A flash backward
computes dP_ij = dO_i · v_j and D_i = rowsum(dO_i ∘ O_i). Append a channel holding 1 to v and one
holding dlse_i to dO, and zeros to q, k and O: the scores and D are unchanged, dP_ij gains dlse_i, and
dq, dk, dv are the first headdim channels of the widened ones. So every strategy's loops (and every
kernel) run as they are, on widened tensors; a row whose dO is zero but dlse is not still has a
nonzero widened dO (kernels.out_from_delta rebuilds its O from D alone, which stays exact).

The extra channels are padded to CHANNELS so that GPU kernels keep their head-dim alignment; only the
first is used. Only a backward whose lse was read pays for them (autograd hands None otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHANNELS = 8


def zeros_after(t: torch.Tensor) -> torch.Tensor:
    """t (..., d) -> (..., d + CHANNELS), the new channels zero: q, k and O."""
    return F.pad(t, (0, CHANNELS))


def ones_after(v: torch.Tensor) -> torch.Tensor:
    """v (..., d) -> (..., d + CHANNELS), the first new channel 1: every key's value carries a 1."""
    extra = v.new_zeros(*v.shape[:-1], CHANNELS)
    extra[..., 0] = 1
    return torch.cat([v, extra], dim=-1)


def dlse_after(dout: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """dout (batch, seqlen, heads, d) -> (..., d + CHANNELS), the first new channel dlse (batch, heads,
    seqlen), in dout's dtype."""
    extra = dout.new_zeros(*dout.shape[:-1], CHANNELS)
    extra[..., 0] = dlse.transpose(1, 2)
    return torch.cat([dout, extra], dim=-1).contiguous()


def narrowed(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A widened tensor's gradient, its first channels: the gradient of `like`."""
    return None if grad is None else grad[..., : like.shape[-1]]
