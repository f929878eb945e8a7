"""Where burst's attention function finds a shard's global positions when a layer does not pass them.

burst.attention needs each shard's global positions (to check them, and to see packed documents),
which transformers hands the attention function as position_ids. Some attention modules take them
but keep them (RecurrentGemma's), or sit under a layer or model that uses them and passes nothing
down (Llama 4's decoder layers, GPTBigCode, CTRL): capture_position_ids keeps them on the attention
module, as `_burst_position_ids`, where the attention function (backend/features.py) reads them.
"""

from __future__ import annotations

import functools
import inspect

import torch

POSITIONS = "_burst_position_ids"  # the positions a pre-hook kept on an attention module


def capture_position_ids(model: torch.nn.Module) -> None:
    """Attention modules whose attention function is not handed position_ids: a pre-hook keeps them
    on the attention module, where burst's attention function reads them (it needs the shard's global
    positions). Taken from the nearest module above it whose forward takes position_ids: the attention
    module's own (RecurrentGemma's), its decoder layer's (Llama 4's takes them and does not pass them
    on), or the model's (GPTBigCode's, Dory's and CTRL's use them for position embeddings and pass
    nothing below). Once per module."""
    for module in model.modules():
        if getattr(module, "_burst_captures_positions", False) or not _takes_positions(module):
            continue
        keepers = [module] if _is_attention(module) else list(_attention_below(module))
        if not keepers:
            continue
        module.register_forward_pre_hook(_KeepPositions(tuple(keepers)), with_kwargs=True)
        module._burst_captures_positions = True


class _KeepPositions:
    """The pre-hook: the position_ids the module's forward got, kept on `keepers` (a class, not a closure, so
    that a model that ran on burst still pickles: torch.save of a whole model)."""

    def __init__(self, keepers: tuple):
        self.keepers = keepers

    def __call__(self, module, args, kwargs):
        arguments = _signature(type(module)).bind_partial(module, *args, **kwargs).arguments
        for keeper in self.keepers:
            setattr(keeper, POSITIONS, arguments.get("position_ids"))


@functools.cache
def _signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _takes_positions(module: torch.nn.Module) -> bool:
    return "position_ids" in inspect.signature(type(module).forward).parameters


def _attention_below(module: torch.nn.Module):
    """The attention modules under `module` that no module between them takes position_ids: those it keeps them for."""
    for child in module.children():
        if _takes_positions(child):  # it keeps them itself (or is an attention module taking them)
            continue
        if _is_attention(child):
            yield child
        else:
            yield from _attention_below(child)


def _is_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")
