"""`logits_to_keep`: a causal LM's head computes the logits of the last tokens it is given only. On a shard those
are the last tokens of each rank's shard, not of the sequence: every rank but the one holding the sequence's end
got logits of other tokens, silently. Refused in the batch (shard_batch's check_head) and in the model's own call
(a forward pre-hook, installed by the features' preparation), except where burst asks for it: generate() on a
ShardedCache (which knows each rank's last token) and the fused loss (which reads one row it checks).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .registry import inside_generate, split_across_ranks

_HOOKED = "_burst_refuses_kept_logits"
_burst_keeps = 0  # > 0 while a call of burst's own asks for logits_to_keep (owned_by_burst)


def keeps_some_logits(value) -> bool:
    """Whether logits_to_keep=`value` keeps fewer logits than every token's (0 and None keep them all; an int
    keeps the last ones, a tensor the positions it names)."""
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value == 0)


def kept_logits_refusal(value) -> ValueError:
    shown = f"a tensor of {value.numel()} positions" if isinstance(value, torch.Tensor) else repr(value)
    return ValueError(
        f"logits_to_keep={shown} would keep the last tokens (or the positions) of each rank's shard, not of the "
        "sequence: leave it out (the logits of the sequence's last token are those of the rank that holds it; "
        "gather them all with burst.unshard)"
    )


def refuse_kept_logits(model: torch.nn.Module) -> None:
    """A pre-hook on each module of `model` whose forward takes logits_to_keep (the LM, a multimodal wrapper's):
    ValueError when the call keeps some logits while the model runs split across ranks. Once per module."""
    for module in model.modules():
        if getattr(module, _HOOKED, False) or "logits_to_keep" not in _parameters(type(module)):
            continue
        module.register_forward_pre_hook(_RefuseKeptLogits(), with_kwargs=True)
        setattr(module, _HOOKED, True)


@contextlib.contextmanager
def owned_by_burst():
    """A call of burst's own that keeps the last logits knowingly (the fused loss: one row, checked)."""
    global _burst_keeps
    _burst_keeps += 1
    try:
        yield
    finally:
        _burst_keeps -= 1


class _RefuseKeptLogits:
    """The pre-hook (a class, so that a model that ran on burst still pickles: torch.save of a whole model)."""

    def __call__(self, module, args, kwargs):
        value = kwargs.get("logits_to_keep")
        if value is None and args:
            value = _signature(type(module)).bind_partial(module, *args).arguments.get("logits_to_keep")
        if not keeps_some_logits(value) or _burst_keeps or not split_across_ranks(module) or inside_generate():
            return  # generate(): on a ShardedCache it is the cache's; without one the attention refuses, naming it
        raise kept_logits_refusal(value)


@functools.cache
def _signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _parameters(cls) -> tuple[str, ...]:
    try:
        return tuple(_signature(cls).parameters)
    except (TypeError, ValueError):
        return ()
