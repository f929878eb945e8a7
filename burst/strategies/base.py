"""The one autograd.Function every strategy runs through, and what a strategy declares.

A strategy is a pair of loops over this rank's shards:

    forward(call, q, k, v) -> out, lse
    backward(call, dout, q, k, v, out, lse) -> dq, dk, dv

plus what it accepts beyond the common arguments: `options`, a frozen dataclass of the extra keyword
options `burst.attention` takes for it (e.g. a Ulysses degree), which checks its own values when built
(`call.options` is one, read as fields), and `check`, which raises ValueError for a combination it
cannot run. `check(call, q, k)` may look at local facts only (it runs before any communication, on
every rank; the agreement check then makes every rank raise).

Forward saves exactly what backward needs (q, k, v, out, lse), as flash-attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..call import AttentionCall, Options


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

    def __call__(self, call: AttentionCall, q, k, v):
        """Differentiable (out, lse) for this rank's shards; lse is not differentiable."""
        return ShardedAttentionFunction.apply(q, k, v, call, self)


class ShardedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: AttentionCall, strategy: Strategy):
        out, lse = strategy.forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call, ctx.strategy = call, strategy
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.strategy.backward(ctx.call, dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None
