"""MiniMax-M3's block indexer, shown the whole sequence; its choice handed to burst as BlockIndices.

MiniMaxM3VLIndexer scores each query against every key with index_n_heads light heads (one per KV
head), max-pools the scores into blocks of index_block_size keys, boosts the index_local_blocks
blocks ending at the query's own, and keeps each query's index_topk_blocks best blocks per head:
block_indices (batch, index_n_heads, seq, topk), -1 for none. On a shard it would score the shard's
keys only, and number the blocks from the shard's first key. `show_blocks_whole_sequence(model,
group, layout)` (its entry of backend/features.py, so every door that prepares a model) takes over
each indexer's forward as indexer.py does DeepSeek's: its cache hook `update_index` is handed a
stand-in that gathers the indexer's keys (one index_head_dim vector per token) in global order, so
transformers' own code scores, pools and picks over the whole sequence, against the rows' global
position_ids (shard_batch's), and the block numbers it returns are global. The attention function
hands them to burst.attention as burst.BlockIndices((batch, seq_local, kv_heads, topk), block_size):
a selection per KV head, which the heads of its group share, as eager's build_block_mask expands it.

Ties: a row's scores come from the same code on the same projections as in one process; blocks
whose pooled scores tie exactly (none with continuous weights) may be picked in another order.
Packed documents are refused (indexer.py's one_sequence_per_row). Decoding on burst's ShardedCache keeps
the indexer's keys whole on every rank, as indexer.py does DeepSeek's; each KV head then attends the
entries of its chosen blocks (decoding.chosen_positions).
"""

from __future__ import annotations

import torch

from .configs import PreparedConfigs
from .indexer import indexer_keys, one_sequence_per_row, take_over_indexers

_prepared = PreparedConfigs()  # the configs of models whose block indexers see the whole sequence


def is_block_indexer(module: torch.nn.Module) -> bool:
    """A MiniMax-M3-style indexer: block_size, topk_blocks and local_blocks, keys through update_index."""
    return type(module).__name__.endswith("Indexer") and all(
        hasattr(module, a) for a in ("block_size", "topk_blocks", "local_blocks", "layer_idx")
    )


def has_block_indexer(attention: torch.nn.Module) -> bool:
    """Whether an attention module picks key blocks with a block indexer (MiniMax-M3's sparse layers)."""
    found = getattr(attention, "indexer", None)
    return found is not None and is_block_indexer(found)


def prepared(config) -> bool:
    return config in _prepared


def show_blocks_whole_sequence(model: torch.nn.Module, group=None, layout="contiguous") -> int:
    """Take over the forward of every block indexer of `model` (the module docstring); returns how
    many. ValueError for a layout whose shards are not runs of positions known here (doc_*)."""
    return take_over_indexers(
        model, is_block_indexer, _whole_sequence_block_indexer, _prepared, "block-sparse attention", group, layout
    )


class _IndexKeys:
    """The cache the indexer reads its keys through (cache.layers[i].update_index): `keys`, indexer.py's
    _GatheredKeys (a forward over shards) or _KeptKeys (a decode step on a ShardedCache), under the layer."""

    def __init__(self, keys, layer_idx: int):
        self._keys, self._layer = keys, layer_idx

    @property
    def layers(self):
        return self

    def __getitem__(self, layer_idx):
        return self

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: (batch, 1, tokens, index_head_dim) -> (batch, 1, seq, index_head_dim) in global order."""
        return self._keys.update_indexer(keys.squeeze(1), self._layer)[:, None]


def _whole_sequence_block_indexer(
    module, forward, group, layout, hidden_states, position_embeddings, cache=None, position_ids=None, **kwargs
):
    """The indexer's forward over this rank's queries and every key: (batch, kv_heads, seq_local, topk)
    global block numbers (-1: none). On burst's ShardedCache the prompt's keys are kept, whole, and each
    decode step's new token scores them all (as indexer.py's DeepSeek indexer)."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    what = f"{type(module).__name__}: decoding on a cache with block-sparse attention under burst"
    keys, decoding = indexer_keys(cache, group, layout, what, module.layer_idx)
    if decoding:  # the new token, at its global position, scores every key so far
        positions = torch.full((hidden_states.shape[0], 1), cache.seen, device=hidden_states.device)
    else:
        rows = one_sequence_per_row(
            f"{type(module).__name__}: block-sparse attention", position_ids, group, layout, hidden_states
        )
        positions = rows[None].expand(hidden_states.shape[0], -1)
    return forward(module, hidden_states, position_embeddings, _IndexKeys(keys, module.layer_idx), positions)


def block_selection(module: torch.nn.Module, block_indices: torch.Tensor):
    """burst.BlockIndices of what the layer's indexer chose. block_indices: (batch, kv_heads, seq_local,
    topk) global block numbers as the indexer returns them; its heads are the KV heads (index_n_heads ==
    num_key_value_heads), checked."""
    from burst import BlockIndices

    kv_heads = getattr(module.config, "num_key_value_heads", None)
    if block_indices.dim() != 4 or (kv_heads is not None and block_indices.shape[1] != kv_heads):
        raise ValueError(
            f"{type(module).__name__}: block_indices of shape {tuple(block_indices.shape)}, not (batch, "
            f"num_key_value_heads={kv_heads}, seq, topk): one selection per KV head is what burst takes"
        )
    return BlockIndices(block_indices.transpose(1, 2).contiguous(), module.indexer.block_size)
