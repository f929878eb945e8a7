"""Which families burst splits (FAMILIES), and `shard_mixers`, which prepares a model: it wraps the
functions its modeling module mixes tokens with (each by its sharded version: _SHARDED), hooks the
mixer modules whose forward calls them, takes over the modules whose recurrence is inline in their
forward (_TAKEN_OVER), and replaces its convolution and token-shift modules. The model's other
layers that must see the whole sequence (rotary embeddings, indexers, compressors) are prepared
beside it, each by its own entry of backend/features.py.
"""

from __future__ import annotations

import functools
import sys

import torch

from burst import state_passing
from burst.layout import _world_and_rank

from ...keywords import ATTENTION_LAYER_KINDS, layer_kinds
from ..configs import PreparedConfigs, text_config
from . import convolution, linear_attention, normalised, rg_lru, ssm
from .state import Shards, calls_any, hook, wrap

# model_type -> the mixers its layers use (documentation and the README's list; the functions
# themselves are found by name in the family's modeling module).
FAMILIES: dict[str, tuple[str, ...]] = {
    "lfm2": ("short convolution",),
    "lfm2_moe": ("short convolution",),
    "lfm3": ("short convolution",),
    "qwen3_next": ("short convolution", "gated delta rule"),
    "qwen3_5": ("short convolution", "gated delta rule"),
    "qwen3_5_text": ("short convolution", "gated delta rule"),
    "qwen3_5_moe": ("short convolution", "gated delta rule"),
    "qwen3_5_moe_text": ("short convolution", "gated delta rule"),
    "olmo_hybrid": ("short convolution", "gated delta rule"),
    "lara_mini": ("short convolution", "gated delta rule"),
    "mamba": ("short convolution", "Mamba selective scan"),
    "falcon_mamba": ("short convolution", "Mamba selective scan"),
    "jamba": ("short convolution", "Mamba selective scan"),
    "zamba": ("short convolution", "Mamba selective scan"),
    "mamba2": ("short convolution", "Mamba2 chunked scan"),
    "bamba": ("short convolution", "Mamba2 chunked scan"),
    "falcon_h1": ("short convolution", "Mamba2 chunked scan"),
    "granitemoehybrid": ("short convolution", "Mamba2 chunked scan"),
    "nemotron_h": ("short convolution", "Mamba2 chunked scan"),
    "zamba2": ("short convolution", "Mamba2 chunked scan"),
    "kimi_linear": ("short convolution", "Kimi delta attention"),
    "bailing_hybrid": ("short convolution", "Kimi delta attention"),
    "rwkv": ("token shift", "RWKV-4 WKV"),
    "minimax": ("lightning attention",),
    "xlstm": ("mLSTM",),
    "recurrent_gemma": ("temporal convolution", "RG-LRU"),
    "zaya": ("CCA's query/key convolutions and value delay",),
}

# The families generate() on a ShardedCache decodes: their states in transformers' Cache (conv and recurrent
# states, MiniMax's linear cache: recurrent_states.py) or on their modules (RecurrentGemma's). Not RWKV's
# (its LM head passes no cache down) nor xLSTM's (of a form burst does not carry).
GENERATE = tuple(f for f in FAMILIES if f not in ("rwkv", "xlstm"))

# Cached decoding, which cannot run on a shard (the pre-hook refuses a cache first; these are the backstop).
UNSPLIT = (
    "causal_conv1d_update",
    "torch_recurrent_gated_delta_rule",
    "mamba_selective_state_update",
    "mamba2_selective_state_update",
    "recurrent_kimi_delta_attention",
)
# Fused CUDA kernels (convolution + scan + projections in one call); their torch stand-ins return None, which
# the mixers read as "no kernel: take the unfused path". Sharded, they return None, so the unfused path, whose
# convolution and scan burst splits, runs (on a GPU too, through its own kernels).
FUSED = ("mamba_inner_fn", "mamba2_split_conv1d_scan_combined")

