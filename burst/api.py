"""burst.attention: validate once, on every rank, then run the chosen strategy."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import custom_op
from .agreement import agree
from .comm.p2p import open_host_channels
from .call import AttentionCall
from .plan.auto import auto_choice
from .sinks import check_sinks
from .strategies import STRATEGIES
from .validation import DTYPES, STRATEGY_NAMES, check_tensors, checked_call  # the names, here too for callers


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
    sinks: torch.Tensor | None = None,
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
        sinks: (nheads,) attention sinks (gpt-oss's learned `s_aux`): one logit per query head that
            joins every row's softmax denominator and carries no value (burst/sinks.py). Differentiable:
            its gradient is this rank's rows' share, as for any parameter applied to this rank's
            tokens (sum it over the group; bt.reduce_gradients does). Every rank passes the same values.
        **options: the chosen strategy's own options (see its module); others raise ValueError.

    Every rank of the group must pass the same options and shards of one shape: one small
    collective per call checks that and raises ValueError on every rank, naming the option and each
    rank's value, when they differ (see burst.agreement for its cost and burst.set_agreement_check).

    Masks combine (all must allow a pair). A row with nothing to attend gets output 0, gradient 0
    and lse -inf. Block pairs with nothing to attend are skipped, and the ring stops early when the
    mask needs no further steps.

    Returns:
        out: (batch_size, seqlen_local, nheads, headdim) in q's dtype, and, with return_lse,
        lse: (batch_size, nheads, seqlen_local) float32 (float64 for float64 input), the sinks included.

    Raises ValueError / TypeError on bad input on every rank of the group, before any communication
    of the strategy starts, so no rank is left waiting.
    """
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling() and custom_op.takes(layout, cu_seqlens, block_sparse, topology, options):
        # traced as one op (burst/custom_op.py): no graph break, so checkpointed blocks compile too
        return custom_op.attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse,
                                   cu_seqlens, sinks, options)
    return _sharded_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse,
                              cu_seqlens, block_sparse, topology, sinks, **options)


@torch.compiler.disable  # collectives and per-tile kernel calls of varying shapes: torch.compile calls it as is
def _sharded_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse, cu_seqlens,
                       block_sparse, topology, sinks, **options):
    chosen, call = prepare_attention(q, k, v, group, strategy, layout, causal, window, softmax_scale, return_lse,
                                     cu_seqlens, block_sparse, topology, sinks=sinks, **options)
    with torch.autocast(q.device.type, enabled=False):  # the strategy keeps float32 statistics: not recast
        out, lse = chosen(call, *(_unit_stride_last(t) for t in (q, k, v)), sinks=sinks)
    return (out, lse) if return_lse else out


def autocast_inputs(q, k, v):
    """q, k, v in torch.autocast's dtype when autocast is on for their device, as SDPA takes them.

    Under bf16 autocast transformers' RoPE returns q, k in float32 beside a bf16 v; attention then
    runs (and its ring carries) bf16. float64 is left alone, as autocast leaves it. Outside
    autocast the tensors are returned unchanged.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v  # check_tensors names the bad argument
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))


def prepare_attention(q, k, v, group=None, strategy="burst", layout="contiguous", causal=False, window=None,
                      softmax_scale=None, return_lse=False, cu_seqlens=None, block_sparse=None, topology=None,
                      sinks=None, **options):
    """burst.attention's validation and cross-rank agreement, without running it: the chosen
    Strategy and its AttentionCall, for callers that drive forward and backward themselves (the
    engine's rematerialization-aware checkpointing replays a stored output into strategy.backward).

    Same arguments and errors as burst.attention (which is `strategy(call, q, k, v)` on the result).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    problem, call, name = None, None, None
    try:
        name, call = checked_call(q, k, v, group, rank, world, strategy, layout, causal, window, softmax_scale,
                                  cu_seqlens, block_sparse, options, topology, auto=auto_choice)
        check_sinks(sinks, q)
    except (TypeError, ValueError, NotImplementedError) as err:
        problem = err
    facts = _call_facts(q, k, name, call, return_lse, sinks) if problem is None else None
    agree("burst.attention", facts, problem, group, world, hints=_HINTS)
    if world > 1:
        open_host_channels(group)  # collective on a group's first call: every rank has agreed to run it
    return STRATEGIES[name], call


def prepare_single_device(q, k, causal: bool = True, softmax_scale=None):
    """prepare_attention's (Strategy, AttentionCall) for one process holding the whole sequence: no
    group and no collective, even inside a distributed program (the engine's single-device model)."""
    check_tensors(q, k, k)
    name, call = checked_call(q, k, k, None, 0, 1, "allgather", "contiguous", causal, None, softmax_scale, None,
                              None, {})
    return STRATEGIES[name], call


_HINTS = {"seqlen": " (shard with burst.shard, or pad every rank to one length)"}


def _unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """Any strides are fine (transposed views, slices) except along head_dim: the attention kernels
    read each head's vector as one run (aten's CPU flash op silently misreads a strided last dim), so
    only a tensor whose head_dim is strided is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _call_facts(q, k, name: str, call: AttentionCall, return_lse: bool, sinks=None) -> dict:
    """What must be equal on every rank for the call to be right: shard shapes, dtype, options."""
    spec = call.spec
    facts = {
        "batch": q.shape[0], "seqlen": q.shape[1], "heads": q.shape[2], "kv_heads": k.shape[2],
        "head_dim": q.shape[3], "dtype": str(q.dtype), "strategy": name, "layout": call.layout,
        "causal": spec.causal, "window": spec.window, "softmax_scale": call.scale, "return_lse": bool(return_lse),
        "cu_seqlens": spec.cu_seqlens,
        "block_sparse": spec.block_sparse.fingerprint if spec.block_sparse is not None else None,
        "topology": (call.topology.local_world_size, call.topology.double_ring),
        "sinks": None if sinks is None else (str(sinks.dtype), tuple(sinks.detach().float().tolist())),
    }
    facts.update((f"option {key}", value) for key, value in sorted(call.options.as_dict().items()))
    return facts


