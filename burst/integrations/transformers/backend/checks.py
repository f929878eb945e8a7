"""The whole-model refusals: what a model's config or class shows that burst cannot run exactly.

The keywords of each attention call are checked in ../keywords.py; what needs the recurrent layers
(which families burst splits, which models were prepared) is checked here: check_config (the
config, once per forward and by every layer), check_backend_compatible (a model transformers itself
marks as not running on other attention backends: `_supports_attention_backend = False`, it computes
some attention in its own code or mixes sequences outside attention, as Mamba and linear-attention
layers do; refused whole, on the model, its config, or any of its layers, unless burst splits its
family), and check_model (both, once per model, where burst sees a model: shard_batch, the
gradient reductions, ShardedCache).
"""

from __future__ import annotations

import weakref

import torch

from ..keywords import ATTENTION_LAYER_KINDS, layer_kinds
from ..layers import block_indexer, compressed, indexer, mixers, rope
from ..layers.configs import text_config
from .registry import backend_of, world_size


def check_config(name: str, config, world: int) -> None:
    """The whole-model refusals that a config shows, checked once per forward (the mask interface)
    and by every layer: check_backend_compatible; DeepSeek sparse attention (a learned top-k indexer
    that reads the mask tensor burst never builds); and, on more than one rank, layers that mix
    tokens outside attention (linear attention, Mamba, convolutions), which would run on a shard
    from a zero state."""
    check_backend_compatible(name, config)
    text = text_config(config)
    if getattr(text, "index_topk", None) and not any(
        m.prepared(c) for m in (indexer, compressed) for c in (config, text)
    ):
        raise ValueError(
            f"attn_implementation={name!r}: model_type {getattr(config, 'model_type', None)!r} uses "
            f"DeepSeek sparse attention (index_topk={text.index_topk}), whose indexer (and DeepSeek-V4's "
            "compressors) must see the whole sequence: prepare the model with "
            "bt.shard_batch(..., model=model)"
        )
    if (
        world > 1
        and getattr(text, "index_topk_blocks", None)
        and "minimax_m3_sparse" in layer_kinds(text)
        and not any(block_indexer.prepared(c) for c in (config, text))
    ):
        raise ValueError(
            f"attn_implementation={name!r}: model_type {getattr(config, 'model_type', None)!r} picks key "
            "blocks with an indexer that must score every key of the sequence, not its shard's: prepare "
            "the model with bt.shard_batch(..., model=model) (or SequenceParallelTrainer / "
            "SequenceParallel)"
        )
    z_loss = getattr(config, "z_loss_coefficient", None) or getattr(text, "z_loss_coefficient", None)
    if world > 1 and z_loss:  # Bamba: coef x mean over the tokens it ran of logsumexp(logits)^2, per rank
        raise ValueError(
            f"attn_implementation={name!r}: z_loss_coefficient={z_loss} adds a z-loss averaged over the tokens the "
            "model runs, which on a shard is each rank's own (counted once per rank, and left out by the fused "
            "loss): set z_loss_coefficient=0 across ranks"
        )
    if world > 1 and rope.needs_global_length(text):
        raise ValueError(
            f"attn_implementation={name!r}: model_type {getattr(config, 'model_type', None)!r} uses the rope types "
            f"{sorted(rope.rope_types(text))}, whose frequencies depend on the longest position the rotary "
            f"embedding sees, and across {world} ranks each would see its shard's: prepare the model with "
            "bt.shard_batch(..., model=model) (or SequenceParallelTrainer / SequenceParallel), which shows it the "
            "whole sequence's length"
        )
    others = sorted(layer_kinds(text) - ATTENTION_LAYER_KINDS)
    if not others and (
        mixers.supported(getattr(text, "model_type", None)) or mixers.supported(getattr(config, "model_type", None))
    ):
        others = ["recurrent or convolutional"]  # a family burst splits whose config lists no layer kinds
    if world > 1 and others and not (mixers.prepared(config) or mixers.prepared(text)):
        model_type = getattr(config, "model_type", None)
        advice = (
            "pass model= to shard_batch (or SequenceParallelTrainer), which prepares them to pass their "
            "state across ranks (burst.integrations.transformers.shard_mixers(model, group, layout) hooks "
            "them alone)"
            if mixers.supported(model_type) or mixers.supported(getattr(text, "model_type", None))
            else "refused; on one rank the model runs exactly"
        )
        raise ValueError(
            f"attn_implementation={name!r}: model_type {model_type!r} has {others} layers, which mix tokens outside "
            f"attention; across {world} ranks they would start each shard from a zero state: {advice}"
        )


