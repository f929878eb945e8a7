"""What burst's transformers backend accepts, in one table: deny by default.

transformers' attention modules call the attention function with keywords of their own (a window,
sinks, a softcap...) beside the inputs. A keyword that burst dropped would make the model silently
wrong, so every keyword is in ACCEPTED_KEYWORDS with what burst does with it, and any other keyword,
or a listed one with a value burst cannot honour, raises ValueError naming the keyword and the model.
Every rank runs the same model on the same kind of batch, so every rank raises alike, before the
attention's first collective.

The layer's configuration is checked too (check_model_features), for what reaches attention only
through the mask that burst does not build: a sliding window the layer does not pass as
`sliding_window`, chunked attention. The per-layer kinds a config lists (layer_kinds,
ATTENTION_LAYER_KINDS) are read here as well: the recurrent layers (layers/mixers) and the
whole-model refusals (backend/checks.py: check_config, check_backend_compatible) build on them.

The bottom of the package: it imports nothing of burst.
"""

from __future__ import annotations

import inspect
import sys

USED = "used"
OFF_ONLY = "accepted when off (None, False or 0), refused otherwise"
NO_EFFECT = "bookkeeping of the model or the loss: does not change attention"

# keyword -> (how it is treated, what burst does with it)
ACCEPTED_KEYWORDS: dict[str, tuple[str, str]] = {
    "scaling": (USED, "softmax_scale"),
    "is_causal": (USED, "causal (default: the module's is_causal, else True)"),
    "sliding_window": (USED, "window=(sliding_window - 1, 0), transformers' convention"),
    "s_aux": (USED, "sinks (attention sinks: gpt-oss and the other s_aux families)"),
    "sinks": (USED, "sinks"),
    "position_ids": (USED, "global positions; restarts at 0 mark packed documents (cu_seqlens)"),
    "indices": (USED, "DeepSeek sparse attention's selected keys (global positions): burst.attention(indices=)"),
    "block_indices": (
        USED,
        "MiniMax-M3's key blocks per KV head (global block numbers): burst.attention(indices=burst.BlockIndices(...))",
    ),
    "dropout": (OFF_ONLY, "attention dropout (set config.attention_dropout = 0)"),
    "softcap": (USED, "softcap (Gemma 2's attention logit softcapping: c * tanh(score / c))"),
    "output_attentions": (OFF_ONLY, "the attention matrix, which burst never builds"),
    "cu_seq_lens_q": (OFF_ONLY, "flash-attention varlen arguments: pack with position_ids instead"),
    "cu_seq_lens_k": (OFF_ONLY, "flash-attention varlen arguments: pack with position_ids instead"),
    "max_length_q": (OFF_ONLY, "flash-attention varlen arguments: pack with position_ids instead"),
    "max_length_k": (OFF_ONLY, "flash-attention varlen arguments: pack with position_ids instead"),
    "position_bias": (OFF_ONLY, "an additive relative-position bias (T5-style)"),
    "encoder_hidden_states": (OFF_ONLY, "cross-attention (BERT-style decoders pass None for self-attention)"),
    "cache": (NO_EFFECT, "the KV cache (generate runs on bt.ShardedCache)"),
    "past_key_values": (NO_EFFECT, "the KV cache, before transformers 5.24"),
    "past_key_value": (NO_EFFECT, "the KV cache, older spelling"),
    "use_cache": (NO_EFFECT, "whether to fill the cache"),
    "cache_position": (NO_EFFECT, "cache slots"),
    "position_embeddings": (NO_EFFECT, "RoPE's (cos, sin), already applied to q and k"),
    "output_hidden_states": (NO_EFFECT, "outputs to return"),
    "output_router_logits": (NO_EFFECT, "outputs to return (the router loss: layers/router_loss.py)"),
    "return_dict": (NO_EFFECT, "outputs to return"),
    "num_items_in_batch": (NO_EFFECT, "the loss's token count (bt.shard_batch)"),
    "shift_labels": (NO_EFFECT, "the loss's labels (bt.shard_batch)"),
    "labels": (NO_EFFECT, "the loss's labels, passed through by multimodal wrappers (Gemma 4)"),
    "logits_to_keep": (NO_EFFECT, "which logits the head computes, passed through by multimodal wrappers"),
    "tokenizer": (NO_EFFECT, "generate()'s, for stop_strings (its stopping rule has it); generate() hands it on"),
}


