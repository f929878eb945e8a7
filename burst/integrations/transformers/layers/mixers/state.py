"""What every sharded mixer shares: where the shard sits (Shards), the running mixer (set by the hooks
on the model's mixer modules, read by the wrapped functions), the wrapping of a modeling module's
functions, and the scheme of the mixers whose output is not affine in their state (from_true_starts).

A wrapped function (wrap) calls the original unchanged unless a hooked mixer module is running on
more than one rank, or on a ShardedCache's padded prompt; inside one, the function's sharded version
(one per kind, in the modules beside this one) runs the original on this rank's chunks with the state
they would have had in one process (burst/state_passing.py: one all-gather of O(state) bytes per layer).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch

from burst import state_passing
from burst.layout import Segment

from ...keywords import CACHE_KEYWORDS


@dataclass(frozen=True)
class Shards:
    """Where the running mixer's shard sits: the group and layout of the model's sequence split.
    length: the sequence's real tokens when it was padded at the end to split (a ShardedCache's prompt),
    else None; a scan then leaves its state as it is across the padding and hands back the state after
    the last real token, for the cache (quiet_padding)."""

    group: object
    layout: object
    world: int
    length: int | None = None


_running: contextvars.ContextVar[Shards | None] = contextvars.ContextVar("burst_sharded_mixer", default=None)


def hook(mixer: torch.nn.Module, shards: Shards):
    """Forward hooks that mark `mixer` as running on `shards` while its forward runs. A cache is
    refused at more than one rank unless it splits the prompt itself (a ShardedCache: split_prompt):
    its prompt runs split, with the prompt's length, and each decoded token whole on every rank."""
    tokens: list = []

    def enter(module, args, kwargs):
        cache = next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        tokens.append(_running.set(running_on(shards, module, cache)))

    def leave(module, args, kwargs, output):
        if tokens:
            _running.reset(tokens.pop())

    return (
        mixer.register_forward_pre_hook(enter, with_kwargs=True),
        mixer.register_forward_hook(leave, with_kwargs=True, always_call=True),
    )


def running_on(shards: Shards, module, cache) -> Shards | None:
    """How a mixer module runs given the cache its forward got (or None): on `shards`; on them with the
    prompt's length (a ShardedCache's prompt, padded at the end, even at one rank); or None: whole on every
    rank (a token a ShardedCache decodes). ValueError for any other cache at more than one rank."""
    split = getattr(cache, "split_prompt", None)
    if split is not None:
        length = split()
        return None if length is None else dataclasses.replace(shards, length=length)
    if cache is not None and shards.world > 1:
        raise cache_refused(module, shards.world)
    return shards


def runs_whole(shards: Shards | None) -> bool:
    """Whether a mixer running on `shards` (running_on) runs as in one process: nothing to pass."""
    return shards is None or (shards.world == 1 and shards.length is None)


@functools.lru_cache(maxsize=None)
def calls_any(cls, names: tuple[str, ...]) -> bool:
    """Whether the forward of module class `cls` calls any of the functions `names` (by its source)."""
    forward = getattr(cls, "forward", None)
    if forward is None or getattr(cls, "__module__", "").startswith("torch."):
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(f"{n}(" in source for n in names)


def wrap(module, name: str, sharded, fused: bool) -> None:
    """Replace function `name` of `module` (a family's modeling module) by a dispatcher that calls the
    original unchanged unless a sharded mixer is running (hook); inside one it runs
    `sharded(original, shards, *the original's arguments)`, returns None for a fused kernel (`fused`:
    the mixer then takes its unfused path, whose parts burst splits), and raises for cached decoding
    (`sharded` None). Once per function."""
    original = getattr(module, name)
    if getattr(original, "_burst_original", None) is not None:
        return

    def dispatch(*args, **kwargs):
        shards = _running.get()
        if runs_whole(shards):
            return original(*args, **kwargs)
        if fused:
            return None
        if sharded is None:
            raise ValueError(
                f"{name} (cached decoding) runs on one shard at a time and cannot pass state across "
                f"{shards.world} ranks"
            )
        return sharded(original, shards, *args, **kwargs)

    dispatch._burst_original = original
    dispatch.__name__ = getattr(original, "__name__", name)
    dispatch.__doc__ = getattr(original, "__doc__", None)
    setattr(module, name, dispatch)


