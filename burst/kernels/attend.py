"""One block pair through the kernel: the inner step that every strategy's loop shares.

`attend_forward` computes queries of one shard against keys of another (as planned by masks.py)
and merges the result into float32 accumulators; `attend_backward` adds the block's gradients into
float32 accumulators. Strategies differ only in which blocks meet where and what travels.
"""

from __future__ import annotations

import time

import torch

from ..comm.stats import active as stats_active
from ..comm.stats import record_compute, record_pairs
from ..masks import Cover, Tile, selected
from ..merge import merge_partial
from .accumulators import out_from_delta
from .masking import dense_mask


def attend_forward(
    kernel, q, k, v, tiles: list[Tile], out_acc, lse_acc, scale: float, indices=None, index_block: int = 1
) -> None:
    """Merge attention of q rows against k/v rows, tile by tile, into (out_acc, lse_acc).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)
    out_acc: (batch, seqlen_q, nheads, headdim) float32; lse_acc: (batch, nheads, seqlen_q) float32.
    indices: (batch, seqlen_q[, nheads_k], topk) the q rows' chosen global keys, or blocks of index_block
    keys (masks/selection.py), or None.
    """
    start, computed = time.perf_counter(), []
    for t in tiles:
        qr, kr = t.q.rows, t.k.rows
        if _empty(t):
            continue
        causal, mask, pairs = _tile_mask(t, indices, q.shape[2], index_block)
        if pairs == 0:
            continue
        out, lse = kernel.forward(q[:, qr], k[:, kr], v[:, kr], scale, causal, mask)
        merge_partial(out_acc[:, qr], lse_acc[:, :, qr], out, lse)
        del out, lse  # free this tile's result before the next kernel call allocates its own
        computed.append(pairs)
    _account("forward", computed, start)


def _empty(t: Tile) -> bool:
    """A tile of no query rows or no keys (an even world's half of a one-token block, zero compressed entries):
    nothing to add, and aten's CPU flash op dies (SIGFPE) on one."""
    return t.q.length == 0 or t.k.length == 0


def _tile_mask(t: Tile, indices, heads: int, index_block: int):
    """(causal, mask, pairs) the kernel gets for tile t: the tile's own (pairs: the tile, counted only
    when CommStats asks), or with an index selection its mask intersected with the selection as a
    (batch, 1 or heads, rows, keys) bool and the selected pairs (0: nothing to compute)."""
    if indices is None:
        return t.causal, t.kernel_mask, t
    chosen = selected(indices, t.q, t.k, index_block)
    if t.cover is Cover.DIAG:
        chosen &= torch.ones(t.q.length, t.k.length, dtype=torch.bool, device=chosen.device).tril()
    elif t.cover is not Cover.FULL:
        chosen &= dense_mask(t.kernel_mask, chosen.device)
    # pairs per batch row (and KV head), rounded up: a tile one of them needs is computed (and counted)
    pairs = -(-int(chosen.sum()) // max(1, chosen.shape[:-2].numel()))
    if chosen.dim() == 3:
        return False, chosen[:, None], pairs
    return False, chosen.repeat_interleave(heads // chosen.shape[1], dim=1), pairs  # each KV head's queries


def _account(phase: str, computed: list, start: float) -> None:
    """Work and kernel time of a block pair, for CommStats (nothing to do when none is active).
    computed: per computed tile, its Tile (its own pairs) or its selected pairs."""
    if computed and stats_active():
        record_compute(phase, time.perf_counter() - start)
        record_pairs(phase, sum(c if isinstance(c, int) else c.pairs for c in computed))


def attend_backward(
    kernel,
    dout,
    q,
    k,
    v,
    out,
    lse,
    tiles: list[Tile],
    dq_acc,
    dk_acc,
    dv_acc,
    scale: float,
    delta=None,
    indices=None,
    index_block: int = 1,
) -> None:
    """Add the gradients of one block pair into float32 accumulators.

    out and lse are the query rows' *global* results (lse with +inf for empty rows, see
    kernels.lse_for_backward). Instead of out, BurstAttention's backward has delta = rowsum(dout*out),
    (batch, nheads, seqlen_q): pass out=None and delta, and the kernel's stand-in for out is rebuilt
    once per tile row (kernels.out_from_delta), never for the whole block at once.
    dq_acc is shaped like q, dk_acc/dv_acc like k/v, all float32. Any of them may instead be a
    function returning it, called after the first kernel call (see kernels/accumulators.py, ArrivingAccumulators).
    indices, index_block: as attend_forward's, for the q rows.
    """
    start, computed = time.perf_counter(), []
    rebuilt_for, out_rows = None, None
    for t in tiles:
        qr, kr = t.q.rows, t.k.rows
        if _empty(t):
            continue
        causal, mask, pairs = _tile_mask(t, indices, q.shape[2], index_block)
        if pairs == 0:
            continue
        if out is not None:
            out_rows = out[:, qr]
        elif qr != rebuilt_for:  # consecutive tiles mostly share query rows: rebuild only when they change
            out_rows = None  # free the previous rows' stand-in before building this one
            out_rows, rebuilt_for = out_from_delta(dout[:, qr], delta[:, :, qr]), qr
        dq, dk, dv = kernel.backward(
            dout[:, qr], q[:, qr], k[:, kr], v[:, kr], out_rows, lse[:, :, qr], scale, causal, mask
        )
        if any(callable(a) for a in (dq_acc, dk_acc, dv_acc)):  # deferred until a tile is computed
            dq_acc, dk_acc, dv_acc = (a() if callable(a) else a for a in (dq_acc, dk_acc, dv_acc))
        dq_acc[:, qr] += dq
        dk_acc[:, kr] += dk
        dv_acc[:, kr] += dv
        del dq, dk, dv  # free this tile's gradients before the next kernel call
        computed.append(pairs)
    _account("backward", computed, start)
