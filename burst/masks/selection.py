"""Index selections: each query attends only the keys it chose (DeepSeek sparse attention's top-k).

`burst.attention(..., indices=)` takes, for this rank's queries, what each one attends:

    (batch, seqlen_q_local, topk)           global key positions, shared by every head
    (batch, seqlen_q_local, kv_heads, topk) global key positions per KV head (an indexer head per KV
                                            head: MiniMax's block indices, NSA's per-group blocks)
    BlockIndices(blocks, block_size)        either shape, each entry a block of block_size keys (block b
                                            holds keys b*block_size .. (b+1)*block_size - 1): a 64-block
                                            choice travels as 64 numbers, not 64*block_size positions

-1 is no key (no block). Unlike MaskSpec (one mask for every batch row and every call, planned once and
cached), a selection is data of this call and of each batch row, so it is applied on top of the
planned tiles: for a tile, `selected` turns the rows' entries into a bool over the tile's keys from its
key positions (its Segment: first, stride, length) without building anything of the global length,
and the kernel gets it intersected with the tile's own mask (kernels/attend.py). A tile no head's
selection reaches is not computed. The selection carries no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Segment


@dataclass(frozen=True)
class BlockIndices:
    """Key blocks each query chose. blocks: (batch, seqlen_q_local, topk) or (batch, seqlen_q_local,
    kv_heads, topk) integer block numbers, -1 for none; block b covers global keys b*block_size to
    (b+1)*block_size - 1."""

    blocks: torch.Tensor
    block_size: int

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"BlockIndices block_size must be a positive int, got {self.block_size!r}")


def selected(indices: torch.Tensor, q: Segment, k: Segment, block: int = 1) -> torch.Tensor:
    """(batch, q.length, k.length) bool, or (batch, kv_heads, q.length, k.length) for a selection per
    KV head: query row i of the tile chose (the block of) key row j of the tile.

    indices: (batch, rows[, kv_heads], topk) of the block the tile's queries come from; entries are
    global key positions (block 1) or blocks of `block` positions; q.rows picks the tile's rows, k gives
    its keys' global positions.
    """
    idx = indices[:, q.rows]
    first, last = k.first // block, k.last // block  # the blocks the tile's keys fall in
    span = last - first + 1
    # 1 + each entry's column in the tile's span of blocks; entries before the span (and -1, none
    # chosen) land in column 0, those past it in span + 1: both dropped. Two passes over the entries.
    column = torch.sub(idx, first - 1, out=torch.empty(idx.shape, dtype=torch.long, device=idx.device))
    column.clamp_(0, span + 1)
    if column.dim() == 4:
        column = column.transpose(1, 2)  # (batch, kv_heads, rows, topk)
    chosen = torch.zeros(*column.shape[:-1], span + 2, dtype=torch.bool, device=column.device)
    chosen.scatter_(-1, column, True)
    chosen = chosen[..., 1 : span + 1]
    if block == 1 and k.stride == 1:  # the tile's keys are the span itself
        return chosen
    key_blocks = torch.div(k.positions(column.device), block, rounding_mode="floor") - first
    return chosen[..., key_blocks]


def checked_selection(indices, q: torch.Tensor, kv_heads: int, global_len: int) -> tuple[torch.Tensor | None, int]:
    """burst.attention's indices= as (entries, block size): a tensor (key positions, block 1) or a
    BlockIndices, checked on every rank before any communication (ValueError / TypeError naming what
    is wrong). The values are checked on the CPU only (on a GPU the check would wait for the device)."""
    if indices is None:
        return None, 1
    block = indices.block_size if isinstance(indices, BlockIndices) else 1
    entries = indices.blocks if isinstance(indices, BlockIndices) else indices
    what = "BlockIndices blocks" if block > 1 or isinstance(indices, BlockIndices) else "indices"
    if not isinstance(entries, torch.Tensor) or entries.dtype.is_floating_point or entries.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer torch.Tensor, got {getattr(entries, 'dtype', type(entries))}")
    b, s = q.shape[0], q.shape[1]
    if (
        entries.dim() not in (3, 4)
        or tuple(entries.shape[:2]) != (b, s)
        or entries.shape[-1] == 0
        or (entries.dim() == 4 and entries.shape[2] != kv_heads)
    ):
        raise ValueError(
            f"{what} must be (batch, seqlen_local, topk) = ({b}, {s}, k >= 1) or, per KV head, "
            f"(batch, seqlen_local, kv_heads, topk) = ({b}, {s}, {kv_heads}, k >= 1); got shape "
            f"{tuple(entries.shape)}"
        )
    if entries.device != q.device:
        raise ValueError(f"{what} are on {entries.device} but q is on {q.device}")
    count = -(-global_len // block)  # key positions, or blocks (the last one may be short)
    if entries.device.type == "cpu" and entries.numel() and (int(entries.min()) < -1 or int(entries.max()) >= count):
        unit = "global key positions" if block == 1 else f"blocks of {block} keys"
        raise ValueError(
            f"{what} must be {unit} in [-1, {count}) (-1: none), got values from "
            f"{int(entries.min())} to {int(entries.max())}"
        )
    return entries, block