def local_chunks(shards: Shards, local_len: int):
    """This rank's chunks (state_passing.chunks) of a shard of `local_len` tokens."""
    mine, _ = state_passing.chunks(shards.layout, shards.group, local_len)
    return mine


def from_true_starts(shards: Shards, local_len: int, phase: str, final_and_transition, run_from) -> tuple:
    """The scheme of the mixers whose output is not affine in their state: each chunk runs from zero
    for `final_and_transition(seg)` -> (its final state as true sums, its transition: a factor, same
    shape), the states are passed in one all-gather, and `run_from(seg, start)` runs the chunk again
    from the state it truly starts from. Returns (run_from's results, one per local chunk, the state after
    the sequence's last chunk, the same on every rank)."""
    mine = local_chunks(shards, local_len)
    finals, transitions = zip(*(final_and_transition(seg) for seg in mine))
    starts, whole = state_passing.scan_states(
        finals, transitions, torch.mul, shards.layout, shards.group, local_len, phase=phase
    )
    return [run_from(seg, start) for seg, start in zip(mine, starts)], whole


def cache_refused(module, world: int) -> ValueError:
    return ValueError(
        f"{type(module).__name__}: a cache (generation) with the sequence split across {world} ranks "
        "is not supported for recurrent layers; a training step or a plain forward needs none: "
        "model(**batch, use_cache=False)"
    )


def refuse_state_arguments(what: str, initial, final, varlen, prompt: int | None = None) -> None:
    """ValueError for what a split scan cannot take: a starting state, a final state asked for outside a
    ShardedCache's prompt (prompt: its length, shards.length, where the scan hands the whole prompt's
    state), or packed sequences."""
    if initial is not None or (final and prompt is None):
        raise ValueError(
            f"{what} was called with a starting or final state (a cache) while its sequence is split "
            "across ranks; burst passes the state itself and supports no cache here but its own "
            "(ShardedCache, for the families that decode on it)"
        )
    if varlen is not None:
        raise ValueError(
            f"{what} was called with variable-length sequences (cu_seqlens / seq_idx) while its "
            "sequence is split across ranks; burst does not split packed sequences for recurrent layers"
        )


def undo_padding_decay(state: torch.Tensor, decay: torch.Tensor, shards: Shards, local_len: int) -> torch.Tensor:
    """`state` (float32) with the decay of a ShardedCache's prompt padding undone: each of its quiet tokens
    (the shards' world x local_len past shards.length) multiplied the state by exp(-decay) (decay >= 0,
    broadcastable to state). ValueError where that decay is past what float32 keeps of the state (e^-60),
    before any rank decodes from a state lost to it."""
    padding = shards.world * local_len - shards.length
    exponent = decay.float() * padding
    if padding and float(exponent.max()) > 60:
        raise ValueError(
            f"the {padding} padding tokens of this prompt decay a recurrent layer's state by "
            f"e^-{float(exponent.max()):.0f}, past what float32 keeps of it: give a prompt whose length is "
            "a multiple of the layout's split (ranks x 2 for zigzag, ranks for contiguous), 2 tokens a rank or more"
        )
    return state * torch.exp(exponent)


def one_rank_prompt(shards: Shards, local_len: int):
    """The segment of a ShardedCache's whole prompt at one rank (no state to pass: one scan from zero, its
    padding quiet), or None at more than one rank."""
    return Segment(0, local_len, 0) if shards.world == 1 else None


def quiet_padding(shards: Shards, seg, rows: torch.Tensor, value: float = 0.0, dim: int = 1) -> torch.Tensor:
    """`rows`, a scan input's rows of chunk `seg` along `dim`, with those past the sequence's real tokens
    (shards.length) set to `value`: the value that leaves the scan's state as it is (no decay, no input),
    so its final state is the state after the last real token. Unchanged outside a ShardedCache's prompt."""
    real = seg.length if shards.length is None else min(max(shards.length - seg.first, 0), seg.length)
    if real == seg.length:
        return rows
    quiet = torch.full_like(rows.narrow(dim, real, seg.length - real), value)
    return torch.cat([rows.narrow(dim, 0, real), quiet], dim=dim)
