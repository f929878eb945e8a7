"""BurstAttention on one node, the owner-served chunk stream: a ring's block pairs, in its order,
holding a few chunks instead of two blocks. The backward serves query chunks (q, dO, D, lse) and sends
their dQ home (served_query_backward), or, on the key side (grouped heads), key chunks (k, v) whose dK, dV
go home (served_key_backward); the forward serves key chunks when a mask needs only part of some
rank's keys, a sliding window above all, and its out, lse stay home (served_forward).

A ring (strategies/ring.py) forwards each block from rank to rank, so a rank holds two whole travelling
blocks (the one computed, the one arriving) and two accumulators (the one arriving, the one
leaving). Cutting ring blocks into chunks does not help much: in lockstep, a forwarded chunk reaches
its next rank a whole block before that rank uses it, so a block's worth still waits in a buffer.

Here each block's *owner* serves it. At step j rank r works on the block of src = holding(j), the
ring's pairing in the ring's order, chunk by chunk (R rows of an S-row shard): src sends each chunk
from its own tensors (views, nothing copied) just in time, and the chunk's float32 accumulators go
straight home to src, which adds them into its own. Above its own tensors a rank then holds the
chunk it computes, the next chunk arriving, and three accumulator chunks (the one being built, the
previous one leaving and the one arriving home): about (2·|block| + 3·|acc|)·R/S instead of
2·|block| + 2·|acc|. Bytes are the ring's, less the chunks the mask does not need (a ring forwards
every block whole; here a chunk no query row of which is needed is never sent).

Step j's transfers go to the rank j places away rather than to a neighbour: the same cost on one
node's switch (NVLink/NVSwitch, PCIe switch, a TCP host). Across nodes the double ring stays
(strategies/burst.py picks).
The plan (who serves which chunk when) is schedules/chunk_stream.py; this file runs it.

Every rank issues the same sequence of exchanges: labels (step, slot), each step with as many slots
as a shard has chunks (one where every rank is on its own block), and per label first the next
chunk's exchange, then the finished chunk's accumulators. Two ranks' matching ops sit at the same
label on both, so backends that match in issue order (NCCL) pair them right and no two ranks wait
on each other in a cycle; gloo matches by tag, in order.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..call import AttentionCall
from ..comm import tags
from ..comm.p2p import Transfer, exchange, tagged
from ..kernels.accumulators import accumulator_zeros_like, empty_accumulators
from ..keys import KeyBlocks
from ..masks import may_attend
from ..schedules.chunk_stream import CACHE_LIMIT, BoundedCache, cached_plan, default_chunk_rows, plan_stream, row_chunks
from ..schedules.ring import RingSchedule


def chunk_rows(call: AttentionCall, dtype: torch.dtype) -> int:
    """Rows per served chunk of queries or keys of `dtype` (0: whole blocks on the ring)."""
    rows = call.options.chunk_rows
    if rows is not None:
        return rows
    least = getattr(call.kernel, "MIN_CHUNK_ROWS_BY_DTYPE", {}).get(dtype, 0)
    return default_chunk_rows(call.local_len, call.kernel.MAX_ROWS, least)


def query_chunk_needed(call: AttentionCall, src: int, dst: int, start: int, stop: int) -> bool:
    """Does any query in rows [start, stop) of rank src's shard attend a key of rank dst's? Only such
    chunks are served (the same answer on every rank: it decides what is sent and received)."""
    return may_attend(call.chunk_segments(src, start, stop), call.segments(dst), call.spec)


def key_chunk_needed(call: AttentionCall, src: int, dst: int, start: int, stop: int) -> bool:
    """Does any query of rank dst attend a key in rows [start, stop) of rank src's shard?"""
    return may_attend(call.segments(dst), call.chunk_segments(src, start, stop), call.spec)


_PARTLY_NEEDED = BoundedCache(CACHE_LIMIT)  # keys_partly_needed's answers by (mask_key, rows)


