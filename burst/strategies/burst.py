"""BurstAttention (burstattention.md; burstengine.md §3.1, Alg. 2).

Forward: the same K, V ring with online softmax as RingAttention (strategies/ring.py).
Backward: K, V, dK, dV stay home; Q, dO, D = rowsum(dO∘O) and lse travel (read-only), and dQ travels
as a float32 accumulator that arrives home after a full turn. Per row and head that is 3d + 2 numbers
against RingAttention's 4d: about 25% less backward traffic for fp32 and MHA. (With GQA, Q has more
heads than K, V, so ring's backward can be the cheaper one; the planner weighs that.)
"""

from __future__ import annotations

from ..block import ArrivingAccumulators, accumulator_zeros_like, attend_backward
from ..call import AttentionCall
from ..comm import RingComm
from ..kernels import lse_for_backward, row_delta
from .base import Strategy
from .ring import ring_forward


def burst_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """burstengine.md Alg. 2. Shapes as in ring_backward; returns dq, dk, dv in input dtypes."""
    data_comm = RingComm(call.group, "backward", tag=0)
    dq_comm = RingComm(call.group, "backward", tag=4)
    delta = row_delta(dout, out)  # D_i, computed once here instead of at every step
    travelling = [q, dout, delta, lse_for_backward(lse)]
    dk, dv = accumulator_zeros_like(k), accumulator_zeros_like(v)
    steps = call.ring_steps
    # Queries travel backwards (rank+1 -> rank) so that at step s this rank's keys meet the queries of
    # rank + s: the same block pairs, in the same order, as the forward's keys of rank - s.
    for step in range(steps):
        if step + 1 < steps:
            next_travelling = data_comm.send_recv(travelling, offset=-1)
        src = (call.rank + step) % call.world  # owner of the queries we hold now
        q_j, dout_j, delta_j, lse_j = travelling
        # dQ of these queries, accumulated onto what arrives from the rank before (zeros at step 0).
        dq_j = ArrivingAccumulators([q], dq_comm, incoming if step > 0 else None)
        tiles = call.tiles(src, call.rank)
        # Our own queries come with their real output; others' are rebuilt from D tile by tile.
        out_j = out if src == call.rank else None
        attend_backward(call.kernel, dout_j, q_j, k, v, out_j, lse_j, tiles, dq_j.part(0), dk, dv, call.scale,
                        delta=delta_j)
        (dq_j,) = dq_j()  # (already fetched unless this rank had no tile at this step)
        # Pass dQ on with its queries; after the last step send it straight home to src.
        incoming = dq_comm.send_recv([dq_j], offset=-1 if step + 1 < steps else step)
        del dq_j
        if step + 1 < steps:
            data_comm.wait()
            travelling = next_travelling
    dq_comm.wait()  # our own queries' gradient, home
    return incoming[0].to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


BURST = Strategy("burst", forward=ring_forward, backward=burst_backward)
