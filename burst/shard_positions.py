"""The positions a model numbers its tokens by, inside burst.context_parallel: a model that looks a table up at
rows 0..n-1 of its shard (learned absolute positions: arange(seq_len) + offset) embeds every rank's tokens at the
first rank's positions. These read a lookup's indices and say whether they count from the shard's start
(context_parallel refuses the next SDPA call then, on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm.membership import group_rank, group_size
from .layout import DocumentLayout, shard_indices


def held_positions(layout, group, local_len) -> torch.Tensor | None:
    """The global positions this rank's buffers hold, (local_len,) int64; None where positions do not run
    across the whole sequence (packed documents restart them) or no buffer was given."""
    if local_len is None or isinstance(layout, DocumentLayout):
        return None
    world = group_size(group)
    rank = group_rank(group)
    return shard_indices(layout, rank, world, local_len * world)


def position_lookup(func, args, kwargs) -> torch.Tensor | None:
    """The indices of a table lookup a model may number positions with: F.embedding (BART, Pegasus), a
    learned table's rows indexed (`self.wpe.weight[positions]`) or a row index_select (MusicGen's sinusoidal
    table); None for any other call."""
    if func is F.embedding:
        return args[0] if args else kwargs.get("input")
    if func is torch.Tensor.__getitem__:
        return _rows_indexed(*args)
    if func in (torch.index_select, torch.Tensor.index_select):
        source = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        # A fixed table (MusicGen's sinusoids), not activations: an MoE gathering an expert's tokens
        # from hidden states that need gradients may pick a whole run of them.
        if dim != 0 or not isinstance(source, torch.Tensor) or source.requires_grad:
            return None
        return args[2] if len(args) > 2 else kwargs.get("index")
    return None


def _rows_indexed(table, index) -> torch.Tensor | None:
    """The integer tensor indexing a Parameter's rows (`table[idx]`, `table[idx, :]`); None for anything else
    (activations gathered by index are not positions)."""
    if isinstance(index, tuple):
        rest_whole = all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index[1:])
        index = index[0] if index and rest_whole else None
    if not isinstance(table, torch.nn.Parameter) or not isinstance(index, torch.Tensor):
        return None
    return None if index.is_floating_point() or index.dtype == torch.bool else index


def counts_from_shard_start(indices: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether an embedding's `indices` (..., seq_local) are one run p, p+1, ... on every row that cannot be this
    rank's positions plus an offset: the model numbered the shard's own tokens 0..n-1 (BART's learned positions
    are arange(seq_len) + 2), so every rank but the first embeds its tokens at the first rank's positions."""
    n = held.numel()
    if indices.dim() == 0 or indices.shape[-1] != n or n < 2 or indices.is_floating_point():
        return False
    rows = indices.reshape(-1, n)
    run = rows[:1, :1] + torch.arange(n, device=rows.device)
    if not torch.equal(rows, run.expand_as(rows)):
        return False
    consecutive = torch.equal(held, held[0] + torch.arange(n))
    return not consecutive or int(rows[0, 0]) < int(held[0])