def keys_partly_needed(call: AttentionCall, rows: int) -> bool:
    """Whether some rank needs only part of another's keys (a sliding window needs the last rows of
    the rank before, local documents a few). Decided from every rank's segments, so every rank takes
    the same forward. Then the forward serves key chunks like the backward serves query chunks."""

    def decide() -> bool:
        chunks = row_chunks(call.local_len, rows)
        return any(
            may_attend(call.segments(dst), call.segments(src), call.spec)
            and not all(key_chunk_needed(call, src, dst, a, b) for a, b in chunks)
            for dst in range(call.world)
            for src in range(call.world)
            if src != dst
        )

    return _PARTLY_NEEDED.get((call.mask_key, rows), decide)


def served_forward(call: AttentionCall, rows: int, q, keys: KeyBlocks):
    """K, V chunks from their owners (or what `keys` moves instead), only those our queries attend: the
    ring's block pairs in the ring's order (call.kv_schedule), holding a few chunks instead of a whole
    travelling block, and sending a window only the rows it sees. Out and lse stay home. Shapes as
    ring_forward's."""
    out_acc, lse_acc = empty_accumulators(q)
    mine = call.segments(call.rank)

    def attend(src, chunk, held, _accs):
        tiles = call.plan(mine, call.chunk_segments(src, *chunk))
        k_src, v_src = keys.expand(held)
        call.attend_forward(q, k_src, v_src, tiles, out_acc, lse_acc)

    blocks = keys.travelling
    stream_chunks(
        call,
        call.kv_schedule,
        "forward",
        blocks,
        (1,) * len(blocks),
        rows,
        functools.partial(key_chunk_needed, call),
        attend,
        acc_likes=[],
        plan_key=("keys", call.mask_key),
    )
    return out_acc.to(q.dtype), lse_acc


def served_query_backward(call: AttentionCall, rows: int, travelling, out, k, v, dk, dv):
    """Chunks of (q, dO, D, lse) from their owners; dQ chunks straight home (stream_chunks below)."""
    mine = call.segments(call.rank)
    needs = functools.partial(query_chunk_needed, call)

    def attend(src, chunk, held, accs):
        q_c, dout_c, delta_c, lse_c, *indices_c = held  # indices: the chunk's rows' chosen keys, if any
        out_c = out[:, chunk[0] : chunk[1]] if src == call.rank else None  # others' rebuilt from D per tile
        # Kernel calls sized to the chunk bound their fresh dQ, dK, dV; our own block (one chunk, nothing
        # in flight beside it) takes the kernel's full call size, which adds fewer dK, dV partials.
        tiles = call.plan(call.chunk_segments(src, *chunk), mine, max_rows=None if src == call.rank else rows)
        call.attend_backward(
            dout_c,
            q_c,
            k,
            v,
            out_c,
            lse_c,
            tiles,
            accs[0],
            dk,
            dv,
            delta=delta_c,
            indices=indices_c[0] if indices_c else None,
        )

    row_dims = (1, 1, 2, 2, 1)[: len(travelling)]
    (dq,) = stream_chunks(
        call,
        call.q_schedule,
        "backward",
        travelling,
        row_dims,
        rows,
        needs,
        attend,
        acc_likes=travelling[:1],
        plan_key=("queries", call.mask_key),
    )
    return dq


def served_key_backward(call: AttentionCall, rows: int, dout, q, keys: KeyBlocks, out, lse):
    """BurstAttention's key side: chunks of what `keys` moves (k, v; MLA's latent) from their owners,
    only those our queries attend, in the ring's order (call.kv_schedule); their float32 gradient chunks
    straight home; dQ stays here. lse as kernels.lse_for_backward gives it. Returns (dq float32, the
    accumulators of this rank's blocks)."""
    dq = accumulator_zeros_like(q)
    mine = call.segments(call.rank)

    def attend(src, chunk, held, accs):
        # Kernel calls sized to the chunk bound their fresh dQ, dK, dV (our own block: the full call size).
        tiles = call.plan(mine, call.chunk_segments(src, *chunk), max_rows=None if src == call.rank else rows)
        k_src, v_src, dk, dv, finish = keys.for_backward(held, accs[0], accs[-1])
        call.attend_backward(dout, q, k_src, v_src, out, lse, tiles, dq, dk, dv)
        finish()

    blocks = keys.travelling
    grads = stream_chunks(
        call,
        call.kv_schedule,
        "backward",
        blocks,
        (1,) * len(blocks),
        rows,
        functools.partial(key_chunk_needed, call),
        attend,
        acc_likes=blocks,
        plan_key=("keys", call.mask_key),
    )
    return dq, grads


