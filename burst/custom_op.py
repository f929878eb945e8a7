"""burst.attention as a torch custom op, so that torch.compile traces it without a graph break.

Under torch.compile, `burst.attention` with plain arguments (a layout name, causal, window, scale,
cu_seqlens as ints, softcap, chunk_size, strategy options of ints or words, sinks) calls
`torch.ops.burst.attention` instead of running eagerly behind a graph break. Dynamo sees an opaque op
with a fake (shape-only) implementation; at run time the op does what eager burst.attention does:
validation and the cross-rank agreement (one small collective per call), then the strategy's loops.
Its backward is a second op, `burst::attention_backward`, that runs the strategy's backward from the
saved q, k, v, out and lse (and lse's gradient when the caller asked for lse: strategies/base.py's
sharded_backward).

Why it matters: a graph break cannot sit inside an activation-checkpointed region, so without the op
dynamo ran a compiled, checkpointed block that calls burst eagerly in full (correct, not fused).

The process group travels by name (`group.group_name`, as torch's functional collectives pass it);
anything the schema cannot carry (a DocumentLayout, a BlockSparseMask, a Topology, cu_seqlens as a
tensor, options of other types: cqs's lost_workers tuple) keeps the eager path behind a graph break
(`takes` says which).
"""

# No `from __future__ import annotations` here: torch.library.custom_op reads the ops' annotations as
# types, and torch 2.4 does not resolve them from strings; typing's List and Tuple for the same reason.
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .call import AttentionRequest
from .keys import KeyBlocks, unit_stride_last
from .prepare import prepare_attention
from .strategies.base import refuse_double_backward, sharded_backward, sharded_forward

# torch.compiler.disable in torch's own lazy form (torch.manual_seed's, the optimizers'): the public one
# imports torch._dynamo at once, ~2 s of CPU in every process that imports burst and never compiles.
run_eagerly = getattr(torch, "_disable_dynamo", torch.compiler.disable)

_PREPARED: dict = {}  # the op's arguments and shapes -> (strategy, AttentionCall), for the backward
_PREPARED_MAX = 256


def takes(request: AttentionRequest) -> bool:
    """True when the call's keywords fit the op's schema."""
    r = request
    if not isinstance(r.layout, str) or r.block_sparse is not None or r.topology is not None:
        return False
    if r.indices is not None or r.compressed is not None:
        return False
    if r.cu_seqlens is not None and not (
        isinstance(r.cu_seqlens, (list, tuple)) and all(type(c) is int for c in r.cu_seqlens)
    ):
        return False
    # Anything but the plain types the schema carries goes eagerly, where validation names it: converted here
    # (bool("False"), float("0.5"), an empty window as None) it would run as something else.
    if type(r.causal) is not bool or type(r.return_lse) is not bool:
        return False
    if not all(
        type(x) in (int, float) for x in (r.softcap, *([r.softmax_scale] if r.softmax_scale is not None else []))
    ):
        return False
    if r.window is not None and not (isinstance(r.window, (list, tuple)) and len(r.window) == 2):
        return False
    ints = list(r.window or ()) + ([r.chunk_size] if r.chunk_size is not None else [])
    if not all(type(x) is int for x in ints):  # numpy's: validated and taken eagerly
        return False
    # not bool: validation names it eagerly; a choice of words (backward_side="keys") as name=word
    return all(type(value) is int or _is_word(value) for value in r.options.values())


def _is_word(value) -> bool:
    return type(value) is str and value.isidentifier()


class Settings(NamedTuple):
    """An AttentionRequest as the op's schema carries it: every argument after the tensors, in order."""

    group_name: str
    strategy: str
    layout: str
    causal: bool
    window: Optional[List[int]]
    softmax_scale: Optional[float]
    cu_seqlens: Optional[List[int]]
    softcap: float
    chunk_size: Optional[int]
    option_names: str
    option_values: List[int]
    return_lse: bool
    option_words: str = ""  # last, with a default: graphs compiled and cached before it existed still call the op

    @classmethod
    def of(cls, r: AttentionRequest) -> "Settings":
        return cls(
            r.group.group_name if r.group is not None else "",
            r.strategy,
            r.layout,
            bool(r.causal),
            list(r.window) if r.window is not None else None,
            float(r.softmax_scale) if r.softmax_scale is not None else None,
            list(r.cu_seqlens) if r.cu_seqlens is not None else None,
            float(r.softcap),
            r.chunk_size,
            ",".join(name for name, x in r.options.items() if type(x) is int),
            [x for x in r.options.values() if type(x) is int],
            bool(r.return_lse),
            ",".join(f"{name}={x}" for name, x in r.options.items() if type(x) is str),
        )

    def request(self) -> AttentionRequest:
        return AttentionRequest(
            group=dist.distributed_c10d._resolve_process_group(self.group_name) if self.group_name else None,
            strategy=self.strategy,
            layout=self.layout,
            causal=self.causal,
            window=tuple(self.window) if self.window is not None else None,
            softmax_scale=self.softmax_scale,
            return_lse=self.return_lse,
            cu_seqlens=self.cu_seqlens,
            softcap=self.softcap,
            chunk_size=self.chunk_size,
            options=self.options(),
        )

    def options(self) -> dict:
        ints = dict(zip(self.option_names.split(","), self.option_values)) if self.option_names else {}
        words = dict(pair.split("=") for pair in self.option_words.split(",")) if self.option_words else {}
        return {**ints, **words}

    def key(self) -> tuple:
        """The settings as a dict key (lists as tuples)."""
        return tuple(tuple(x) if isinstance(x, list) else x for x in self)


