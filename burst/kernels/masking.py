"""What every backend does the same with a tile's boolean mask."""

from __future__ import annotations

import torch


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (sq, sk), True = attend -> the float bias SDPA kernels take: 0 where True, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def clear_empty_rows(out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None):
    """Rows with nothing to attend get out 0 and lse -inf, whatever the kernel left there (the CPU
    flash op leaves lse 0, which a merge would count as weight 1).

    out: (batch, seqlen_q, nheads, headdim); lse: (batch, nheads, seqlen_q).
    """
    if mask is None:
        return out, lse
    empty = ~mask.any(-1)  # (seqlen_q,)
    if not bool(empty.any()):
        return out, lse
    return out.masked_fill(empty[None, :, None, None], 0.0), lse.masked_fill(empty, float("-inf"))
