"""RingAttention (ring-attention.md; burstengine.md Alg. 1).

Forward: K, V travel around the ring; each rank merges its queries' attention against every block
with online softmax (merge.py). This forward is shared by BurstAttention (strategies/burst.py).
Backward: K, V, dK, dV travel; each rank adds its queries' contribution to the visiting dK, dV, which
arrive home after a full turn. Bytes per rank: forward 2·(G-1) KV blocks; backward 2·(G-1) KV blocks
plus 2·G gradient blocks (float32), i.e. about 4Nd for large G.

Transfers are double-buffered: the next block is posted before the current one is computed. When
the mask leaves nothing to do beyond s ring steps (sliding windows, local documents), the ring stops
after s steps and the gradients take one direct hop home. On a topology with several nodes the same
loops run on the double ring (comm/double_ring.py: intra-node rings inside inter-node steps).
"""

from __future__ import annotations

from ..block import accumulator_zeros_like, attend_backward, attend_forward, empty_accumulators
from ..call import AttentionCall
from ..comm.double_ring import visit_blocks
from ..kernels import lse_for_backward
from .base import Strategy


def ring_forward(call: AttentionCall, q, k, v):
    """Forward pass with K, V rotating (burstattention.md Alg. 1-2, forward), on the flat ring or,
    across nodes, the double ring (comm/double_ring.py).

    q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen, nheads_k, headdim), this rank's shard.
    Returns out in q's dtype and lse (batch, nheads, seqlen) float32.
    """
    out_acc, lse_acc = empty_accumulators(q)

    def attend(src, kv, _):  # our queries against the K, V of rank src
        attend_forward(call.kernel, q, kv[0], kv[1], call.tiles(call.rank, src), out_acc, lse_acc, call.scale)

    visit_blocks(call, call.kv_schedule, "forward", [k, v], attend)
    return out_acc.to(q.dtype), lse_acc


def ring_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """Backward with K, V, dK, dV rotating (burstengine.md Alg. 1). Returns dq, dk, dv in input dtypes."""
    lse = lse_for_backward(lse)
    dq = accumulator_zeros_like(q)

    def attend(src, kv, grads):  # the visiting block's dK, dV add onto what the ranks before us added
        attend_backward(call.kernel, dout, q, kv[0], kv[1], out, lse, call.tiles(call.rank, src), dq,
                        grads.part(0), grads.part(1), call.scale)

    dk, dv = visit_blocks(call, call.kv_schedule, "backward", [k, v], attend, acc_likes=[k, v])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


RING = Strategy("ring", forward=ring_forward, backward=ring_backward)
