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

from dataclasses import dataclass
from typing import Callable

import torch

from ..call import AttentionCall, Options
from ..compressed import compressed_backward, fold_compressed
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
        is not differentiable."""
        ck, cv = (compressed.k, compressed.v) if compressed is not None else (None, None)
        return ShardedAttentionFunction.apply(q, k, v, sinks, ck, cv, compressed, call, self)


class ShardedAttentionFunction(torch.autograd.Function):
    """Any strategy's loops as one autograd node. Compressed entries and sinks are folded into the
    finished rows here, so every strategy honours them; its backward then runs on (out', lse'), which
    is exact for q, k, v (burst/sinks.py, burst/compressed.py); the entries' gradients come from their
    own backward on the same rows, and the sinks' from one reduction over this rank's rows."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ck, cv, compressed, call: AttentionCall, strategy: Strategy):
        out, lse = strategy.forward(call, q, k, v)
        if compressed is not None:
            out, lse = fold_compressed(call, q, compressed, out, lse)
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks, ck, cv)
        ctx.call, ctx.strategy, ctx.compressed = call, strategy, compressed
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, ck, cv = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.strategy.backward(ctx.call, dout, q, k, v, out, lse)
        dck = dcv = None
        if ctx.compressed is not None:
            dq_c, dck, dcv = compressed_backward(ctx.call, dout, q, ctx.compressed, out, lse)
            dq = (dq_c.add_(dq)).to(q.dtype)
            dck, dcv = dck.to(ck.dtype), dcv.to(cv.dtype)
        dsinks = sink_gradient(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, dck, dcv, None, None, None