# Keywords of the model's loss that its forward hands every layer with the rest: where burst takes them instead
LOSS_KEYWORD_HINTS = {
    "ignore_index": ". ignore_index is the loss's: give it to bt.shard_batch(batch, ignore_index=...), which shifts "
    "the labels and counts the labelled tokens with it, and mark the labels with -100 for the model's loss",
}


def model_name(module) -> str:
    """The model a layer belongs to, for error messages: its config's architecture, else the layer's class."""
    config = getattr(module, "config", None)
    architectures = getattr(config, "architectures", None)
    if architectures:
        return f"{architectures[0]} ({type(module).__name__})"
    model_type = getattr(config, "model_type", None)
    return f"{type(module).__name__} (model_type {model_type!r})" if model_type else type(module).__name__


def check_keywords(name: str, module, kwargs: dict) -> None:
    """ValueError for a keyword burst does not know, or a known one with a value it cannot honour."""
    for key, value in kwargs.items():
        rule = ACCEPTED_KEYWORDS.get(key)
        if rule is None:
            hint = LOSS_KEYWORD_HINTS.get(key, "")
            raise ValueError(
                f"attn_implementation={name!r}: {model_name(module)} passes the attention function "
                f"{key}={_short(value)}, which burst does not implement; it refuses rather than drop it "
                f"(accepted keywords: burst.integrations.transformers.keywords.ACCEPTED_KEYWORDS){hint}"
            )
        if rule[0] == OFF_ONLY and value is not None and value is not False and not _is_zero(value):
            raise ValueError(
                f"attn_implementation={name!r}: {model_name(module)} passes {key}={_short(value)}; "
                f"burst does not support {rule[1]}"
            )


