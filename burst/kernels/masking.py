"""What every backend does the same with a tile's mask.

A tile's mask comes as kernel arguments (masks.Bands), as a rule over positions (masks.PositionRule)
or as a dense bool (seqlen_q, seqlen_k) tensor. A backend that takes none of the first two turns any
of them into the dense additive bias its kernel takes:
the last resort, counted in CommStats.dense_masks so tests and benchmarks can see when it happens.
"""

from __future__ import annotations

import torch

from ..comm.stats import record_dense_mask
from ..masks import Bands, PositionRule


def dense_mask(mask: torch.Tensor | Bands | PositionRule | None, device) -> torch.Tensor | None:
    """The tile's mask as a bool (seqlen_q, seqlen_k) tensor on `device`, True = attend."""
    if mask is None:
        return None
    if isinstance(mask, (Bands, PositionRule)):
        return mask.allowed(device)
    return mask.to(device, non_blocking=True)


def additive_mask(
    mask: torch.Tensor | Bands | PositionRule | None, dtype: torch.dtype, device=None
) -> torch.Tensor | None:
    """The float bias SDPA kernels take: 0 where the mask attends, -inf elsewhere (None: no mask)."""
    mask = dense_mask(mask, device)
    if mask is None:
        return None
    record_dense_mask()
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def clear_empty_rows(out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None):
    """Rows with nothing to attend get out 0 and lse -inf, whatever the kernel left there (the CPU
    flash op leaves lse 0, which a merge would count as weight 1). On a GPU the fill runs whether or
    not a row is empty (asking would sync with the host); on the CPU asking is free and saves copies.

    out: (batch, seqlen_q, nheads, headdim); lse: (batch, nheads, seqlen_q); mask: dense bool
    (seqlen_q, seqlen_k), or (batch, 1, seqlen_q, seqlen_k) for an index selection, or None.
    """
    if mask is None:
        return out, lse
    empty = ~mask.any(-1)  # (seqlen_q,) or (batch, 1, seqlen_q)
    if empty.device.type == "cpu" and not bool(empty.any()):
        return out, lse
    rows = empty[None, :, None, None] if empty.dim() == 1 else empty.transpose(1, 2)[..., None]
    return out.masked_fill(rows, 0.0), lse.masked_fill(empty, float("-inf"))
