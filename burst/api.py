"""burst.attention: validate once, on every rank, then run the chosen strategy."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .call import AttentionCall
from .comm.collectives import all_gather_flat
from .kernels import select_kernel
from .layout import LAYOUTS, local_multiple
from .masks import BlockSparseMask, MaskSpec
from .strategies import STRATEGIES

PLANNED_STRATEGIES = ("ulysses", "usp", "cqs")
STRATEGY_NAMES = tuple(STRATEGIES) + PLANNED_STRATEGIES + ("auto",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    strategy: str = "burst",
    layout: str = "contiguous",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens=None,
    block_sparse: BlockSparseMask | None = None,
):
    """Exact attention over a sequence split across the ranks of `group`.

    Arguments:
        q: (batch_size, seqlen_local, nheads, headdim), this rank's shard of the queries.
        k: (batch_size, seqlen_local, nheads_k, headdim); v: same shape as k.
            The number of heads in Q must be divisible by the number of heads in KV (GQA/MQA); only
            the KV heads travel between ranks.
        group: the process group the sequence is split over; None = the default group (or a single
            process when torch.distributed is not initialized).
        strategy: "burst" (BurstAttention: ring forward, backward rotating Q/dQ/dO/D/lse),
            "ring" (RingAttention), "distflash" (DistFlashAttn's balanced causal schedule; contiguous
            layout, causal only), "allgather" (gather K/V once; holds the whole sequence's K/V), or
            "auto" (burst for MHA; ring when K/V have fewer heads than Q, since burst's backward
            moves Q-sized tensors). "ulysses", "usp" and "cqs" are planned.
        layout: "contiguous" | "zigzag" | "striped": which global tokens this rank holds
            (see burst.layout; use burst.shard to cut a full tensor).
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

    Masks combine (all must allow a pair). A row with nothing to attend gets output 0, gradient 0
    and lse -inf. Block pairs with nothing to attend are skipped, and the ring stops early when the
    mask needs no further steps.

    Returns:
        out: (batch_size, seqlen_local, nheads, headdim) in q's dtype, and, with return_lse,
        lse: (batch_size, nheads, seqlen_local) float32 (float64 for float64 input).

    Raises ValueError / TypeError on bad input on every rank of the group, before any communication
    of the strategy starts, so no rank is left waiting.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    problem = _local_problem(q, k, v, strategy, layout, causal, window, softmax_scale, world, cu_seqlens,
                             block_sparse)
    _agree_across_ranks(q, k, problem, group, world)
    name = _resolve_strategy(strategy, q, k)
    spec = MaskSpec(causal=causal, window=_normalized_window(window),
                    cu_seqlens=tuple(int(x) for x in cu_seqlens) if cu_seqlens is not None else None,
                    block_sparse=block_sparse)
    call = AttentionCall(
        group=group, rank=rank, world=world, layout=layout, local_len=q.shape[1], spec=spec,
        scale=float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5,
        kernel=select_kernel(q.device, q.dtype),
    )
    out, lse = STRATEGIES[name](call, q, k, v)
    return (out, lse) if return_lse else out


def _resolve_strategy(strategy: str, q, k) -> str:
    if strategy == "auto":
        return "burst" if k.shape[2] == q.shape[2] else "ring"
    return strategy


def _local_problem(q, k, v, strategy, layout, causal, window, softmax_scale, world, cu_seqlens,
                   block_sparse) -> BaseException | None:
    """The error this rank's arguments deserve, or None. Checks only local facts."""
    try:
        _check_tensors(q, k, v)
        _check_options(strategy, layout, causal, window, softmax_scale)
        _check_local_length(q.shape[1], layout)
        global_len = q.shape[1] * world
        _check_documents(cu_seqlens, global_len)
        _check_block_sparse(block_sparse, global_len)
        _check_supported(strategy, layout, causal, window, cu_seqlens, block_sparse)
    except (TypeError, ValueError, NotImplementedError) as err:
        return err
    return None


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
    if strategy in PLANNED_STRATEGIES:
        raise NotImplementedError(
            f"strategy {strategy!r} is not implemented yet; available: {tuple(STRATEGIES) + ('auto',)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
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


def _check_supported(strategy, layout, causal, window, cu_seqlens, block_sparse) -> None:
    """DistFlashAttn's schedule is for causal attention on contiguous shards only."""
    if strategy == "distflash":
        if layout != "contiguous" or not causal or window not in (None, (-1, -1)) or cu_seqlens is not None \
                or block_sparse is not None:
            raise ValueError(
                "strategy='distflash' supports layout='contiguous' with causal=True and no window, "
                "cu_seqlens or block_sparse; use 'burst' or 'ring' (any layout and mask) otherwise"
            )


def _normalized_window(window) -> tuple[int, int] | None:
    if window is None or tuple(window) == (-1, -1):
        return None
    return (int(window[0]), int(window[1]))


def _collective_device(group) -> torch.device:
    """Where the check's small tensor lives: the CPU for gloo, this rank's GPU for NCCL (even when
    this rank's own input is bad or not a tensor)."""
    if dist.get_backend(group) != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree_across_ranks(q, k, problem: BaseException | None, group, world: int) -> None:
    """Make every rank raise if any rank's input is bad or shards differ in shape or dtype.

    One small all_gather of (ok, batch, seqlen, heads, kv_heads, headdim, dtype) per call: that is the
    "cheap check" that a rank's shard matches the others' before the strategy's ring starts.
    """
    if world == 1:
        if problem is not None:
            raise problem
        return
    ok = problem is None
    meta = [int(ok)] + ([*q.shape, k.shape[2], DTYPES.index(q.dtype)] if ok else [0] * 6)
    device = _collective_device(group)
    mine = torch.tensor(meta, dtype=torch.int64, device=device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every, mine, group=group)
    every = every.view(world, -1).cpu().tolist()
    if not all(row[0] for row in every):
        messages = [None] * world
        dist.all_gather_object(messages, None if ok else f"{type(problem).__name__}: {problem}", group=group)
        if problem is not None:
            raise problem
        bad = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        raise ValueError("burst.attention: bad input on another rank; " + "; ".join(bad))
    names = ("batch", "seqlen", "heads", "head_dim", "kv_heads", "dtype")
    for col, name in enumerate(names, start=1):
        values = [row[col] for row in every]
        if len(set(values)) > 1:
            shown = [str(DTYPES[x]) for x in values] if name == "dtype" else values
            hint = " (shard with burst.shard, or pad every rank to one length)" if name == "seqlen" else ""
            raise ValueError(f"q's {name} differs across ranks: {shown} by rank; it must be equal{hint}")
