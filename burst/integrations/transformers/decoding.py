"""What generate() on a ShardedCache (generate.py) reads of a model: its decoder's arguments by name,
whether it can decode on a split cache at all, where its own generate() runs the whole sequence again
(LongRoPE's switch), and how a layer's cached entries become what it attends (MLA's expansion).
"""

from __future__ import annotations

import inspect

import torch

from .keywords import ATTENTION_LAYER_KINDS, layer_kinds
from .layers import mixers, rope
from .layers.configs import text_config


def rope_switch(model) -> int | None:
    """The length at which the model's generate() drops its cache and runs the whole sequence again, or
    None. Phi-3's LongRoPE (Phi-3, PhiMoE, Phi-4-multimodal) switches from its short factors to its long
    ones past original_max_position_embeddings; once the sequence crosses it, their
    prepare_inputs_for_generation drops the cache so that every key is recomputed with the long factors.
    A ShardedCache does the same there (ShardedCache._begin)."""
    text = text_config(model.config)
    switch = getattr(text, "original_max_position_embeddings", None)
    if switch is None or "longrope" not in rope.rope_types(text):
        return None
    try:
        source = inspect.getsource(type(model).prepare_inputs_for_generation)
    except (OSError, TypeError):
        return None
    return int(switch) if "original_max_position_embeddings" in source else None


def as_attended(module, k: torch.Tensor, v: torch.Tensor, updated: tuple, handed: tuple) -> tuple:
    """This rank's cached entries as the layer attends them: (batch, entries, kv_heads, head_dim) each.

    updated: the new token's (K, V) as the layer stored them (update); handed: as it handed them to
    attention, (batch, kv_heads, 1, dim) each. Equal: the entries are attended as stored. MLA layers
    (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, Mistral 4...) cache their latent and rotary key and expand
    them after the cache with their own `expand_kv`, as their forward does on every step: so does this,
    on this rank's entries, once the expansion of the new token's is seen to give what was handed. Any
    other change between the cache and attention (DiffLlama splits its values there) is refused: the
    same answer on every rank, each holding the same new token.
    """
    if same(updated, handed):
        return k, v
    expand = getattr(type(module), "expand_kv", None)  # the family's own (burst's training path takes it over)
    if expand is None or not same(expand(module, *updated), handed):
        raise ValueError(
            f"{type(module).__name__} changes its keys or values between the cache and attention in a way "
            "burst does not follow: decoding on a ShardedCache is refused for it"
        )
    keys, values = expand(module, k.transpose(1, 2), v.transpose(1, 2))
    return keys.transpose(1, 2), values.transpose(1, 2)


def same(a: tuple, b: tuple) -> bool:
    """Whether two tuples of tensors are equal, shapes and values."""
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def refuse_recurrent_layers(model) -> None:
    """ValueError for a model with layers that mix tokens outside attention (Mamba, RWKV, linear
    attention, hybrids): their cached decoding runs on one whole sequence's state, not on a split one."""
    text = text_config(model.config)
    model_type = getattr(text, "model_type", None)
    others = sorted(layer_kinds(text) - ATTENTION_LAYER_KINDS)
    if others or mixers.supported(model_type) or mixers.supported(getattr(model.config, "model_type", None)):
        kinds = ", ".join(others) or "recurrent layers"
        raise ValueError(
            f"ShardedCache: model_type {model_type!r} mixes tokens outside attention ({kinds}), "
            "whose cached decoding runs on one whole sequence's state: generate() on a sharded cache is refused "
            "for it (its training and forward split exactly: docs/hybrid.md)"
        )


def by_name(module, args: tuple, kwargs: dict) -> dict:
    """The decoder's arguments by name: GPT-2's LM head (and others') passes input_ids by position."""
    if not args:
        return kwargs
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs
    named = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL and named.get(parameter.name):
            return kwargs  # arguments with no name: left as they came
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            named.pop(parameter.name, None)
    return named
