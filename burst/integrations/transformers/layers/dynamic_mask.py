"""Doge's dynamic mask attention hands burst a bias per key instead of a dense mask.

DogeAttention adds to every score a bias of the key alone, one per KV head: dt = exp(A *
softplus(dt_proj(v))), which its `prepare_dynamic_mask` spreads over a dense (batch, kv_heads, q, k)
mask together with the model's causal (or, with config.sliding_window, sliding-window: DogeModel
builds every layer's mask with one of the two) mask; past keep_window_size keys it also keeps only
each row's keep_window_size largest. `take_over_dynamic_masks(model, hands_over)` replaces each
layer's prepare_dynamic_mask: where `hands_over(layer)` says burst's attention runs the call, it
keeps the bias on the layer and returns it as a (batch, kv_heads, 1, k) tensor (the layer repeats
it per query head; nothing of q x k is built). Its entry of backend/features.py takes
it with `handed_over` and folds it into the keys: one more channel holding bias / scale against a
query channel of ones, so (q'.k') * scale = q.k * scale + bias, eager's score, for every strategy;
the channel travels with the keys and its gradient reaches A and dt_proj.

The top-k past keep_window_size is a selection per KV head, which burst's `indices=` (one per
query, shared by its heads) does not take: refused (`check_length`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

_BIAS = "_burst_dynamic_bias"
# attention classes whose model's mask applies config.sliding_window to every layer, not passed as sliding_window=
WINDOW_FROM_CONFIG = frozenset({"DogeAttention"})


def is_dynamic_mask_attention(module: torch.nn.Module) -> bool:
    return callable(getattr(type(module), "prepare_dynamic_mask", None)) and hasattr(module, "keep_window_size")


def take_over_dynamic_masks(model: torch.nn.Module, hands_over: Callable[[torch.nn.Module], bool]) -> int:
    """Take over the prepare_dynamic_mask of every dynamic-mask layer of `model` (the module
    docstring); returns how many. Calling it again replaces the predicate."""
    layers = [m for m in model.modules() if is_dynamic_mask_attention(m)]
    for layer in layers:
        layer.prepare_dynamic_mask = functools.partial(_bias_or_mask, layer, type(layer).prepare_dynamic_mask,
                                                       hands_over)
    return len(layers)


def _bias_or_mask(layer, prepare, hands_over, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    if not hands_over(layer):
        return prepare(layer, hidden_states, dt_states, keep_window_size, attention_mask)
    setattr(layer, _BIAS, dt_states)
    return dt_states[:, :, None, :]


def handed_over(layer) -> torch.Tensor | None:
    """The bias (batch, kv_heads, seq_local) this layer's prepare_dynamic_mask handed burst, or None
    (a layer that built its dense mask, or none at all); the mark is cleared."""
    bias = getattr(layer, _BIAS, None)
    if bias is not None:
        setattr(layer, _BIAS, None)
    return bias


def window(module, sliding_window: int | None) -> int | None:
    """The window a layer's mask applies: the one it passes, else its config's where its model applies that
    to every layer (WINDOW_FROM_CONFIG)."""
    if sliding_window is None and type(module).__name__ in WINDOW_FROM_CONFIG:
        return getattr(module.config, "sliding_window", None)
    return sliding_window


def check_length(name: str, module, model_name: str, length: int) -> None:
    """ValueError where the dynamic mask would keep only part of each row: more keys than keep_window_size."""
    keep = module.keep_window_size
    if length > keep:
        raise ValueError(f"attn_implementation={name!r}: {model_name}'s dynamic mask keeps only each row's "
                         f"keep_window_size={keep} keys of largest bias once a sequence is longer ({length} tokens "
                         "here): a selection per KV head, which burst's indices= (one per query, shared by its "
                         "heads) does not take; refused (sequences up to keep_window_size are exact)")


def fold(query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor, scaling: float):
    """(query, key) with one more channel each: ones in the queries, bias / scaling in the keys.
    query: (batch, heads, seq_local, head_dim); key: (batch, kv_heads, seq_local, head_dim);
    bias: (batch, kv_heads, seq_local)."""
    ones = query.new_ones(*query.shape[:-1], 1)
    return torch.cat([query, ones], dim=-1), torch.cat([key, (bias / scaling).to(key.dtype)[..., None]], dim=-1)
