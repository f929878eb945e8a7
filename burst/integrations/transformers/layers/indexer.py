"""DeepSeek sparse attention's lightning indexer, shown the whole sequence (DeepSeek-V3.2, GLM-5's
glm_moe_dsa, HY-V4, AXK2).

The indexer scores every earlier key for each query with a few light heads and keeps the top-k
(index_topk); the attention then attends those keys only. On a shard it would score its shard's keys
only, and choose from the wrong set. `show_whole_sequence(model, group, layout)` (its entry of backend/features.py,
so by every door that prepares a model) takes over each indexer's forward:

- its keys (one index_head_dim vector per token, far smaller than the attention's K, V) are gathered
  once per layer in global order (layout.unshard): the indexer's own cache hook `update_indexer` is
  the place, so transformers' code computes the keys, the scores and the top-k itself;
- the causal mask it scores under is built from the rows' global indices (transformers hands it the
  attention mask, which burst does not build);
- the indices it returns are then global key positions, which the attention function passes to
  burst.attention(indices=) (masks/selection.py) as the layer hands them to a custom backend.

Ties: a row's scores are computed by the same code from the same projections as in one process;
the test (tests/test_hf_dsa.py) checks the selected indices themselves, row by row, against one
process. Where a row's top-k is not unique (fewer than index_topk positive scores: the indexer's
ReLU leaves exact zeros), torch.topk breaks the exact ties in an order that depends on the last
bits of the row's other scores, which a shard's matmul need not reproduce, so such a row may attend
an equally-scored other key (benchmarks/dsa_bytes.md: 1 row of 4096 in one run).
Packed documents are refused. Decoding on burst's ShardedCache keeps the indexer's keys whole on every
rank (one index_head_dim vector a token, beside each rank's share of the latent), so each step's top-k is
the one process's; the attention then reads only the chosen entries of each rank's shard.
"""

from __future__ import annotations

import functools
import time

import torch

from burst import layout as layout_mod
from burst.comm import tensor_bytes
from burst.comm.collectives import record_to_peers

from ..keywords import cache_keyword
from .configs import PreparedConfigs, text_config

_prepared = PreparedConfigs()  # the configs of models whose indexers see the whole sequence


def is_indexer(module: torch.nn.Module) -> bool:
    """A V3.2-style indexer: scores under the attention mask, keys through cache.update_indexer.
    (DeepSeek-V4's compressed-attention indexer has another signature and stays refused.)"""
    if not (type(module).__name__.endswith("Indexer") and hasattr(module, "index_topk")):
        return False
    import inspect

    parameters = inspect.signature(type(module).forward).parameters
    return {"q_resid", "attention_mask", "position_embeddings"} <= set(parameters)


def prepared(config) -> bool:
    return config in _prepared


def show_whole_sequence(model: torch.nn.Module, group=None, layout="contiguous") -> int:
    """Take over the forward of every DSA indexer of `model` (see the module docstring); returns how
    many. ValueError for a layout whose shards are not runs of positions known here (doc_*)."""
    return take_over_indexers(
        model, is_indexer, _whole_sequence_indexer, _prepared, "DeepSeek sparse attention", group, layout
    )


def take_over_indexers(
    model: torch.nn.Module, found, whole_sequence_forward, prepared_configs: PreparedConfigs, what: str, group, layout
) -> int:
    """Every module of `model` that `found` picks runs whole_sequence_forward(module, its class's forward,
    group, layout, ...) in place of its forward; the model's configs join prepared_configs. Returns how
    many; ValueError for a layout whose shards are not runs of positions known here (doc_*)."""
    indexers = [m for m in model.modules() if found(m)]
    if not indexers:
        return 0
    if layout not in layout_mod.LAYOUTS:
        raise ValueError(
            f"{type(model).__name__}: {what}'s indexer runs under the layouts {layout_mod.LAYOUTS}, not {layout!r}"
        )
    for indexer in indexers:
        indexer.forward = functools.partial(whole_sequence_forward, indexer, type(indexer).forward, group, layout)
    prepared_configs.add(model.config, text_config(model.config))
    return len(indexers)


class _GatheredKeys:
    """The indexer's cache hook, standing in for a cache: this rank's keys in, every rank's out.

    kept: a ShardedCache's indexer_keys, where a prompt's keys (the first `length`, not the padding) stay
    for its decoding, or None. trim: the keys handed back are those too (DeepSeek's indexer): it then scores rows
    as long as one process's, whose torch.topk breaks exact ties (scores a ReLU leaves at zero) in an order the
    length changes. (MiniMax-M3's block indexer reckons its blocks from the padded length: not trimmed.)"""

    def __init__(self, group, layout: str, kept: dict | None = None, length: int = 0, trim: bool = False):
        self.group, self.layout, self.kept, self.length = group, layout, kept, length
        self.trim = trim and kept is not None

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """keys: (batch, seq_local, index_head_dim) -> (batch, seq, index_head_dim) in global order.
        Counted in CommStats under the phase "indexer" (bytes this rank sent)."""
        world, _ = layout_mod._world_and_rank(self.group)
        whole = keys
        if world > 1:
            posted = time.perf_counter()
            whole = layout_mod.unshard(keys.contiguous(), group=self.group, layout=self.layout, dim=1)
            record_to_peers("indexer", tensor_bytes(keys), self.group, posted=posted)
        if self.kept is not None:
            self.kept[layer_idx] = whole[:, : self.length]
        return self.kept[layer_idx] if self.trim else whole

    def count(self, padded: int) -> int:
        """The keys update_indexer returns of a sequence of `padded` tokens."""
        return self.length if self.trim else padded


