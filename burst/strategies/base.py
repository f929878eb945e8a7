"""The one autograd.Function every strategy runs through, and what a strategy declares.

A strategy is a pair of loops over this rank's shards, q and the key side `keys` (burst/keys.py: the
K, V tensors, keys.k and keys.v, or another kind such as MLA's latent, which only some strategies move):

    forward(call, q, keys) -> out, lse
    backward(call, dout, q, keys, out, lse) -> dq, then the gradients of keys.inputs (dk, dv)

plus what it accepts beyond the common arguments: `options`, a frozen dataclass of the extra keyword
options `burst.attention` takes for it (e.g. a Ulysses degree), which checks its own values when built
(`call.options` is one, read as fields), and `check`, which raises ValueError for a combination it
cannot run. `check(call, q, k)` may look at local facts only (it runs before any communication, on
every rank; the agreement check then makes every rank raise).

Forward saves exactly what backward needs (q, the key side's inputs, out, lse), as flash-attention
does (and the sinks, when the call has them).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..call import AttentionCall, AttentionRequest, Options
from ..compressed import compressed_backward, fold_compressed
from ..kernels import select_kernel
from ..keys import KeyBlocks
from ..lse_channel import CHANNELS, dlse_after, narrowed, ones_after, zeros_after
from ..sinks import fold_sinks, sink_gradient


def int_at_least(name: str, value, low: int, meaning: str = "") -> None:
    """Raise ValueError unless value is an int >= low (0 or 1; bool excluded: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        raise ValueError(f"{name} must be a {kind} int{meaning}, got {value!r}")


def did_you_mean(unknown: list[str], options) -> str:
    """A hint for misspelt keywords: burst.attention hands every keyword it does not name to the
    strategy as an option, so `casual=True` arrives here; its close matches among the strategy's
    options and burst.attention's own keywords."""
    known = [*options, *(f.name for f in fields(AttentionRequest) if f.name != "options"), "sinks", "latent"]
    matches = {name: difflib.get_close_matches(name, known, n=1, cutoff=0.7) for name in unknown}
    hints = [f"{close[0]!r} for {name!r}" for name, close in matches.items() if close]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _whose(unknown: list[str], name: str) -> str:
    """'; chunk_rows is an option of strategy 'burst'' for options another strategy takes (a hint that names
    a close keyword instead would send the caller to the wrong one)."""
    owners = {option: [s for s in _OPTION_OWNERS.get(option, ()) if s != name] for option in unknown}
    hints = [f"{option} is an option of strategy {', '.join(map(repr, who))}" for option, who in owners.items() if who]
    return "; " + "; ".join(hints) if hints else ""


_OPTION_OWNERS: dict[str, list[str]] = {}  # option name -> the strategies that take it (each Strategy adds its own)


@dataclass(frozen=True)
class Strategy:
    name: str
    forward: Callable
    backward: Callable
    options: type[Options] = Options
    check: Callable[[AttentionCall, torch.Tensor, torch.Tensor], None] | None = None
    takes_indices: bool = False  # runs index selections (burst.attention's indices=)

    def __post_init__(self):
        for option in self.options.names():
            _OPTION_OWNERS.setdefault(option, []).append(self.name)

    def parse_options(self, given: dict) -> Options:
        """The caller's keyword options as this strategy's Options (ValueError naming any it does not take)."""
        unknown = sorted(set(given) - set(self.options.names()))
        if unknown:
            accepted = ", ".join(self.options.names()) or "none"
            raise ValueError(
                f"strategy {self.name!r} takes no option {', '.join(map(repr, unknown))} (its options: {accepted})"
                + (_whose(unknown, self.name) or did_you_mean(unknown, self.options.names()))
            )
        return self.options(**given)

    def takes(self, given: dict) -> bool:
        return set(given) <= set(self.options.names())

    def __call__(self, call: AttentionCall, q, keys: KeyBlocks, sinks=None, compressed=None):
        """Differentiable (out, lse) for this rank's queries against the key side `keys` (ready: see
        burst/keys.py), with compressed entries (a CompressedKV, burst/compressed.py) and attention sinks
        (heads,) folded in when given (burst/sinks.py); lse is differentiable too (burst/lse_channel.py).
        out: (batch, seqlen_local, nheads, headdim, or keys.value_width)."""
        ck, cv = (compressed.k, compressed.v) if compressed is not None else (None, None)
        return ShardedAttentionFunction.apply(call, self, keys, compressed, q, sinks, ck, cv, *keys.inputs)


class ShardedAttentionFunction(torch.autograd.Function):
    """Any strategy's loops as one autograd node (sharded_forward, sharded_backward), whatever kind of key
    side it moves; lse is one of its differentiable outputs."""

    @staticmethod
    def forward(
        ctx, call: AttentionCall, strategy: Strategy, keys: KeyBlocks, compressed, q, sinks, ck, cv, *key_inputs
    ):
        out, lse = sharded_forward(call, strategy, q, keys, sinks, compressed)
        ctx.save_for_backward(q, out, lse, sinks, ck, cv, *key_inputs)
        ctx.call, ctx.strategy, ctx.compressed, ctx.rebuild = call, strategy, compressed, keys.rebuilder()
        ctx.set_materialize_grads(False)  # dlse None when lse is not read: the ordinary backward
        width = keys.value_width  # MLA's values are padded to the keys' width for the kernels
        return (out if width is None else out[..., :width]), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_double_backward("burst.attention")
        q, out, lse, sinks, ck, cv, *key_inputs = ctx.saved_tensors
        dq, key_grads, dsinks, dck, dcv = sharded_backward(
            ctx.call,
            ctx.strategy,
            dout,
            dlse,
            q,
            ctx.rebuild(*key_inputs),
            out,
            lse,
            sinks if ctx.needs_input_grad[5] else None,
            ctx.compressed,
        )
        return None, None, None, None, dq, dsinks, dck, dcv, *key_grads


def refuse_function_transforms(entry: str, *tensors) -> None:
    """NotImplementedError where torch.func's transforms (grad, vjp, jvp, vmap) hold any of `tensors`: the
    strategies' autograd function is not written for them (torch's own message named no burst call). Anything
    not a tensor passes: validation names it inside the agreement, on every rank."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is not None and any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors):
        raise NotImplementedError(
            f"{entry} under torch.func's transforms (grad, vjp, jvp, vmap) is not supported: take gradients with "
            "torch.autograd (loss.backward(), torch.autograd.grad) and batch with the batch dimension"
        )


def refuse_double_backward(entry: str) -> None:
    """RuntimeError when a backward runs with create_graph=True (a gradient penalty, a Hessian-vector product):
    the strategies' backwards are not themselves differentiable, so the gradients of these gradients would
    lose every other rank's part, or all of it, without an error. Raised before the backward's first message,
    on every rank that asks (under torch.compile's tracing the graph is built otherwise: not checked)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"{entry} has no double backward: its backward ran with create_graph=True (torch.autograd.grad(..., "
            "create_graph=True), a gradient penalty or a Hessian-vector product). Its gradients are exact but not "
            "differentiable themselves (across ranks they would lose the other ranks' part): run such a term "
            "without create_graph, or through torch's own attention on one process"
        )


def sharded_forward(call: AttentionCall, strategy: Strategy, q, keys: KeyBlocks, sinks=None, compressed=None):
    """The strategy's (out, lse) with compressed entries and sinks folded into the finished rows, so that
    every strategy honours them; its backward then runs on (out', lse'), which is exact for q and the
    keys (burst/sinks.py, burst/compressed.py). out is as wide as the kernels' values."""
    out, lse = strategy.forward(call, q, keys)
    if compressed is not None:
        out, lse = fold_compressed(call, q, compressed, out, lse)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out, lse


def sharded_backward(
    call: AttentionCall, strategy: Strategy, dout, dlse, q, keys: KeyBlocks, out, lse, sinks=None, compressed=None
):
    """(dq, gradients of keys.inputs, dsinks, dck, dcv) for sharded_forward's (out, lse): the strategy's
    backward on the folded rows, the entries' own backward on the same rows, the sinks' from one
    reduction over this rank's rows (None for what is not given). dout (narrower than out: MLA's
    values, zero-padded) or dlse may be None (not read); a dlse runs the same backwards through one
    more channel (burst/lse_channel.py)."""
    dout = torch.zeros_like(out) if dout is None else _as_wide_as(dout, out)
    if dlse is None:
        dq, grads, dck, dcv = _backward(call, strategy, compressed, dout, q, keys, out, lse)
    else:
        dq, grads, dck, dcv = _lse_backward(call, strategy, compressed, dout, dlse, q, keys, out, lse)
    dsinks = sink_gradient(dout, out, lse, sinks, dlse) if sinks is not None else None
    return dq, grads, dsinks, dck, dcv


def _as_wide_as(dout, out):
    """dout zero-padded to out's head dim (MLA's values run padded to the keys' width), contiguous; no
    copy when it already is (F.pad copies even when it pads nothing: a dout-sized tensor at the peak)."""
    if dout.shape[-1] != out.shape[-1]:
        dout = F.pad(dout, (0, out.shape[-1] - dout.shape[-1]))
    return dout.contiguous()


def _backward(call, strategy: Strategy, compressed, dout, q, keys, out, lse):
    """dq, the key side's gradients and the compressed entries' dk, dv (None without them)."""
    dq, *grads = strategy.backward(call, dout, q, keys, out, lse)
    if compressed is None:
        return dq, grads, None, None
    dq_c, dck, dcv = compressed_backward(call, dout, q, compressed, out, lse)
    return dq_c.add_(dq).to(q.dtype), grads, dck.to(compressed.k.dtype), dcv.to(compressed.v.dtype)


def _lse_backward(call, strategy: Strategy, compressed, dout, dlse, q, keys, out, lse):
    """_backward's gradients for a loss that also reads lse: the same backward on widened tensors
    (burst/lse_channel.py), then their first channels."""
    wide_entries = (
        None if compressed is None else replace(compressed, k=zeros_after(compressed.k), v=ones_after(compressed.v))
    )
    dq, grads, dck, dcv = _backward(
        _widened_call(call, q),
        strategy,
        wide_entries,
        dlse_after(dout, dlse),
        zeros_after(q),
        keys.with_lse_channel(),
        zeros_after(out),
        lse,
    )
    if compressed is not None:
        dck, dcv = narrowed(dck, compressed.k), narrowed(dcv, compressed.v)
    return narrowed(dq, q), keys.narrow_gradients(grads), dck, dcv


def _widened_call(call: AttentionCall, q) -> AttentionCall:
    """The call, with a kernel that runs the widened head dims where its own stops at q's (a GPU
    kernel's largest head dim)."""
    width = q.shape[-1] + CHANNELS
    spec = getattr(call.kernel, "SPEC", None)  # a kernel module outside the registry: taken as it is
    if spec is None or spec.takes_head_dims(width, width):
        return call
    softcap = getattr(call.kernel, "softcap", 0.0)  # kernels.Softcapped binds it
    return replace(call, kernel=select_kernel(q.device, q.dtype, softcap, width, width))
