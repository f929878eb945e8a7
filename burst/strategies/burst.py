"""BurstAttention (burstattention.md; burstengine.md §3.1, Alg. 2).

Forward: the same K, V ring with online softmax as RingAttention (strategies/ring.py).
Backward: K, V, dK, dV stay home; Q, dO, D = rowsum(dO∘O) and lse travel (read-only), and dQ travels
as a float32 accumulator that arrives home after a full turn. Per row and head that is 3d + 2 numbers
against RingAttention's 4d: about 25% less backward traffic for fp32 and MHA. (With GQA, Q has more
heads than K, V, so ring's backward can be the cheaper one; the planner weighs that.)
"""

from __future__ import annotations

from ..block import accumulator_zeros_like, attend_backward
from ..call import AttentionCall
from ..comm.double_ring import visit_blocks
from ..kernels import lse_for_backward, row_delta
from .base import Strategy
from .ring import ring_forward


def burst_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """burstengine.md Alg. 2. Shapes as in ring_backward; returns dq, dk, dv in input dtypes.

    Queries travel the opposite way to the forward's K, V (call.q_schedule), so this rank's keys meet
    the same block pairs in the same order; on several nodes, on the double ring.
    """
    delta = row_delta(dout, out)  # D_i, computed once here instead of at every step
    dk, dv = accumulator_zeros_like(k), accumulator_zeros_like(v)

    def attend(src, travelling, dq_acc):  # the queries of rank src against our keys
        q_j, dout_j, delta_j, lse_j = travelling
        # Our own queries come with their real output; others' are rebuilt from D tile by tile.
        out_j = out if src == call.rank else None
        attend_backward(call.kernel, dout_j, q_j, k, v, out_j, lse_j, call.tiles(src, call.rank), dq_acc.part(0),
                        dk, dv, call.scale, delta=delta_j)

    (dq,) = visit_blocks(call, call.q_schedule, "backward", [q, dout, delta, lse_for_backward(lse)], attend,
                         acc_likes=[q])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


BURST = Strategy("burst", forward=ring_forward, backward=burst_backward)
