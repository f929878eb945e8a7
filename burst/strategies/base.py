"""The one autograd.Function every strategy runs through, and what a strategy declares.

A strategy is a pair of loops over this rank's shards:

    forward(call, q, k, v) -> out, lse
    backward(call, dout, q, k, v, out, lse) -> dq, dk, dv

plus what it accepts beyond the common arguments: `options`, the extra keyword options
`burst.attention` takes for it (e.g. a Ulysses degree; `call.options` holds them), and `check`, which
raises ValueError for a combination it cannot run. `check(call, q, k)` may look at local facts only
(it runs before any communication, on every rank; the agreement check then makes every rank raise).

Forward saves exactly what backward needs (q, k, v, out, lse), as flash-attention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..call import AttentionCall


@dataclass(frozen=True)
class Strategy:
    name: str
    forward: Callable
    backward: Callable
    options: tuple[str, ...] = ()
    check: Callable[[AttentionCall, torch.Tensor, torch.Tensor], None] | None = None

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
