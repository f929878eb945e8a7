"""The attention implementations registered with burst for transformers: name -> what it runs; and
the ShardedCache whose decode step is running, if any.

Shared by the training path (attention.py: register, burst_attention_forward) and generation
(../generate.py: ShardedCache), so the backend never imports generation: the cache's decoder hooks
set the running cache here (set_running_cache), and the attention function reads it
(running_cache).
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from burst.comm.membership import group_ranks, group_size


@dataclass(frozen=True)
class Backend:
    """What one registered name runs: strategy, layout, group and strategy options."""

    strategy: str
    layout: str
    group: dist.ProcessGroup | None
    options: dict = field(default_factory=dict)


BACKENDS: dict[str, Backend] = {}


def backend_of(module) -> tuple[str, Backend]:
    """(name, Backend) of the implementation `module`'s config names (a model or one of its layers)."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name not in BACKENDS:
        raise ValueError(
            f"attention implementation {name!r} was not registered with burst "
            f"(registered: {sorted(BACKENDS)}); call burst.integrations.transformers.register first"
        )
    return name, BACKENDS[name]


def split_across_ranks(module) -> bool:
    """Whether `module` (a model or one of its layers) runs on a burst backend over more than one rank (False back
    on torch's attention)."""
    try:
        return world_size(backend_of(module)[1].group) > 1
    except ValueError:
        return False


def unwrap_model(model) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel | None]:
    """(the model out of a DDP wrapper and torch.compile's, in either order: the one whose config and modeling
    module burst reads and hooks; the DDP wrapper or None)."""
    ddp = None
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ddp, model = model, model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model, ddp


def registered_group(model, group, entry: str):
    """`group`, or the group `model`'s attention was registered with when none is given (a data x sequence
    mesh's sequence group: the default group would mix the replicas); ValueError when the two hold other
    ranks. A model not on burst's attention (a recurrent family) keeps `group`."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name not in BACKENDS:
        return group
    registered = BACKENDS[name].group
    if group is None:
        return registered
    given, held = group_ranks(group), group_ranks(registered)
    if given != held:
        raise ValueError(
            f"{entry}(group=...) holds ranks {list(given)}, but the model's attention {name!r} was registered with "
            f"ranks {list(held)}: the ranks that split a sequence are the same for its batch, its attention and its "
            "gradients; leave group out, or register with the same group"
        )
    return group


def registered_layout(model, layout):
    """`layout`, or the layout `model`'s attention was registered with when none is given ("contiguous" for a
    model not on burst's attention: a recurrent family)."""
    if layout is not None:
        return layout
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return BACKENDS[name].layout if name in BACKENDS else "contiguous"


def world_size(group) -> int:
    """The size of `group`, 1 when torch.distributed is not initialised."""
    return group_size(group)


# The ShardedCache whose model forward is running (its decoder hooks set and clear it), else None. The
# attention function asks it for its `phase` ("prefill" or "decode") and, in decode, to `attend`.
_running_cache = None


def set_running_cache(cache) -> None:
    global _running_cache
    _running_cache = cache


def running_cache():
    return _running_cache


def inside_generate() -> bool:
    """Whether transformers' generate() is on the call stack. Nothing else tells the attention function:
    generate's DynamicCache is not passed to it, and its inputs look like any forward's."""
    code = _generate_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@functools.lru_cache(maxsize=None)
def _generate_code():
    from transformers import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__
