"""Multi-head latent attention (MLA) layers hand burst their latent instead of expanded heads.

The MLA families (DeepSeek-V2/V3/V3.2, Kimi, GLM-4.7-Flash/GLM-5, Mistral Large 4 / Mistral 4,
HY-V4, LongCat-Flash, MiniCPM3, Youtu, AXK, Bailing, dots) expand one latent per token with
`kv_b_proj` in `expand_kv(kv_nope, k_rot)`, after the cache update and right before the attention
function. `move_latents(model, hands_over)` takes over each such layer's expand_kv: where
`hands_over(layer)` says burst's ring runs the call (the backend decides: burst.attention's
strategy "burst", no generation cache), it returns the latent (batch, 1, seq, kv_lora_rank) and the
rotary key (batch, 1, seq, rope_dim) as they are and marks the layer, so the attention function
(its entry of backend/features.py, via `handed_over`) calls burst.attention(latent=...) (burst/latent.py): the
latent travels, each rank expands the block it holds. Elsewhere the layer expands as before.

A layer whose kv_b_proj is not a plain bias-free Linear keeps its expansion (nothing to hand over).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from burst.latent import LatentKV

_MARK = "_burst_latent_handed_over"


def is_latent_attention(module: torch.nn.Module) -> bool:
    """An MLA attention layer whose expansion burst can take over."""
    proj = getattr(module, "kv_b_proj", None)
    return (
        callable(getattr(type(module), "expand_kv", None))
        and type(proj) is torch.nn.Linear
        and proj.bias is None
        and hasattr(module, "qk_nope_head_dim")
        and hasattr(module, "v_head_dim")
    )


def move_latents(model: torch.nn.Module, hands_over: Callable[[torch.nn.Module], bool]) -> int:
    """Take over the expand_kv of every MLA layer of `model` (the module docstring); returns how many.
    Calling it again replaces the predicate."""
    layers = [m for m in model.modules() if is_latent_attention(m)]
    for layer in layers:
        layer.expand_kv = functools.partial(_expand_or_hand_over, layer, type(layer).expand_kv, hands_over)
    return len(layers)


def _expand_or_hand_over(layer, expand, hands_over, kv_nope: torch.Tensor, k_rot: torch.Tensor):
    if not hands_over(layer):
        return expand(layer, kv_nope, k_rot)
    setattr(layer, _MARK, True)
    return kv_nope, k_rot


def handed_over(layer, key: torch.Tensor, value: torch.Tensor) -> LatentKV | None:
    """The burst.LatentKV this layer's expand_kv handed the attention function as (key, value) (each
    (batch, 1, seq_local, width)), or None when it expanded them; the mark is cleared."""
    if not getattr(layer, _MARK, False):
        return None
    setattr(layer, _MARK, False)
    return LatentKV(key[:, 0], value[:, 0], layer.kv_b_proj.weight, layer.qk_nope_head_dim, layer.v_head_dim)