class _KeptKeys:
    """The indexer's cache hook in a decode step on a ShardedCache: the new token's key joins the kept
    ones, and the indexer scores them all (each rank holds them whole, one index_head_dim vector a token:
    the same top-k on every rank, the choice one process makes)."""

    def __init__(self, kept: dict):
        self.kept = kept

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.kept[layer_idx] = torch.cat([self.kept[layer_idx], keys], dim=1)
        return self.kept[layer_idx]


def refuse_decoding(what: str, cache, layer_idx) -> None:
    """The layers that see the whole sequence (this indexer, compressed.py's compressors) leave a
    forward's cache as it is (transformers makes one unless use_cache=False): they gather what they
    need instead of keeping it there. So the first forward on a cache runs, and any later one on the
    same cache (decoding, which would see only the new tokens) raises ValueError naming `what`."""
    if cache is None:
        return
    seen = cache.__dict__.setdefault("_burst_whole_sequence_layers", set())
    if layer_idx in seen:
        raise ValueError(f"{what} is not supported; generate with another attention implementation")
    seen.add(layer_idx)


def indexer_keys(cache, group, layout: str, what: str, layer_idx: int, trim: bool = False) -> tuple[object, bool]:
    """(the stand-in cache an indexer reads its keys through, whether this forward is a decode step on burst's
    ShardedCache): there _KeptKeys (the new token's key joins the prompt's, kept whole); else _GatheredKeys,
    which keeps the prompt's keys for decoding when the cache is a ShardedCache, and on any other cache
    refuses decoding (refuse_decoding, naming `what`). Both indexers (this one and block_indexer.py) take it.
    trim: a ShardedCache's prompt hands the indexer the prompt's keys only, not the padding (_GatheredKeys)."""
    sharded = getattr(cache, "indexer_keys", None) is not None  # a ShardedCache (generate.py)
    if sharded and cache.phase == "decode":
        return _KeptKeys(cache.indexer_keys), True
    if not sharded:
        refuse_decoding(what, cache, layer_idx)
        return _GatheredKeys(group, layout), False
    return _GatheredKeys(group, layout, cache.indexer_keys, cache.prompt_length, trim), False


def one_sequence_per_row(what: str, position_ids, group, layout, hidden_states) -> torch.Tensor:
    """This rank's rows' global positions (seq_local,); ValueError naming `what` when the position ids
    restart inside a row (packed documents), which the layers that see the whole sequence (this
    indexer, compressed.py's compressors) do not split. hidden_states: (batch, seq_local, ...)."""
    world, rank = layout_mod._world_and_rank(group)
    local = hidden_states.shape[1]
    rows = layout_mod.shard_indices(layout, rank, world, local * world, device=hidden_states.device)
    if position_ids is not None and not bool((position_ids == rows).all()):
        raise ValueError(
            f"{what} with packed documents (position_ids restarting inside a row) is not supported "
            "across ranks; one sequence per row"
        )
    return rows


def _whole_sequence_indexer(
    module,
    forward,
    group,
    layout,
    hidden_states,
    q_resid,
    position_embeddings,
    attention_mask=None,
    position_ids=None,
    cache=None,
    past_key_values=None,
):
    """The indexer's own forward over this rank's queries and every key: (batch, seq_local, topk)
    global key positions. (Its cache comes as `cache`, or `past_key_values` before transformers 5.24.)
    On burst's ShardedCache (generate.py) the prompt's keys are kept, whole, and each decode step's new
    token scores them all."""
    cache = cache if cache is not None else past_key_values
    what = f"{type(module).__name__}: decoding on a cache with DeepSeek sparse attention under burst"
    keys, decoding = indexer_keys(cache, group, layout, what, module.layer_idx, trim=True)
    if decoding:  # the new token scores every key so far
        allowed = torch.ones(*hidden_states.shape[:2], cache.seen + 1, dtype=torch.bool, device=hidden_states.device)
    else:
        rows = one_sequence_per_row(
            f"{type(module).__name__}: DeepSeek sparse attention", position_ids, group, layout, hidden_states
        )
        padded = rows.numel() * layout_mod._world_and_rank(group)[0]
        every = torch.arange(keys.count(padded), device=hidden_states.device)
        allowed = (every[None, :] <= rows[:, None]).expand(hidden_states.shape[0], -1, -1)  # (batch, seq_local, seq)
    return forward(
        module, hidden_states, q_resid, position_embeddings, allowed, position_ids, **{cache_keyword(forward): keys}
    )
