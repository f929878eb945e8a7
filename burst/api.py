"""burst.attention: prepared once on every rank (prepare.py: validation and agreement), then the chosen
strategy runs, eagerly or, under torch.compile, as one custom op (custom_op.py)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import custom_op
from .call import AttentionRequest
from .compressed import CompressedKV
from .keys import KeyBlocks, unit_stride_last
from .latent import LatentKeys, LatentKV
from .masks import BlockIndices, BlockSparseMask
from .prepare import prepare_attention
from .strategies import STRATEGIES, check_options  # noqa: F401 - the names, here too for callers
from .strategies.base import refuse_function_transforms
from .validation import DTYPES, STRATEGY_NAMES, check_tensors, checked_call  # noqa: F401 - here too for callers

if TYPE_CHECKING:
    from .comm.topology import Topology


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
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
    softcap: float = 0.0,
    chunk_size: int | None = None,
    indices: torch.Tensor | BlockIndices | None = None,
    compressed: CompressedKV | None = None,
    latent: LatentKV | None = None,
    **options,
):
    """Exact attention over a sequence split across the ranks of `group`.

    Arguments:
        q: (batch_size, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k: (batch_size, seqlen_local, nheads_k, headdim); v: same shape as k.
            The number of heads in Q must be divisible by the number of heads in KV (GQA/MQA); only
            the KV heads travel between ranks. Pass one tensor as both k and v (v is k: DeepSeek-V4's
            shared K = V) and burst and ring move it once.
        group: the process group the sequence is split over; None = the default group (or a single
            process when torch.distributed is not initialized).
        strategy: "burst" (BurstAttention: ring forward; a backward moving the smaller side,
            Q/dQ/dO/D/lse for multi-head attention or K/V/dK/dV for grouped heads, on one node
            served in chunks by their owners so a rank holds ~1/G of one process's memory;
            options chunk_rows: rows per chunk, 0 = whole blocks on the paper's ring;
            backward_side: "auto", "queries" or "keys"),
            "ring" (RingAttention), "distflash" (DistFlashAttn's balanced causal schedule; contiguous
            layout, causal only), "allgather" (gather K/V once; holds the whole sequence's K/V),
            "ulysses" (all-to-all to head shards), "usp" (Ulysses x ring; option ulysses_degree),
            "cqs" (CQS-Attention; option lost_workers), or "auto" (the fastest strategy that takes
            the call by burst.plan's cost model, for this group, shape and device).
        layout: "contiguous" | "zigzag" | "striped": which global tokens this rank holds
            (see burst.layout; use burst.shard to cut a full tensor). Packed documents cut one by
            one (the peers' varlen / THD convention): "doc_contiguous" | "doc_zigzag" with
            cu_seqlens (global, or each rank's local offsets), or a burst.DocumentLayout. Either
            way the documents are also the mask: a token attends inside its own document only.
        causal: each query attends keys at global positions <= its own.
        window: (left, right) sliding window in tokens: query i attends keys i-left .. i+right;
            -1 = unbounded on that side (flash_attn's window_size). None = no window.
        softmax_scale: default 1 / sqrt(headdim).
        return_lse: also return the log-sum-exp of each row's scores. Differentiable (d lse_i / d s_ij =
            P_ij), with every strategy, sinks, compressed entries and latent=: a loss that merges burst's
            (out, lse) with another partial attention gets exact gradients (burst/lse_channel.py).
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
        softcap: logit softcapping (Gemma 2): every score s becomes softcap * tanh(s / softcap) before
            the softmax; 0 = none. Kernels without it (aten's CPU flash op, SDPA) give way to one that
            has it (burst/kernels/softcap.py); the ring's merge is unchanged.
        chunk_size: chunked attention (Llama 4's attention_chunk_size): a token attends only inside its
            chunk of chunk_size tokens of the global sequence (with causal=True, causally there).
            Chunks are documents of equal length: off-chunk block pairs are never computed or sent.
        indices: (batch_size, seqlen_local, topk) ints, each query's chosen keys as global positions
            (-1: none), as DeepSeek sparse attention's indexer picks them: a query attends only those
            (and only where the other masks allow); (batch_size, seqlen_local, nheads_k, topk): a choice
            per KV head (the heads of its group share it); burst.BlockIndices(blocks, block_size): either
            shape in blocks of block_size keys (fewer bytes where the model picks blocks). Applied per
            tile on top of the plan (masks/selection.py); tiles nothing selected are not computed. No
            gradient. Strategies burst, ring and allgather take it (burst's backward carries the rows'
            entries with the queries).
        compressed: a burst.CompressedKV: entries every rank holds whole, each summarising `rate` tokens
            (DeepSeek-V4's compressed attention), attended beside the sharded keys: a query sees entry w
            once its window has ended (position >= (w+1)*rate - 1) and, with the CompressedKV's
            indices, only the entries it chose; no window, chunk or document mask applies to them
            (burst/compressed.py). Differentiable; an entry's gradient is this rank's queries' share.
        latent: a burst.LatentKV in place of k and v: multi-head latent attention (DeepSeek-V2/V3, Kimi,
            GLM, Mistral Large 4...): the latent and the shared rotary key travel on burst's ring and
            each rank expands the block it holds with the layer's kv_b_proj weight (burst/latent.py).
            q: (batch, seqlen_local, nheads, nope_dim + rope_dim); the output's headdim is value_dim.
            strategy "burst" (or "auto") only; masks, sinks, softcap, indices and chunk_rows apply;
            no compressed entries with it. The weight's gradient is this rank's share.
        **options: the chosen strategy's own options (see its module); others raise ValueError.

    Every rank of the group must pass the same options and shards of one shape: one small
    collective per call checks that and raises ValueError on every rank, naming the option and each
    rank's value, when they differ (see burst.agreement for its cost and burst.set_agreement_check).

    Masks combine (all must allow a pair). A row with nothing to attend gets output 0, gradient 0
    and lse -inf. Block pairs with nothing to attend are skipped, and the ring stops early when the
    mask needs no further steps.

    Returns:
        out: (batch_size, seqlen_local, nheads, headdim) in q's dtype, and, with return_lse,
        lse: (batch_size, nheads, seqlen_local) float32 (float64 for float64 input), the sinks included;
        differentiable.

    Raises ValueError / TypeError on bad input on every rank of the group, before any communication
    of the strategy starts, so no rank is left waiting.
    """
    q, k, v = autocast_inputs(q, k, v)
    try:
        keys = key_side(k, v, latent)
    except (TypeError, ValueError) as err:  # raised on every rank by the agreement, not here alone
        keys = err
    request = AttentionRequest(
        group=group,
        strategy=strategy,
        layout=layout,
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        cu_seqlens=cu_seqlens,
        block_sparse=block_sparse,
        topology=topology,
        softcap=softcap,
        chunk_size=chunk_size,
        indices=indices,
        compressed=compressed,
        options=options,
    )
    if torch.compiler.is_compiling() and isinstance(keys, KeyBlocks) and custom_op.takes(request):
        # traced as one op (burst/custom_op.py): no graph break, so checkpointed blocks compile too
        return custom_op.attention(q, k, v, sinks, request)
    return _sharded_attention(q, keys, sinks, request)


def key_side(k, v, latent):
    """The call's key side (burst/keys.py): K and V, or MLA's latent in their place."""
    if latent is None:
        if k is None or v is None:
            raise TypeError("burst.attention needs k and v, or latent=burst.LatentKV(...) in their place")
        return KeyBlocks(k, v)
    if k is not None or v is not None:
        raise ValueError("latent= replaces k and v: pass k and v, or latent=, not both")
    if not isinstance(latent, LatentKV):
        raise TypeError(f"latent must be a burst.LatentKV, got {type(latent).__name__}")
    return LatentKeys(latent)


@custom_op.run_eagerly  # collectives and per-tile kernel calls of varying shapes: torch.compile calls it as is
def _sharded_attention(q, keys, sinks, request: AttentionRequest):
    held = [getattr(request.compressed, name, None) for name in ("k", "v", "indices")]  # a bad value: validated below
    # before the agreement: every rank runs under the same transforms
    refuse_function_transforms("burst.attention", q, *getattr(keys, "inputs", ()), sinks, request.indices, *held)
    chosen, call = prepare_attention(q, keys, request, sinks)
    with torch.autocast(q.device.type, enabled=False):  # the strategy keeps float32 statistics: not recast
        out, lse = chosen(call, unit_stride_last(q), keys.ready(q), sinks=sinks, compressed=request.compressed)
    return (out, lse) if request.return_lse else out


def autocast_inputs(q, k, v):
    """q, k, v in torch.autocast's dtype when autocast is on for their device, as SDPA takes them.

    Under bf16 autocast transformers' RoPE returns q, k in float32 beside a bf16 v; attention then
    runs (and its ring carries) bf16. float64 is left alone, as autocast leaves it. Outside
    autocast the tensors are returned unchanged; so is what is not a tensor (k, v None with latent=:
    its tensors take q's dtype; anything else check_tensors names).
    """
    if not isinstance(q, torch.Tensor) or q.device.type == "meta" or not torch.is_autocast_enabled(q.device.type):
        return q, k, v  # meta: no autocast there; check_tensors says why it is refused
    dtype = torch.get_autocast_dtype(q.device.type)

    def cast(t):
        floating = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if floating else t

    k_cast = cast(k)
    return cast(q), k_cast, k_cast if v is k else cast(v)  # values that are the keys stay one tensor


def check_fixed_options(entry: str, strategy: str, options: dict, per_call: tuple[str, ...], why: str) -> None:
    """ValueError naming `entry`, before any collective, for options given once for many burst.attention calls
    (burst.context_parallel's, the engine's parallelize): a keyword each call sets itself (`per_call`, refused
    with `why`), or one that neither burst.attention nor `strategy` takes, or a value the strategy refuses."""
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"{entry}: strategy must be one of {STRATEGY_NAMES}, got {strategy!r}")
    fixed = [name for name in per_call if name in options]
    if fixed:
        raise ValueError(f"{entry}: {', '.join(fixed)}: {why}")
    keywords = inspect.signature(attention).parameters
    check_options(entry, strategy, {k: v for k, v in options.items() if k not in keywords})