_SHARDED = {  # a function of a modeling module -> its sharded version: (original, shards, *its arguments)
    "causal_conv1d_fn": convolution.causal_conv,
    "torch_chunk_gated_delta_rule": linear_attention.gated_delta_rule,
    # Kimi delta attention: the gated delta rule with a decay per key channel; the state's transition
    # still acts on its key side, so the same identity columns read it off.
    "chunk_kimi_delta_attention": linear_attention.gated_delta_rule,
    "mamba2_chunk_scan": ssm.mamba2_scan,
    "mamba_selective_scan": ssm.mamba_scan,
    "rwkv_linear_attention": normalised.rwkv_wkv,
}
# Modules whose recurrence is inline in their forward: the forward runs through these, once per chunk
# (module, the class's forward, shards, *its arguments).
_TAKEN_OVER = {
    "MiniMaxLightningAttention": linear_attention.lightning_attention,
    "xLSTMBackend": normalised.mlstm,
    "RecurrentGemmaRglru": rg_lru.rg_lru,
    "ZayaCCAProjection": convolution.cca_projection,
}

_prepared = PreparedConfigs()  # the configs of models shard_mixers prepared


def supported(model_type: str | None) -> bool:
    return model_type in FAMILIES


def generates(model_type: str | None) -> bool:
    """Whether generate() on a ShardedCache carries this family's recurrent states (GENERATE)."""
    return model_type in GENERATE


def prepared(config) -> bool:
    """Whether shard_mixers prepared a model with this config (or its text config)."""
    return config in _prepared


def shard_mixers(model: torch.nn.Module, group=None, layout="contiguous") -> int:
    """Make `model`'s recurrent and convolutional mixers pass their state across the ranks of
    `group` for a sequence sharded by `layout` ("contiguous" or "zigzag", as given to shard_batch).
    Returns how many mixer modules were hooked (0 for a model without any). ValueError for a family
    that has such mixers and is not in FAMILIES. Calling it again with other settings replaces them."""
    done = getattr(model, "_burst_mixers", None)
    if done is not None and done[0] is group and done[1] == layout:  # shard_batch(model=) calls it every step
        return done[2]
    config = model.config
    text = text_config(config)
    module = sys.modules[type(model).__module__]
    names = [n for n in (*_SHARDED, *UNSPLIT, *FUSED) if callable(getattr(module, n, None))]
    inline = [m for m in model.modules() if type(m).__name__ in _TAKEN_OVER]
    model_type, world = getattr(text, "model_type", None), _world_and_rank(group)[0]
    family = supported(model_type) or supported(getattr(config, "model_type", None))
    if not names and not inline:
        if family and any(callable(getattr(module, name, None)) for name in _TAKEN_OVER):
            _prepared.add(config, text)  # its mixer classes are there, none in this model: all its layers attend
            return 0
        if family and world > 1:  # a supported family whose mixers are not where burst looks would run unhooked
            raise ValueError(
                f"{type(model).__name__}: neither its modeling module's functions ({sorted(_SHARDED)}) "
                f"nor its modules ({sorted(_TAKEN_OVER)}) are what burst splits; this transformers "
                "release arranges the family differently from what burst knows"
            )
        return 0
    if not family:
        if world == 1:  # the whole sequence on one rank: nothing to pass (check_model decides)
            return 0
        raise ValueError(
            f"model_type {model_type!r} mixes tokens outside attention ({', '.join(names)}) and is "
            f"not among the families burst makes exact across ranks: {sorted(FAMILIES)}"
        )
    state_passing.chunks(layout, group, 2 * world)  # a layout without runs (striped) raises here
    for name in names:
        wrap(module, name, _SHARDED.get(name), name in FUSED)
    shards = Shards(group, layout, world)
    mixers = [m for m in model.modules() if calls_any(type(m), tuple(names))]
    for mixer in inline:
        _take_over(mixer, shards)
    convolution.shard_convolution_modules(model, shards)
    if not mixers and not inline and _mixes_outside_attention(text):
        raise ValueError(
            f"{type(model).__name__}: found none of the modules that call {names}; this "
            "transformers release arranges the family differently from what burst knows"
        )
    for mixer in mixers:
        for handle in getattr(mixer, "_burst_mixer_hooks", ()):
            handle.remove()
        mixer._burst_mixer_hooks = hook(mixer, shards)
    convolution.shard_token_shifts(model, shards)
    _prepared.add(config, text)
    model._burst_mixers = (group, layout, len(mixers) + len(inline))
    return len(mixers) + len(inline)


def _mixes_outside_attention(config) -> bool:
    return bool(layer_kinds(config) - ATTENTION_LAYER_KINDS)


def _take_over(module: torch.nn.Module, shards: Shards) -> None:
    """module.forward runs through its _TAKEN_OVER function (the class's own forward, per chunk)."""
    forward = type(module).forward.__get__(module)
    module.forward = functools.partial(_TAKEN_OVER[type(module).__name__], module, forward, shards)
