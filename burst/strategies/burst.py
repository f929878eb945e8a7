"""BurstAttention (burstattention.md; burstengine.md §3.1, Alg. 2).

Forward: the same K, V ring with online softmax as RingAttention (strategies/ring.py).
Backward: K, V, dK, dV stay home; Q, dO, D = rowsum(dO∘O) and lse travel (read-only), and dQ travels
as a float32 accumulator that arrives home. Per row and head that is 3d + 2 numbers against
RingAttention's 4d: about 25% less backward traffic for fp32 and MHA. (With GQA, Q has more heads
than K, V, so ring's backward can be the cheaper one; the planner weighs that.)

On one node the queries are served in chunks by their owners (comm/chunk_stream.py): the ring's
block pairs in the ring's order, but a rank holds a few chunks of Q, dO, dQ instead of two whole
travelling blocks and two dQ blocks (benchmarks/memory_notes.md). Option `chunk_rows`: rows per
chunk (default: an eighth of the shard, 256 to the kernel's call size); 0 runs the paper's ring
of whole blocks, neighbour to neighbour. Across nodes the double ring runs (comm/double_ring.py).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from ..block import accumulator_zeros_like, attend_backward
from ..call import AttentionCall
from ..comm.chunk_stream import default_chunk_rows, stream_chunks
from ..comm.double_ring import visit_blocks
from ..kernels import lse_for_backward, row_delta
from ..masks import may_attend
from .base import Strategy
from .ring import ring_forward


def burst_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """burstengine.md Alg. 2. Shapes as in ring_backward; returns dq, dk, dv in input dtypes.

    Queries meet this rank's keys in the order of call.q_schedule (the forward's pairs, in the same
    order); on one node served chunk by chunk, across nodes on the double ring.
    """
    delta = row_delta(dout, out)  # D_i, computed once here instead of at every step
    dk, dv = accumulator_zeros_like(k), accumulator_zeros_like(v)
    travelling = [q, dout, delta, lse_for_backward(lse)]
    rows = chunk_rows(call)
    if rows and _on_one_node(call):
        dq = _served_backward(call, rows, travelling, out, k, v, dk, dv)
    else:
        dq = _ring_backward(call, travelling, out, k, v, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def chunk_rows(call: AttentionCall) -> int:
    """Rows per served chunk of queries (0: whole blocks on the ring)."""
    rows = call.options.get("chunk_rows")
    return default_chunk_rows(call.local_len, call.kernel.MAX_ROWS) if rows is None else rows


def _on_one_node(call: AttentionCall) -> bool:
    """The chunk stream's shifts suit one node's switch; across nodes the (double) ring runs, also when
    the topology asks for the flat ring (double_ring=False), which then stays neighbour to neighbour."""
    if call.q_schedule.nodes != 1:
        return False
    topo = call.topology
    return topo is None or call.group not in (None, dist.group.WORLD) or topo.local_world_size >= call.world


def query_chunk_needed(call: AttentionCall, src: int, dst: int, start: int, stop: int) -> bool:
    """Does any query in rows [start, stop) of rank src's shard attend a key of rank dst's? Only such
    chunks are served (the same answer on every rank: it decides what is sent and received)."""
    return may_attend(call.chunk_segments(src, start, stop), call.segments(dst), call.spec)


def _served_backward(call: AttentionCall, rows: int, travelling, out, k, v, dk, dv):
    """Chunks of (q, dO, D, lse) from their owners; dQ chunks straight home (comm/chunk_stream.py)."""
    mine = call.segments(call.rank)
    needs = functools.partial(query_chunk_needed, call)

    def attend(src, chunk, held, accs):
        q_c, dout_c, delta_c, lse_c = held
        out_c = out[:, chunk[0]:chunk[1]] if src == call.rank else None  # others' rebuilt from D per tile
        # Kernel calls sized to the chunk bound their fresh dQ, dK, dV; our own block (one chunk, nothing
        # in flight beside it) takes the kernel's full call size, which adds fewer dK, dV partials.
        tiles = call.plan(call.chunk_segments(src, *chunk), mine, max_rows=None if src == call.rank else rows)
        attend_backward(call.kernel, dout_c, q_c, k, v, out_c, lse_c, tiles, accs[0], dk, dv, call.scale,
                        delta=delta_c)

    (dq,) = stream_chunks(call, call.q_schedule, "backward", travelling, (1, 1, 2, 2), rows, needs, attend,
                          acc_likes=travelling[:1], plan_key=("queries", call.mask_key))
    return dq


def _ring_backward(call: AttentionCall, travelling, out, k, v, dk, dv):
    """Whole blocks of (q, dO, D, lse) around the (double) ring, dQ travelling with them."""

    def attend(src, held, dq_acc):  # the queries of rank src against our keys
        q_j, dout_j, delta_j, lse_j = held
        # Our own queries come with their real output; others' are rebuilt from D tile by tile.
        out_j = out if src == call.rank else None
        attend_backward(call.kernel, dout_j, q_j, k, v, out_j, lse_j, call.tiles(src, call.rank), dq_acc.part(0),
                        dk, dv, call.scale, delta=delta_j)

    (dq,) = visit_blocks(call, call.q_schedule, "backward", travelling, attend, acc_likes=travelling[:1])
    return dq


def check_burst(call: AttentionCall, q, k) -> None:
    rows = call.options.get("chunk_rows")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ValueError(f"chunk_rows must be a non-negative int (0: whole blocks on the ring), got {rows!r}")


BURST = Strategy("burst", forward=ring_forward, backward=burst_backward, options=("chunk_rows",), check=check_burst)