# Families transformers does not mark as taking custom attention backends whose attention modules call
# the attention interface all the same, with positions shard_batch's global position ids reach: exact
# at 1 and 2 ranks in both layouts in the zoo (burst/bench/hf_zoo.py), so not refused. Tried the same
# way and left refused: bart, mbart, plbart, pegasus, bigbird_pegasus, blenderbot, blenderbot-small
# (their causal-LM decoders differ from eager even on one rank).
CALLS_THE_INTERFACE = frozenset({"biogpt", "stablelm"})


def check_backend_compatible(name: str, model_or_config) -> None:
    """ValueError when transformers marks the model's class as not running on custom attention
    backends (`PreTrainedModel.is_backend_compatible()` False). model_or_config: a model, or a
    config (its model_type's class is looked up; an unknown model_type, e.g. remote code, passes)."""
    cls = model_or_config if isinstance(model_or_config, type) else _model_class(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    if mixers.supported(getattr(config, "model_type", None)):  # hybrids burst makes exact (mixers.FAMILIES)
        return
    if getattr(config, "model_type", None) in CALLS_THE_INTERFACE:
        return
    if cls is not None:
        check_buildable(name, cls)
    if cls is None or not hasattr(cls, "is_backend_compatible") or cls.is_backend_compatible():
        return
    raise ValueError(
        f"attn_implementation={name!r}: transformers marks {cls.__name__} as not running on custom attention "
        "backends (_supports_attention_backend = False): it computes attention in its own code or mixes tokens "
        "outside attention (recurrent or convolutional layers, absolute positions), so burst cannot make it "
        "exact across ranks and refuses it"
    )


_classes: dict = {}


def check_buildable(name: str, model_or_config) -> None:
    """ValueError when transformers cannot build the model's class on a registered backend at all: it
    looks its attention class up by implementation name (falcon, gpt_neo, git), where transformers
    raises a bare KeyError. model_or_config: a model class, a model or a config."""
    cls = model_or_config if isinstance(model_or_config, type) else _model_class(model_or_config)
    picked_by_name = _attention_classes_by_name(cls)
    if picked_by_name is not None:
        table, names = picked_by_name
        raise ValueError(
            f"attn_implementation={name!r}: {cls.__name__} picks its attention class from {table} by "
            f"name ({', '.join(names)}) and runs its own attention code, not an attention function: it "
            "cannot be built on a registered backend (transformers raises KeyError), so burst cannot "
            "split it; check before building with bt.check_backend_compatible(name, config)"
        )


def _attention_classes_by_name(cls) -> tuple[str, list[str]] | None:
    """(the table's name, its keys) when cls's modeling module picks attention classes from a dict of
    implementation names (FALCON_ATTENTION_CLASSES...), which no registered name is in; else None."""
    import sys

    module = sys.modules.get(getattr(cls, "__module__", ""), None) if cls is not None else None
    for table, classes in vars(module).items() if module is not None else ():
        if table.endswith("ATTENTION_CLASSES") and isinstance(classes, dict):
            return table, sorted(classes)
    return None


def _model_class(model_or_config):
    """The transformers model class of a model (its type) or of a config (by model_type), or None."""
    from transformers import PreTrainedModel

    if isinstance(model_or_config, PreTrainedModel):
        return type(model_or_config)
    model_type = getattr(model_or_config, "model_type", None)
    if model_type not in _classes:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

        class_name = MODEL_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        try:
            _classes[model_type] = getattr(transformers, class_name) if isinstance(class_name, str) else None
        except (AttributeError, ImportError):  # a class that needs a package this machine lacks
            _classes[model_type] = None
    return _classes[model_type]


def check_model(model: torch.nn.Module) -> None:
    """Raise ValueError for a model burst cannot run exactly: its attention implementation is not one
    registered with burst, or transformers marks its class as not running on custom attention
    backends (Mamba, RWKV and the hybrids mix tokens outside attention; some families compute
    attention in their own code). Those never call burst's attention function, so this is the check
    that sees them: shard_batch(..., model=model), reduce_gradients, fully_shard and ShardedCache run
    it (once per model)."""
    name, backend = backend_of(model)
    if name in _checked_models.get(model, ()):
        return
    check_backend_compatible(name, model)
    check_config(name, model.config, world_size(backend.group))
    _checked_models.setdefault(model, set()).add(name)


_checked_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> backend names it passed