def stream_chunks(
    call,
    schedule: RingSchedule,
    phase: str,
    block: Sequence[torch.Tensor],
    row_dims: Sequence[int],
    chunk_rows: int,
    needs: Callable,
    compute: Callable,
    acc_likes: Sequence[torch.Tensor],
    plan_key=None,
) -> list[torch.Tensor]:
    """Run `compute(src, (start, stop), held, accs)` for every chunk this rank works on.

    block: this rank's tensors that are served, each cut along its dim in row_dims. held: rows
    [start, stop) of rank src's block. accs: float32 accumulators for those rows, shaped like rows of
    acc_likes (cut along the same dims as the block tensors of the same index), to add into; they go
    home to src. Returns this rank's float32 accumulators, zeros plus every contribution.
    plan_key: when given, the plan is cached under it (see cached_plan).
    """
    me = schedule.rank
    homes = [accumulator_zeros_like(t) for t in acc_likes]
    acc_dims = list(row_dims[: len(homes)])
    steps = (
        plan_stream(schedule, call.local_len, chunk_rows, needs)
        if plan_key is None
        else cached_plan(plan_key, schedule, call.local_len, chunk_rows, needs)
    )
    labels = [(step, slot) for step in steps for slot in range(step.slots)]

    def rows_of(tensors, dims, chunk):
        return [t.narrow(d, chunk[0], chunk[1] - chunk[0]) for t, d in zip(tensors, dims)]

    def post_chunk(label) -> Transfer | None:
        step, slot = label
        sends = recvs = ()
        if step.peer != me and slot < len(step.chunks_out):
            sends = tagged(rows_of(block, row_dims, step.chunks_out[slot]), step.peer, tags.STREAM_CHUNKS)
        if step.src != me and slot < len(step.chunks_in):
            recvs = tagged(rows_of(block, row_dims, step.chunks_in[slot]), step.src, tags.STREAM_CHUNKS)
        return exchange(call.group, phase, sends, recvs, topology=call.topology) if sends or recvs else None

    def post_accs(label, built) -> tuple[Transfer, tuple[int, int]] | None:
        step, slot = label
        sends = tagged(built, step.src, tags.STREAM_ACCUMULATORS) if built is not None else ()
        recvs, chunk = (), None
        if step.peer != me and slot < len(step.chunks_out):
            chunk = step.chunks_out[slot]
            recvs = tagged(rows_of(homes, acc_dims, chunk), step.peer, tags.STREAM_ACCUMULATORS)
        if not sends and not recvs:
            return None
        return exchange(call.group, phase, sends, recvs, topology=call.topology), chunk

    def add_home(posted) -> None:
        if posted is None:
            return
        transfer, chunk = posted
        arrived = transfer.wait()
        if chunk is not None:
            for home, part in zip(rows_of(homes, acc_dims, chunk), arrived):
                home.add_(part)

    incoming = post_chunk(labels[0]) if labels else None
    leaving = None
    for n, (step, slot) in enumerate(labels):
        held = incoming.wait() if incoming is not None else None
        incoming = post_chunk(labels[n + 1]) if n + 1 < len(labels) else None
        built = None
        if slot < len(step.chunks_in):
            chunk = step.chunks_in[slot]
            if step.src == me:  # our own rows: computed from our tensors, added straight into our accumulators
                compute(me, chunk, rows_of(block, row_dims, chunk), rows_of(homes, acc_dims, chunk))
            else:
                built = [accumulator_zeros_like(t) for t in rows_of(acc_likes, acc_dims, chunk)]
                compute(step.src, chunk, held, built)
        del held
        posted = post_accs((step, slot), built)
        del built
        add_home(leaving)  # the previous chunk's accumulators: they moved while this chunk computed
        leaving = posted
    add_home(leaving)
    return homes
