"""Index selections: each query attends only the keys it chose (DeepSeek sparse attention's top-k).

`burst.attention(..., indices=)` takes, for this rank's queries, the global positions of the keys
each one attends: (batch, seqlen_q_local, k) ints, -1 for no key. Unlike MaskSpec (one mask for
every batch row and every call, planned once and cached), a selection is data of this call and of
each batch row, so it is applied on top of the planned tiles: for a tile, `selected` turns the
rows' indices into a (batch, tile queries, tile keys) bool from the tile's key positions (its
Segment: first, stride, length) without building anything of the global length, and the kernel
gets it intersected with the tile's own mask (kernels/attend.py). A tile whose selection is empty
is not computed. The selection carries no gradient.
"""

from __future__ import annotations

import torch

from ..layout import Segment


def selected(indices: torch.Tensor, q: Segment, k: Segment) -> torch.Tensor:
    """(batch, q.length, k.length) bool: query row i of the tile chose key row j of the tile.

    indices: (batch, rows, topk) global key positions of the rows of the block the tile's queries
    come from (-1: none); q.rows picks the tile's rows, k gives its keys' global positions.
    """
    idx = indices[:, q.rows].to(torch.long)
    offset = idx - k.first
    col = torch.div(offset, k.stride, rounding_mode="floor")
    hit = (idx >= 0) & (offset >= 0) & (offset % k.stride == 0) & (col < k.length)
    out = torch.zeros(idx.shape[0], idx.shape[1], k.length + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(2, torch.where(hit, col, k.length), True)  # misses land in the extra column, dropped
    return out[..., : k.length]