def attention(q, k, v, sinks, request: AttentionRequest):
    """burst.attention through the op (the caller checked `takes`)."""
    out, lse = torch.ops.burst.attention(q, k, v, sinks, *Settings.of(request))
    return (out, lse) if request.return_lse else out


def _prepared(q, k, v, sinks, settings: Settings, fresh: bool):
    """(strategy, AttentionCall) for the op's arguments: burst.attention's validation and agreement
    (collective), on every forward (`fresh`) as eager burst.attention does it, so that ranks whose
    calls differ raise together instead of one waiting in a ring the others never join; the
    backward reuses the forward's."""
    key = (settings.key(), tuple(q.shape), tuple(k.shape), q.dtype, q.device, sinks is not None)
    hit = None if fresh else _PREPARED.get(key)
    if hit is None:
        hit = prepare_attention(q, KeyBlocks(k, v), settings.request(), sinks)
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        _PREPARED[key] = hit
    return hit


def _kernel_ready(q, k, v) -> tuple[torch.Tensor, KeyBlocks]:
    """q and the key side with unit-stride head dims, as eager burst.attention hands them to the strategy: the
    op saves the caller's tensors, so the backward makes them ready again (a strided head dim read as is gave
    wrong gradients)."""
    return unit_stride_last(q), KeyBlocks(k, v).ready(q)


def _stat_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("burst::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: Optional[torch.Tensor],
    group_name: str,
    strategy: str,
    layout: str,
    causal: bool,
    window: Optional[List[int]],
    softmax_scale: Optional[float],
    cu_seqlens: Optional[List[int]],
    softcap: float,
    chunk_size: Optional[int],
    option_names: str,
    option_values: List[int],
    return_lse: bool,
    option_words: str = "",
) -> Tuple[torch.Tensor, torch.Tensor]:
    settings = Settings(
        group_name, strategy, layout, causal, window, softmax_scale, cu_seqlens, softcap, chunk_size,
        option_names, option_values, return_lse, option_words,
    )  # fmt: skip
    chosen, call = _prepared(q, k, v, sinks, settings, fresh=True)
    with torch.autocast(q.device.type, enabled=False):
        out, lse = sharded_forward(call, chosen, *_kernel_ready(q, k, v), sinks)
    # the strides the fake promises (a strategy may follow q's)
    return _unaliased((out.contiguous(), lse.contiguous()), (q, k, v, sinks))


@_attention_op.register_fake
def _(q, k, v, sinks, *settings):
    b, s, h, _ = q.shape
    return _contiguous_like(q), q.new_empty((b, h, s), dtype=_stat_dtype(q))


@torch.library.custom_op("burst::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: Optional[torch.Tensor],
    group_name: str,
    strategy: str,
    layout: str,
    causal: bool,
    window: Optional[List[int]],
    softmax_scale: Optional[float],
    cu_seqlens: Optional[List[int]],
    softcap: float,
    chunk_size: Optional[int],
    option_names: str,
    option_values: List[int],
    return_lse: bool,
    option_words: str = "",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dsinks (empty when there are no sinks: an op returns tensors only). dlse: lse's
    gradient, None when the caller did not ask for lse."""
    settings = Settings(
        group_name, strategy, layout, causal, window, softmax_scale, cu_seqlens, softcap, chunk_size,
        option_names, option_values, return_lse, option_words,
    )  # fmt: skip
    chosen, call = _prepared(q, k, v, sinks, settings, fresh=False)
    with torch.autocast(q.device.type, enabled=False):
        q_ready, keys = _kernel_ready(q, k, v)
        dq, (dk, dv), dsinks, _, _ = sharded_backward(call, chosen, dout, dlse, q_ready, keys, out, lse, sinks)
        if dv is None:  # v is k: dk holds both roles' sums (keys.kv_gradients); an op returns tensors
            dv = torch.zeros_like(v)
        dsinks = dsinks if sinks is not None else q.new_empty(0)
    return _unaliased(
        (dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks), (dout, dlse, q, k, v, out, lse, sinks)
    )


def _unaliased(outputs: tuple, inputs: tuple) -> tuple:
    """The op's outputs, each in storage of its own: torch.library refuses an output that shares
    storage with an input or another output, and a strategy may return views of one accumulator
    (allgather's dk and dv, when the inputs' dtype is the accumulators' and .to() copies nothing)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    owned = []
    for t in outputs:
        if t.numel() and t.untyped_storage().data_ptr() in taken:
            t = t.clone()
        if t.numel():
            taken.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return tuple(owned)


def _contiguous_like(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks, *settings):
    return (
        _contiguous_like(q),
        _contiguous_like(k),
        _contiguous_like(v),
        _contiguous_like(sinks) if sinks is not None else q.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.settings = settings


def _backward(ctx, dout, dlse):
    refuse_double_backward("burst.attention")
    q, k, v, out, lse, sinks = ctx.saved_tensors
    return_lse = Settings(*ctx.settings).return_lse  # else the caller never saw lse: its gradient is zero
    dq, dk, dv, dsinks = torch.ops.burst.attention_backward(
        dout, dlse if return_lse else None, q, k, v, out, lse, sinks, *ctx.settings
    )
    return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * len(ctx.settings)


_attention_op.register_autograd(_backward, setup_context=_setup_context)
