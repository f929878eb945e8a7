"""What the layer modules know of a model's config: its text config, and which configs they prepared.

Each module that prepares a model's layers for the whole sequence (rope.py, indexer.py, compressed.py,
mixers/families.py) keeps one PreparedConfigs; the backend's checks ask it whether a config's model
was prepared. By identity and weakly: a config is forgotten with its model, and an id reused by a
later config does not match.
"""

from __future__ import annotations

import weakref


def text_config(config):
    """A model config's decoder text config (the config itself for a text-only model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def decoder_of(model):
    """The module that runs a causal LM's layers and takes its cache: model.get_decoder(), unless that is
    the model itself or not a model (Llama 4's and Mllama's get_decoder returns the causal LM, as their
    base_model_prefix names no attribute of theirs; ModernBERT-decoder's returns its LM head), then the
    model's `model`."""
    from transformers import PreTrainedModel

    found = model.get_decoder() if hasattr(model, "get_decoder") else model
    inner = getattr(model, "model", None)
    if (found is model or not isinstance(found, PreTrainedModel)) and isinstance(inner, PreTrainedModel):
        return inner
    return found


class PreparedConfigs:
    """The configs of the models one layer module prepared."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, *configs) -> None:
        for config in configs:
            self._refs[id(config)] = weakref.ref(config)

    def __contains__(self, config) -> bool:
        ref = self._refs.get(id(config))
        return ref is not None and ref() is config
