"""burst.attention: validate once, on every rank, then run the chosen strategy."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from .call import AttentionCall
from .comm.topology import Topology, default_world_size
from .agreement import agree
from .kernels import select_kernel
from .layout import DOCUMENT_LAYOUTS, DocumentLayout, check_layout, local_multiple, resolve_layout
from .masks import BlockSparseMask, MaskSpec
from .strategies import STRATEGIES

STRATEGY_NAMES = tuple(STRATEGIES) + ("auto",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "burst",
    layout="contiguous",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens=None,
    block_sparse: BlockSparseMask | None = None,
    topology: Topology | None = None,
    **options,
):
    """Exact attention over a sequence split across the ranks of `group`.

    Arguments:
        q: (batch_size, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k: (batch_size, seqlen_local, nheads_k, headdim); v: same shape as k.
            The number of heads in Q must be divisible by the number of heads in KV (GQA/MQA); only
            the KV heads travel between ranks.
        group: the process group the sequence is split over; None = the default group (or a single
            process when torch.distributed is not initialized).
        strategy: "burst" (BurstAttention: ring forward; backward moving Q/dQ/dO/D/lse, on one
            node served in chunks by their owners so a rank holds ~1/G of one process's memory;
            option chunk_rows: rows per chunk, 0 = whole blocks on the paper's ring),
            "ring" (RingAttention), "distflash" (DistFlashAttn's balanced causal schedule; contiguous
            layout, causal only), "allgather" (gather K/V once; holds the whole sequence's K/V),
            "ulysses" (all-to-all to head shards), "usp" (Ulysses x ring; option ulysses_degree),
            "cqs" (CQS-Attention; option lost_workers), or "auto" (the fastest strategy that takes
            the call by burst.plan's cost model, for this group, shape and device).
        layout: "contiguous" | "zigzag" | "striped": which global tokens this rank holds
            (see burst.layout; use burst.shard to cut a full tensor). Packed documents cut one by
            one (the peers' varlen / THD convention): "doc_contiguous" | "doc_zigzag" with
            cu_seqlens (global, or each rank's local offsets), or a burst.DocumentLayout.
        causal: each query attends keys at global positions <= its own.
        window: (left, right) sliding window in tokens: query i attends keys i-left .. i+right;
            -1 = unbounded on that side (flash_attn's window_size). None = no window.
        softmax_scale: default 1 / sqrt(headdim).
        return_lse: also return the log-sum-exp of each row's scores.
        cu_seqlens: packed documents, as flash_attn's varlen API: cumulative lengths over the
            *global* sequence, (ndocs + 1,) ints from 0 to the global length. A token attends only
            inside its own document (and causally, with causal=True).
        block_sparse: a burst.BlockSparseMask(block_size, layout) over the global sequence; block
            pairs that are False are never computed.
        topology: a burst.Topology (which ranks share a node); None = Topology(): torchrun's
            LOCAL_WORLD_SIZE, or one node. With several nodes, burst and ring run the double ring.
        **options: the chosen strategy's own options (see its module); others raise ValueError.

    Every rank of the group must pass the same options and shards of one shape: one small
    collective per call checks that and raises ValueError on every rank, naming the option and each
    rank's value, when they differ (see burst.agreement for its cost and burst.set_agreement_check).

    Masks combine (all must allow a pair). A row with nothing to attend gets output 0, gradient 0
    and lse -inf. Block pairs with nothing to attend are skipped, and the ring stops early when the
    mask needs no further steps.

    Returns:
        out: (batch_size, seqlen_local, nheads, headdim) in q's dtype, and, with return_lse,
        lse: (batch_size, nheads, seqlen_local) float32 (float64 for float64 input).

    Raises ValueError / TypeError on bad input on every rank of the group, before any communication
    of the strategy starts, so no rank is left waiting.
    """
    q, k, v = autocast_inputs(q, k, v)
    return _sharded_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse,
                              cu_seqlens, block_sparse, topology, **options)


@torch.compiler.disable  # collectives and per-tile kernel calls of varying shapes: torch.compile calls it as is
def _sharded_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse, cu_seqlens,
                       block_sparse, topology, **options):
    chosen, call = prepare_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse,
                                     cu_seqlens, block_sparse, topology, **options)
    with torch.autocast(q.device.type, enabled=False):  # the strategy keeps float32 statistics: not recast
        out, lse = chosen(call, *(_unit_stride_last(t) for t in (q, k, v)))
    return (out, lse) if return_lse else out


def autocast_inputs(q, k, v):
    """q, k, v in torch.autocast's dtype when autocast is on for their device, as SDPA takes them.

    Under bf16 autocast transformers' RoPE returns q, k in float32 beside a bf16 v; attention then
    runs (and its ring carries) bf16. float64 is left alone, as autocast leaves it. Outside
    autocast the tensors are returned unchanged.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v  # _check_tensors names the bad argument
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))


def prepare_attention(q, k, v, group=None, strategy="burst", layout="contiguous", causal=False, window=None,
                      softmax_scale=None, return_lse=False, cu_seqlens=None, block_sparse=None, topology=None,
                      **options):
    """burst.attention's validation and cross-rank agreement, without running it: the chosen
    Strategy and its AttentionCall, for callers that drive forward and backward themselves (the
    engine's rematerialization-aware checkpointing replays a stored output into strategy.backward).

    Same arguments and errors as burst.attention (which is `strategy(call, q, k, v)` on the result).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    problem, call, name = None, None, None
    try:
        name, call = _prepare_call(q, k, v, group, rank, world, strategy, layout, causal, window, softmax_scale,
                                   cu_seqlens, block_sparse, options, topology)
    except (TypeError, ValueError, NotImplementedError) as err:
        problem = err
    facts = _call_facts(q, k, name, call, return_lse) if problem is None else None
    agree("burst.attention", facts, problem, group, world, hints=_HINTS)
    return STRATEGIES[name], call


def prepare_single_device(q, k, causal: bool = True, softmax_scale=None):
    """prepare_attention's (Strategy, AttentionCall) for one process holding the whole sequence: no
    group and no collective, even inside a distributed program (the engine's single-device model)."""
    _check_tensors(q, k, k)
    name, call = _prepare_call(q, k, k, None, 0, 1, "allgather", "contiguous", causal, None, softmax_scale, None,
                               None, {})
    return STRATEGIES[name], call


_HINTS = {"seqlen": " (shard with burst.shard, or pad every rank to one length)"}


def _unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """Any strides are fine (transposed views, slices) except along head_dim: the attention kernels
    read each head's vector as one run (aten's CPU flash op silently misreads a strided last dim), so
    only a tensor whose head_dim is strided is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _prepare_call(q, k, v, group, rank, world, strategy, layout, causal, window, softmax_scale, cu_seqlens,
                  block_sparse, options, topology=None) -> tuple[str, AttentionCall]:
    """Validate this rank's arguments (local facts only) and build its AttentionCall."""
    _check_tensors(q, k, v)
    layout, cu_seqlens = _document_layout(layout, cu_seqlens, world, q.shape[1])
    _check_options(strategy, layout, causal, window, softmax_scale)
    _check_local_length(q.shape[1], layout)
    global_len = q.shape[1] * world
    if isinstance(layout, DocumentLayout):
        layout.check(world, global_len)
    _check_documents(cu_seqlens, global_len)
    _check_block_sparse(block_sparse, global_len)
    spec = MaskSpec(causal=causal, window=_normalized_window(window),
                    cu_seqlens=tuple(int(x) for x in cu_seqlens) if cu_seqlens is not None else None,
                    block_sparse=block_sparse)
    call = AttentionCall(
        group=group, rank=rank, world=world, layout=layout, local_len=q.shape[1], spec=spec,
        scale=float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5,
        kernel=select_kernel(q.device, q.dtype), topology=_resolved_topology(topology),
    )
    name = _auto_strategy(call, q, k, options) if strategy == "auto" else strategy
    chosen = STRATEGIES[name]
    call = replace(call, options=chosen.parse_options(options))
    if chosen.check is not None:
        chosen.check(call, q, k)
    return name, call


def _document_layout(layout, cu_seqlens, world: int, local_len: int):
    """(layout, global cu_seqlens): a per-document layout named with cu_seqlens (global or the peers'
    local form) becomes a DocumentLayout, whose documents are also the call's document mask."""
    if not isinstance(layout, DocumentLayout) and layout not in DOCUMENT_LAYOUTS:
        return layout, cu_seqlens
    resolved = resolve_layout(layout, cu_seqlens, world, local_len)
    if cu_seqlens is not None:
        given = resolve_layout(f"doc_{resolved.split}", cu_seqlens, world, local_len).cu_seqlens
        if given != resolved.cu_seqlens:
            raise ValueError(f"cu_seqlens {list(given)[:6]} differ from the DocumentLayout's documents "
                             f"{list(resolved.cu_seqlens)[:6]}; pass one of them")
    return resolved, list(resolved.cu_seqlens)


def _resolved_topology(topology) -> Topology:
    if topology is None:
        topology = Topology()
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a burst.Topology or None, got {type(topology).__name__}")
    world = default_world_size()
    resolved = topology.resolved(world)
    resolved.check(world)
    return resolved


def _auto_strategy(call: AttentionCall, q, k, options: dict) -> str:
    """The planner's fastest strategy (burst.plan) among those that take this call, from facts every
    rank shares (shapes, world, topology, device kind), so "auto" resolves alike everywhere."""
    from .plan import auto_choice

    takes = []
    for name, strategy in STRATEGIES.items():
        if not strategy.takes(options):
            continue
        try:
            if strategy.check is not None:
                strategy.check(replace(call, options=strategy.parse_options(options)), q, k)
        except (ValueError, NotImplementedError):
            continue
        takes.append(name)
    return auto_choice(takes, call, q, k)


def _call_facts(q, k, name: str, call: AttentionCall, return_lse: bool) -> dict:
    """What must be equal on every rank for the call to be right: shard shapes, dtype, options."""
    spec = call.spec
    facts = {
        "batch": q.shape[0], "seqlen": q.shape[1], "heads": q.shape[2], "kv_heads": k.shape[2],
        "head_dim": q.shape[3], "dtype": str(q.dtype), "strategy": name, "layout": call.layout,
        "causal": spec.causal, "window": spec.window, "softmax_scale": call.scale, "return_lse": bool(return_lse),
        "cu_seqlens": spec.cu_seqlens,
        "block_sparse": spec.block_sparse.fingerprint if spec.block_sparse is not None else None,
        "topology": (call.topology.local_world_size, call.topology.double_ring),
    }
    facts.update((f"option {key}", value) for key, value in sorted(call.options.as_dict().items()))
    return facts


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: float32, bfloat16, float16, float64")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k, v must be on one device")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k has {k.shape[0]}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"q holds {q.shape[1]} tokens but k holds {k.shape[1]}; q, k, v must be shards of one sequence"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[3]} but k has {k.shape[3]}; they must match")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} heads but k has {k.shape[2]}; q heads must be a multiple of k heads"
        )


def _check_options(strategy, layout, causal, window, softmax_scale) -> None:
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {STRATEGY_NAMES}, got {strategy!r}")
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2
                                   and all(isinstance(w, int) and w >= -1 for w in window)):
        raise ValueError(f"window must be None or (left, right) ints >= -1 (-1 = unbounded), got {window!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
                                          and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}")


def _check_local_length(local_len: int, layout: str) -> None:
    if local_len == 0:
        raise ValueError("q holds 0 tokens; every rank needs at least one")
    need = local_multiple(layout)
    if local_len % need:
        raise ValueError(
            f"layout={layout!r} needs the local sequence length to be a multiple of {need}, got {local_len}"
        )


def _check_documents(cu_seqlens, global_len: int) -> None:
    if cu_seqlens is None:
        return
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor or a sequence of ints")
        cu_seqlens = cu_seqlens.tolist()
    values = list(cu_seqlens)
    if not values or not all(isinstance(x, int) for x in values):
        raise ValueError("cu_seqlens must be a non-empty 1-D sequence of ints")
    if values[0] != 0 or values[-1] != global_len or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the global sequence length {global_len} "
            f"(ranks x local tokens), got {values[:4]}{'...' if len(values) > 4 else ''} ending {values[-1]}"
        )


def _check_block_sparse(block_sparse, global_len: int) -> None:
    if block_sparse is None:
        return
    if not isinstance(block_sparse, BlockSparseMask):
        raise TypeError(f"block_sparse must be a burst.BlockSparseMask, got {type(block_sparse).__name__}")
    nblocks = -(-global_len // block_sparse.block_size)
    if tuple(block_sparse.layout.shape) != (nblocks, nblocks):
        raise ValueError(
            f"block_sparse.layout has shape {tuple(block_sparse.layout.shape)} but a global length of "
            f"{global_len} in blocks of {block_sparse.block_size} needs ({nblocks}, {nblocks})"
        )


def _normalized_window(window) -> tuple[int, int] | None:
    if window is None or tuple(window) == (-1, -1):
        return None
    return (int(window[0]), int(window[1]))