def check_model_features(name: str, module, sliding_window, decoding: bool = False) -> int | None:
    """What the layer's config asks of attention that reaches burst only through the mask transformers
    would build (burst builds none): the chunk size of a chunked-attention layer (Llama 4's
    `attention_chunk_size` on its "chunked_attention" layers), returned; ValueError for a sliding
    window not passed as `sliding_window` (but where the layer's mask applies none: WINDOW_NOT_IN_MASK,
    outside a cached decode step), or chunks burst cannot place on layers."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    layer_type = _layer_type(config, getattr(module, "layer_idx", None))
    chunk = getattr(config, "attention_chunk_size", None)
    if layer_type == "chunked_attention" or (chunk and layer_type is None):
        if layer_type is None or not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(
                f"attn_implementation={name!r}: {model_name(module)} has attention_chunk_size={chunk!r} "
                f"on layer type {layer_type!r}: burst runs chunked attention on the layers "
                "config.layer_types names 'chunked_attention', with a positive chunk size"
            )
        return chunk
    window = getattr(config, "sliding_window", None)
    uses_window = layer_type == "sliding_attention" or (
        layer_type is None and window and getattr(config, "use_sliding_window", True) is not False
    )
    if uses_window and sliding_window is None and _window_not_in_mask(module):
        if decoding:
            raise ValueError(
                f"attn_implementation={name!r}: {model_name(module)} has config.sliding_window={window}, which its "
                f"mask does not apply ({WINDOW_NOT_IN_MASK[type(module).__name__]}) but transformers' cache does, "
                "when decoding: one process's generate() windows the new tokens and not the prompt. burst's "
                "sharded cache does not copy that; generate on one rank (training and forwards are exact)"
            )
        return None
    if uses_window and sliding_window is None:
        raise ValueError(
            f"attn_implementation={name!r}: {model_name(module)} has a sliding window (config.sliding_window="
            f"{window}) that its attention does not pass as sliding_window=, so burst cannot tell which "
            "layers apply it; refused rather than attend the whole sequence"
        )
    return None


# Attention classes whose config has a sliding window that neither their attention call nor the mask their model
# builds applies: eager attends the whole sequence, and so does burst (tested exact in the zoo, whose tiny config
# has a window shorter than its sequence). Each is trusted only while its modeling module names none of
# transformers' sliding-window mask builders (_window_not_in_mask): a release that starts applying it is refused.
WINDOW_NOT_IN_MASK: dict[str, str] = {
    "MoshiAttention": "MoshiModel and its depth decoder build their masks with create_causal_mask",
}
# Attention classes whose model builds every layer's mask with a sliding window when config.sliding_window is set
# (create_sliding_window_causal_mask), while the attention call does not pass it as sliding_window=: the window
# is read from the config (window_from_config; the "window from the config" entry of backend/features.py). Each
# is trusted only while its modeling module still names that builder: otherwise the unpassed window is refused.
WINDOW_FROM_CONFIG: dict[str, str] = {
    "DogeAttention": "DogeModel (and its dynamic mask) applies config.sliding_window to every layer",
    "PhimoeAttention": "PhimoeModel builds every layer's mask with create_sliding_window_causal_mask when "
    "config.sliding_window is set (Phi-3.5-MoE publishes one)",
}
_SLIDING_MASK_BUILDERS = (
    "create_sliding_window_causal_mask",
    "sliding_window_causal_mask_function",
    "sliding_window_overlay",
    "create_masks_for_generate",
)


def window_from_config(module, sliding_window: int | None) -> int | None:
    """The window a layer's mask applies: the one its attention passes, else its config's where its model
    applies that to every layer (WINDOW_FROM_CONFIG, while its modeling module builds the window's mask)."""
    if sliding_window is not None or type(module).__name__ not in WINDOW_FROM_CONFIG:
        return sliding_window
    modeling = sys.modules.get(type(module).__module__)
    if modeling is None or not hasattr(modeling, "create_sliding_window_causal_mask"):
        return None  # a release that builds its masks otherwise: an unpassed window is refused (check_model_features)
    return getattr(getattr(module, "config", None), "sliding_window", None)


def _window_not_in_mask(module) -> bool:
    """Whether `module` is a WINDOW_NOT_IN_MASK class whose modeling module still names no sliding-window mask
    builder and which carries no window of its own for an attention function to read."""
    if type(module).__name__ not in WINDOW_NOT_IN_MASK or getattr(module, "sliding_window", None) is not None:
        return False
    modeling = sys.modules.get(type(module).__module__)
    return modeling is not None and not any(hasattr(modeling, n) for n in _SLIDING_MASK_BUILDERS)


# Per-layer kinds (config.layer_types / layers_block_type) that mix tokens only through attention, or not at all
# ("indexed_attention": DeepSeek sparse attention, whose indexer backend/checks.py refuses until it is prepared)
ATTENTION_LAYER_KINDS = frozenset(
    {
        "full_attention",
        "sliding_attention",
        "chunked_attention",
        "attention",
        "indexed_attention",
        "mlp",
        "moe",
        # MiniMax-M3's block-sparse layers (layers/block_indexer.py; refused unprepared)
        "minimax_m3_sparse",
        # DeepSeek-V4's (its compressors: layers/compressed.py; refused unprepared)
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
)


def layer_kinds(config) -> set:
    """The per-layer kinds a config lists (config.layer_types / layers_block_type), as a set."""
    kinds = set()
    for attr in ("layer_types", "layers_block_type"):
        value = getattr(config, attr, None)
        if isinstance(value, (list, tuple)):
            kinds.update(v for v in value if isinstance(v, str))
    return kinds


# The keywords a decoder or a layer takes its cache by: `cache` from transformers 5.24 on, `past_key_values`
# before (still accepted, deprecated, by 5.24's forwards), `cache_params` for Mamba-like models before 5.24.
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def generate_cache_keyword(model=None) -> str:
    """The keyword the installed transformers' generate() takes its cache by: `cache` from 5.24 on
    (where `past_key_values` warns, deprecated, and goes in 6.0), `past_key_values` before, or, given a
    `model` whose forward takes `cache_params` instead (Mamba, Falcon-Mamba before 5.24), that. By release:
    generate() takes them through **kwargs, renamed by a decorator its signature does not show."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.24.0.dev0"):
        return "cache"
    if model is not None and "past_key_values" not in inspect.signature(model.forward).parameters:
        if "cache_params" in inspect.signature(model.forward).parameters:
            return "cache_params"
    return "past_key_values"


def cache_keyword(forward) -> str:
    """The name a layer's forward takes its cache by (transformers 5.24 renamed past_key_values to cache)."""
    parameters = inspect.signature(inspect.unwrap(forward)).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ValueError(
        f"{getattr(forward, '__qualname__', forward)} takes neither cache nor past_key_values: this "
        "transformers release arranges the layer differently from what burst knows"
    )


def _layer_type(config, layer_idx):
    layer_types = getattr(config, "layer_types", None)
    if layer_idx is None or not isinstance(layer_types, (list, tuple)) or layer_idx >= len(layer_types):
        return None
    return layer_types[layer_idx]


def _is_zero(value) -> bool:
    try:
        return float(value) == 0.0
    except (TypeError, ValueError, RuntimeError):
        return False


def _short(value) -> str:
    text = repr(value) if not hasattr(value, "shape") else f"<{type(value).__name__} of shape {tuple(value.shape)}>"
    return text if len(text) <= 60 else text[:57] + "..."
