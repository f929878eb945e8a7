"""The one autograd.Function every strategy runs through, and what a strategy declares.

A strategy is a pair of loops over this rank's shards:

    forward(call, q, k, v) -> out, lse
    backward(call, dout, q, k, v, out, lse) -> dq, dk, dv

plus what it accepts beyond the common arguments: `options`, a frozen dataclass of the extra keyword
options `burst.attention` takes for it (e.g. a Ulysses degree), which checks its own values when built
(`call.options` is one, read as fields), and `check`, which raises ValueError for a combination it
cannot run. `check(call, q, k)` may look at local facts only (it runs before any communication, on
every rank; the agreement check then makes every rank raise).

Forward saves exactly what backward needs (q, k, v, out, lse), as flash-attention does (and the
sinks, when the call has them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..call import AttentionCall, Options
from ..compressed import compressed_backward, fold_compressed
from ..lse_channel import dlse_after, narrowed, ones_after, zeros_after
from ..sinks import fold_sinks, sink_gradient


def int_at_least(name: str, value, low: int, meaning: str = "") -> None:
    """Raise ValueError unless value is an int >= low (0 or 1; bool excluded: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        raise ValueError(f"{name} must be a {kind} int{meaning}, got {value!r}")


def travelling_kv(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The K, V blocks a strategy moves: one when the values are the keys (`v is k`: DeepSeek-V4's
    shared K = V, or any caller passing one tensor as both), sent once and read as both (held[0], held[-1])."""
    return [k] if v is k else [k, v]


class KeyBlocks:
    """What the key side of a ring moves and how a held block becomes the kernel's K, V.

    Here the K, V tensors themselves (one when v is k). burst/latent.py's LatentKeys moves MLA's
    latent instead and expands each held block with the layer's own weight. travelling: this rank's
    blocks; expand(held) -> (k, v); for_backward(held, acc_first, acc_last) -> (k, v, dk, dv, finish):
    what attend_backward adds the held block's dK, dV into and a call that completes the step (the
    accumulators may be deferred, kernels/accumulators.ArrivingAccumulators); gradients(accs) -> the
    inputs' gradients from the float32 accumulators that came home.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.travelling = travelling_kv(k, v)

    def expand(self, held):
        return held[0], held[-1]

    def for_backward(self, held, acc_first, acc_last):
        return held[0], held[-1], acc_first, acc_last, _nothing

    def gradients(self, accs):
        return kv_gradients(accs[0], accs[-1], self.k, self.v)


def _nothing() -> None:
    return None


def kv_gradients(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(dk, dv) in k's and v's dtypes; with v is k, dk is dv is one accumulator holding both sums, returned
    once (the other None: autograd adds nothing more for the same tensor)."""
    if v is k:
        return dk.to(k.dtype), None
    return dk.to(k.dtype), dv.to(v.dtype)


@dataclass(frozen=True)
class Strategy:
    name: str
    forward: Callable
    backward: Callable
    options: type[Options] = Options
    check: Callable[[AttentionCall, torch.Tensor, torch.Tensor], None] | None = None
    takes_indices: bool = False  # runs index selections (burst.attention's indices=)

    def parse_options(self, given: dict) -> Options:
        """The caller's keyword options as this strategy's Options (ValueError naming any it does not take)."""
        unknown = sorted(set(given) - set(self.options.names()))
        if unknown:
            accepted = ", ".join(self.options.names()) or "none"
            raise ValueError(f"strategy {self.name!r} takes no option {', '.join(map(repr, unknown))} "
                             f"(its options: {accepted})")
        return self.options(**given)

    def takes(self, given: dict) -> bool:
        return set(given) <= set(self.options.names())

    def __call__(self, call: AttentionCall, q, k, v, sinks=None, compressed=None):
        """Differentiable (out, lse) for this rank's shards, with compressed entries (a CompressedKV,
        burst/compressed.py) and attention sinks (heads,) folded in when given (burst/sinks.py); lse
        is differentiable too (burst/lse_channel.py)."""
        ck, cv = (compressed.k, compressed.v) if compressed is not None else (None, None)
        return ShardedAttentionFunction.apply(q, k, v, sinks, ck, cv, compressed, call, self)


class ShardedAttentionFunction(torch.autograd.Function):
    """Any strategy's loops as one autograd node (sharded_forward, sharded_backward); lse is one of its
    differentiable outputs."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ck, cv, compressed, call: AttentionCall, strategy: Strategy):
        out, lse = sharded_forward(call, strategy, q, k, v, sinks, compressed)
        ctx.save_for_backward(q, k, v, out, lse, sinks, ck, cv)
        ctx.call, ctx.strategy, ctx.compressed, ctx.values_are_keys = call, strategy, compressed, v is k
        ctx.set_materialize_grads(False)  # dlse None when lse is not read: the ordinary backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, ck, cv = ctx.saved_tensors
        v = k if ctx.values_are_keys else v
        dq, dk, dv, dsinks, dck, dcv = sharded_backward(ctx.call, ctx.strategy, dout, dlse, q, k, v, out, lse,
                                                        sinks if ctx.needs_input_grad[3] else None, ctx.compressed)
        return dq, dk, dv, dsinks, dck, dcv, None, None, None


def sharded_forward(call: AttentionCall, strategy: Strategy, q, k, v, sinks=None, compressed=None):
    """The strategy's (out, lse) with compressed entries and sinks folded into the finished rows, so that
    every strategy honours them; its backward then runs on (out', lse'), which is exact for q, k, v
    (burst/sinks.py, burst/compressed.py)."""
    out, lse = strategy.forward(call, q, k, v)
    if compressed is not None:
        out, lse = fold_compressed(call, q, compressed, out, lse)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out, lse


def sharded_backward(call: AttentionCall, strategy: Strategy, dout, dlse, q, k, v, out, lse, sinks=None,
                     compressed=None):
    """(dq, dk, dv, dsinks, dck, dcv) for sharded_forward's (out, lse): the strategy's backward on the
    folded rows, the entries' own backward on the same rows, the sinks' from one reduction over this
    rank's rows (None for what is not given; dv None when v is k). dout or dlse may be None (not read);
    a dlse runs the same backwards through one more channel (burst/lse_channel.py)."""
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    if dlse is None:
        dq, dk, dv, dck, dcv = _backward(call, strategy, compressed, dout, q, k, v, out, lse)
    else:
        dq, dk, dv, dck, dcv = _lse_backward(call, strategy, compressed, dout, dlse, q, k, v, out, lse)
    dsinks = sink_gradient(dout, out, lse, sinks, dlse) if sinks is not None else None
    return dq, dk, dv, dsinks, dck, dcv


def _backward(call, strategy: Strategy, compressed, dout, q, k, v, out, lse):
    """dq, dk, dv (dv None when v is k) and the compressed entries' dk, dv (None without them)."""
    dq, dk, dv = strategy.backward(call, dout, q, k, v, out, lse)
    if compressed is None:
        return dq, dk, dv, None, None
    dq_c, dck, dcv = compressed_backward(call, dout, q, compressed, out, lse)
    return dq_c.add_(dq).to(q.dtype), dk, dv, dck.to(compressed.k.dtype), dcv.to(compressed.v.dtype)


def _lse_backward(call, strategy: Strategy, compressed, dout, dlse, q, k, v, out, lse):
    """_backward's gradients for a loss that also reads lse: the same backward on widened tensors
    (burst/lse_channel.py), then their first channels."""
    wide_entries = None if compressed is None else replace(compressed, k=zeros_after(compressed.k),
                                                           v=ones_after(compressed.v))
    dq, dk, dv, dck, dcv = _backward(call, strategy, wide_entries, dlse_after(dout, dlse), zeros_after(q),
                                     zeros_after(k), ones_after(v), zeros_after(out), lse)
    dq, dk, dv = narrowed(dq, q), narrowed(dk, k), narrowed(dv, v)
    if v is k:  # the widened keys and values are two tensors: both gradients are k's
        dk, dv = dk + dv, None
    if compressed is not None:
        dck, dcv = narrowed(dck, compressed.k), narrowed(dcv, compressed.v)
    return dq, dk, dv, dck, dcv
