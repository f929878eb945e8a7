"""What the model features of features.py do to a model before any call: how an entry finds its layers
(detect, where it is more than a layer kind) and what every door does to the model first (prepare: the
layers it takes over for a sequence sharded by `layout` over `group`; the code that does it lives in
../layers/). In FEATURES' order.
"""

from __future__ import annotations

from ..layers import block_indexer, compressed, dynamic_mask, indexer, latent, positions, rope
from . import kept_logits
from .registry import BACKENDS, running_cache


def capture_positions(model, group, layout) -> None:
    positions.capture_position_ids(model)


def refuse_kept_logits(model, group, layout) -> None:
    kept_logits.refuse_kept_logits(model)


def see_global_length(model, group, layout) -> None:
    rope.see_global_length(model, group)


def left_entries(module) -> bool:
    return getattr(module, compressed.PENDING, None) is not None


def compress_whole_sequence(model, group, layout) -> None:
    compressed.compress_whole_sequence(model, group, layout)


def show_whole_sequence(model, group, layout) -> None:
    indexer.show_whole_sequence(model, group, layout)


def show_blocks_whole_sequence(model, group, layout) -> None:
    block_indexer.show_blocks_whole_sequence(model, group, layout)


def hands_over_dynamic_mask(layer) -> bool:
    """Whether a dynamic-mask layer (Doge's) hands burst its bias per key (layers/dynamic_mask.py): its
    attention is one registered with burst."""
    return getattr(getattr(layer, "config", None), "_attn_implementation", None) in BACKENDS


def take_over_dynamic_masks(model, group, layout) -> None:
    dynamic_mask.take_over_dynamic_masks(model, hands_over_dynamic_mask, group, layout)


def hands_over_latent(layer) -> bool:
    """Whether an MLA layer hands burst its latent (layers/latent.py): its attention is burst's with
    the "burst" strategy (whose key side moves the latent), outside a generation cache's steps."""
    backend = BACKENDS.get(getattr(getattr(layer, "config", None), "_attn_implementation", None))
    return (
        backend is not None
        and backend.strategy in ("burst", "auto")
        and running_cache() is None
        and backend.options.get("backward_side", "auto") != "queries"
    )


def move_latents(model, group, layout) -> None:
    latent.move_latents(model, hands_over_latent)


def tunes_temperature(module) -> bool:
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)
