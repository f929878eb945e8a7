"""Doge's dynamic mask attention hands burst a bias per key instead of a dense mask, and past
keep_window_size keys the keys each row keeps, per KV head.

DogeAttention adds to every score a bias of the key alone, one per KV head: dt = exp(A *
softplus(dt_proj(v))), which its `prepare_dynamic_mask` spreads over a dense (batch, kv_heads, q, k)
mask together with the model's causal (or, with config.sliding_window, sliding-window: DogeModel
builds every layer's mask with one of the two) mask; past keep_window_size keys it also keeps only
each row's keep_window_size largest (among the keys the mask allows), per KV head.
`take_over_dynamic_masks(model, hands_over, group, layout)` replaces each layer's prepare_dynamic_mask:
where `hands_over(layer)` says burst's attention runs the call, it keeps the bias on the layer and
returns it as a (batch, kv_heads, 1, k) tensor (the layer repeats it per query head; nothing of q x
k is built). Its entry of backend/features.py takes it with `handed_over` and folds it into the keys:
one more channel holding bias / scale against a query channel of ones, so (q'.k') * scale = q.k *
scale + bias, eager's score, for every strategy; the channel travels with the keys and its gradient
reaches A and dt_proj.

Past keep_window_size keys (`kept_keys`): the row's choice depends on every key's bias, so the bias
(one number per key and KV head, detached: the choice has no gradient in eager either) is gathered
in global order, each of this rank's rows takes the top keep_window_size of the keys its mask allows
(causal, and the model's window where it has one) as eager's torch.topk does, and burst.attention
gets them as indices= per KV head, (batch, seq_local, kv_heads, keep_window_size) global key
positions (-1 where a row allows fewer keys). Cost: the scoring is (batch, kv_heads, seq_local, seq)
per rank, as eager's is per process over the whole sequence; the indices are keep_window_size
entries per row and KV head.

Decoding on burst's ShardedCache (`decoded_bias`): each rank reckons its cached keys' biases from their
values, as the layer's forward does for its whole cache each step, folds them into the keys the same
way, and past keep_window_size keys each KV head keeps the largest among every rank's.

Ties: keys of equal bias (a repeated token's, at the first layer) that straddle the keep_window_size-th place are
kept by torch.topk in an order it does not specify, which the row's length changes (so a prompt's rows are scored
at the prompt's length, not the layout's padding: _prompt_length) and a decode step's two-step choice across
ranks may not reproduce: then an equally-biased other key is kept, as transformers' cached decoding and its
uncached forward differ there too.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from burst import layout as layout_mod
from burst.comm.membership import group_size
from burst.inference.cache import attended

from ..backend.registry import running_cache
from ..keywords import window_from_config

_BIAS = "_burst_dynamic_bias"
_KEPT = "_burst_dynamic_kept"


def is_dynamic_mask_attention(module: torch.nn.Module) -> bool:
    return callable(getattr(type(module), "prepare_dynamic_mask", None)) and hasattr(module, "keep_window_size")


def take_over_dynamic_masks(
    model: torch.nn.Module, hands_over: Callable[[torch.nn.Module], bool], group=None, layout: str = "contiguous"
) -> int:
    """Take over the prepare_dynamic_mask of every dynamic-mask layer of `model` (the module
    docstring) for a sequence sharded by `layout` over `group`; returns how many. Calling it again
    replaces the predicate, the group and the layout."""
    layers = [m for m in model.modules() if is_dynamic_mask_attention(m)]
    for layer in layers:
        layer.prepare_dynamic_mask = functools.partial(
            _bias_or_mask, layer, type(layer).prepare_dynamic_mask, hands_over, group, layout
        )
    return len(layers)


def _bias_or_mask(
    layer, prepare, hands_over, group, layout, hidden_states, dt_states, keep_window_size=2048, attention_mask=None
):
    if not hands_over(layer):
        return prepare(layer, hidden_states, dt_states, keep_window_size, attention_mask)
    setattr(layer, _BIAS, dt_states)  # the keys kept: reckoned by the attention function, not in a decode step
    window = window_from_config(layer, None)
    setattr(layer, _KEPT, functools.partial(kept_keys, dt_states, keep_window_size, window, group, layout))
    return dt_states[:, :, None, :]


def kept_keys(bias: torch.Tensor, keep: int, window: int | None, group=None, layout: str = "contiguous"):
    """(batch, seq_local, kv_heads, keep) global key positions each of this rank's rows keeps, per KV
    head (-1: none), or None where the sequence has at most `keep` keys (every allowed key is kept).
    bias: (batch, kv_heads, seq_local), this rank's keys' biases; window: transformers' sliding window
    of the model's mask (key j allowed for row i when i - window < j <= i), None for causal. Every
    rank of `group` calls it alike (one all-gather of the bias)."""
    world, rank = layout_mod._world_and_rank(group)
    local = bias.shape[-1]
    padded = local * world
    length = _prompt_length(padded)
    if length <= keep:
        return None
    if layout not in layout_mod.LAYOUTS:
        raise ValueError(
            f"Doge's dynamic mask past keep_window_size={keep} keys runs under the layouts "
            f"{layout_mod.LAYOUTS}, not {layout!r}"
        )
    whole = bias.detach()
    if world > 1:
        whole = layout_mod.unshard(whole.contiguous(), group=group, layout=layout, dim=2)
    rows = layout_mod.shard_indices(layout, rank, world, padded, device=bias.device)
    keys = torch.arange(length, device=bias.device)
    whole = whole[..., :length]
    allowed = keys[None, :] <= rows[:, None]
    if window is not None:
        allowed &= keys[None, :] > rows[:, None] - window
    scores = whole[:, :, None, :].masked_fill(~allowed, float("-inf"))  # (batch, kv_heads, seq_local, seq)
    top = torch.topk(scores, keep, dim=-1, largest=True, sorted=False)
    chosen = top.indices.masked_fill(top.values == float("-inf"), -1)
    return chosen.transpose(1, 2).to(torch.int32).contiguous()


def _prompt_length(padded: int) -> int:
    """The keys one process scores: in a ShardedCache's prompt (generate.py) its real length, not the layout's
    padding, so that torch.topk breaks exact ties (a repeated token's equal biases) as one process's rows do; else
    the whole sequence."""
    cache = running_cache()
    return cache.prompt_length if cache is not None and cache.phase == "prefill" else padded


def handed_over(layer) -> tuple[torch.Tensor | None, Callable | None]:
    """(the bias (batch, kv_heads, seq_local) this layer's prepare_dynamic_mask handed burst, a call that
    returns the keys each row keeps (kept_keys: collective)), or (None, None) (a layer that built its dense
    mask, or none at all); the marks are cleared."""
    bias, kept = getattr(layer, _BIAS, None), getattr(layer, _KEPT, None)
    if bias is not None:
        setattr(layer, _BIAS, None)
        setattr(layer, _KEPT, None)
    return bias, kept


def fold(query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor, scaling: float):
    """(query, key) with one more channel each: ones in the queries, bias / scaling in the keys.
    query: (batch, heads, seq_local, head_dim); key: (batch, kv_heads, seq_local, head_dim);
    bias: (batch, kv_heads, seq_local)."""
    ones = query.new_ones(*query.shape[:-1], 1)
    return torch.cat([query, ones], dim=-1), torch.cat([key, (bias / scaling).to(key.dtype)[..., None]], dim=-1)


def decoded_bias(layer, values: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, keys: int, group=None):
    """A decode step's dynamic mask over this rank's cache entries (burst's ShardedCache): (bias (batch,
    entries, kv_heads), valid (batch, entries), or (batch, entries, kv_heads) past keep_window_size keys).

    values: (batch, entries, kv_heads, head_dim) as cached, whose dt_proj gives each entry's bias as the
    layer's forward gives every cached key's; valid: (batch, entries) the entries the step may attend;
    positions: (batch, entries) their global positions; keys: the sequence's keys with the new one. Past
    keep_window_size keys each KV head keeps those of largest bias among every rank's valid entries, as
    eager's torch.topk over its whole cache: each rank's best keep_window_size, gathered (one collective,
    on every rank alike), then the best of those."""
    b, n, kv_heads, d = values.shape
    bias = torch.exp(layer.A * F.softplus(layer.dt_proj(values.reshape(b, n, kv_heads * d))))  # (b, n, kv_heads)
    keep = layer.keep_window_size
    if keys <= keep:
        return bias, valid
    scores = bias.float().masked_fill(~valid[..., None], float("-inf")).transpose(1, 2)  # (b, kv_heads, n)
    top = torch.topk(scores, min(keep, n), dim=-1)
    where = positions[:, None, :].expand(-1, kv_heads, -1).gather(2, top.indices)
    candidates = torch.stack([top.values.double(), where.double()], dim=-1)  # positions exact in float64
    candidates = F.pad(candidates, (0, 0, 0, keep - top.values.shape[-1]), value=float("-inf"))
    world = group_size(group)
    if world > 1:
        gathered = [torch.empty_like(candidates) for _ in range(world)]
        torch.distributed.all_gather(gathered, candidates.contiguous(), group=group)
        candidates = torch.cat(gathered, dim=2)  # (b, kv_heads, world * keep, 2)
    best = torch.topk(candidates[..., 0], keep, dim=-1)
    chosen = candidates[..., 1].gather(2, best.indices).long().masked_fill(best.values == float("-inf"), keys)
    picked = torch.zeros(b, kv_heads, keys + 1, dtype=torch.bool, device=values.device).scatter_(2, chosen, True)
    return bias, attended(valid, positions, picked[..., :keys])  # (b, n, kv_heads)
