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
from ..sinks import fold_sinks, sink_gradient


def int_at_least(name: str, value, low: int, meaning: str = "") -> None:
    """Raise ValueError unless value is an int >= low (0 or 1; bool excluded: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        raise ValueError(f"{name} must be a {kind} int{meaning}, got {value!r}")


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

    def __call__(self, call: AttentionCall, q, k, v, sinks=None):
        """Differentiable (out, lse) for this rank's shards, with attention sinks (heads,) folded in
        when given (burst/sinks.py); lse is not differentiable."""
        return ShardedAttentionFunction.apply(q, k, v, sinks, call, self)


class ShardedAttentionFunction(torch.autograd.Function):
    """Any strategy's loops as one autograd node. Sinks are folded into the finished rows here, so
    every strategy honours them; its backward then runs on (out', lse'), which is exact for q, k, v
    (burst/sinks.py), and the sinks' gradient is one reduction over this rank's rows."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: AttentionCall, strategy: Strategy):
        out, lse = strategy.forward(call, q, k, v)
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call, ctx.strategy = call, strategy
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.strategy.backward(ctx.call, dout, q, k, v, out, lse)
        dsinks = sink_gradient(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None
