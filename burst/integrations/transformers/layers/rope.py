"""Rotary embeddings whose frequencies depend on the sequence's length, shown the whole sequence.

Two of the rope types transformers ships read the length from the positions the rotary module is
given: dynamic NTK scaling ("dynamic") recomputes its frequencies for the longest position it sees
(and goes back to the original ones below the original context), and LongRoPE ("longrope") picks
its long or its short factors by it. On one rank of a sharded sequence that is the longest position
of the rank's shard, not of the sequence: different frequencies on every rank, no error. The other
types (default, linear, yarn, llama3, proportional) are fixed when the model is built.

`see_global_length(model, group)` (its entry of backend/features.py, run by every door that prepares a model)
wraps the forward of each such rotary module: one all-reduce (max) of the longest position over
the group, transformers' own frequency update run on that length, then the rotation of this rank's
positions with the updated frequencies. A model whose config asks for a length-dependent rope type
that burst cannot find in a module of transformers' kind is refused, and on more than one rank a
model that was not prepared is refused by the backend (backend/checks.py: check_config, with
`needs_global_length`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .configs import PreparedConfigs, text_config

_prepared = PreparedConfigs()  # the configs of models whose rotary modules see the whole length


def length_dependent(rope_type: str) -> bool:
    """Whether transformers recomputes this rope type's frequencies from the positions it is given."""
    return "dynamic" in rope_type or rope_type == "longrope"


def rope_types(config) -> set[str]:
    """The rope types a config asks for: rope_parameters (or the older rope_scaling) as one dict,
    or one dict per layer type (Gemma 3's sliding and full layers)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    dicts = (
        [params] if "rope_type" in params or "type" in params else [p for p in params.values() if isinstance(p, dict)]
    )
    return {str(p.get("rope_type", p.get("type"))) for p in dicts if p.get("rope_type", p.get("type"))}


def needs_global_length(config) -> bool:
    """A config whose rotary frequencies depend on the length and whose model was not prepared."""
    if config in _prepared:
        return False
    return any(length_dependent(t) for t in rope_types(config))


def see_global_length(model: torch.nn.Module, group=None) -> int:
    """Make each length-dependent rotary module of `model` compute its frequencies for the longest
    position over `group`. Returns how many modules were wrapped. ValueError when the config asks for
    such a rope type and no module of transformers' kind (its forward decorated with
    dynamic_rope_update) is found: burst could not make it see the whole length."""
    configs = _configs(model)
    if not any(length_dependent(t) for c in configs for t in rope_types(c)):
        return 0
    wrapped = 0
    for module in model.modules():
        types = getattr(module, "rope_type", None)
        types = set(types.values()) if isinstance(types, dict) else {types} if isinstance(types, str) else set()
        chain = _frequency_update(type(module).forward)
        if chain is None or not any(length_dependent(t) for t in types):
            continue
        if getattr(module, "_burst_length_group", None) is not group or "forward" not in vars(module):
            module.forward = _GlobalLengthForward(module, group)
            module._burst_length_group = group
        wrapped += 1
    if not wrapped:
        raise ValueError(
            f"{type(model).__name__}: its config asks for the rope types {sorted(rope_types(configs[0]))}, "
            "whose frequencies depend on the sequence's length, and burst found no rotary module of "
            "transformers' kind to show the whole length to; refused (each rank would see its shard's)"
        )
    _prepared.add(*configs)
    return wrapped


def _configs(model) -> list:
    config = model.config
    text = text_config(config)
    return [config] if text is config else [config, text]


def _frequency_update(forward):
    """(transformers' dynamic_rope_update wrapper in the chain of `forward`'s decorators, the function
    it wraps), or None. The wrapper is known by the update functions it closes over."""
    f = forward
    while f is not None:
        code = getattr(f, "__code__", None)
        if code is not None and "dynamic_frequency_update" in code.co_freevars and hasattr(f, "__wrapped__"):
            return f, f.__wrapped__
        f = getattr(f, "__wrapped__", None)
    return None


_longest_position: list[int | None] = [None]  # set while a generation's prefill runs a padded prompt


def set_longest_position(position: int | None) -> None:
    """The sequence's longest real position for the forwards that follow, or None to find it from the
    positions. A ShardedCache pads its prompt to the layout's multiple; the padding's positions must not
    count (transformers' own generate runs the prompt unpadded)."""
    _longest_position[0] = position


class _GlobalLengthForward:
    """module's forward: the frequency update on the group's longest position, then the rotation of
    this rank's positions. x: the hidden states (for device and dtype); position_ids: (batch, seq_local).
    A class, not a closure, so that a model that ran on burst still pickles (torch.save of a whole model)."""

    def __init__(self, module, group):
        self.module, self.group = module, group

    def __call__(self, x, position_ids, *args, **kwargs):
        update, rotate = _frequency_update(type(self.module).forward)
        if _longest_position[0] is not None:  # the same on every rank
            longest = torch.full((1, 1), _longest_position[0], dtype=torch.long)
        else:
            longest = position_ids.detach().max().reshape(1, 1).to(torch.long)
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
        # its cos/sin of one position: unused
        update(self.module, x, longest.to(position_ids.device), *args, **kwargs)
        return rotate(self.module, x, position_ids, *args, **kwargs)
