"""RingAttention (ring-attention.md; burstengine.md Alg. 1).

Forward: K, V travel around the ring; each rank merges its queries' attention against every block
with online softmax (merge.py). This forward is shared by BurstAttention (strategies/burst.py).
Backward: K, V, dK, dV travel; each rank adds its queries' contribution to the visiting dK, dV, which
arrive home after a full turn. Bytes per rank: forward 2·(G-1) KV blocks; backward 2·(G-1) KV blocks
plus 2·G gradient blocks (float32), i.e. about 4Nd for large G.

Transfers are double-buffered: the next block is posted before the current one is computed. When
the mask leaves nothing to do beyond s ring steps (sliding windows, local documents), the ring stops
after s steps and the gradients take one direct hop home.
"""

from __future__ import annotations

from ..block import ArrivingAccumulators, accumulator_zeros_like, attend_backward, attend_forward, empty_accumulators
from ..call import AttentionCall
from ..comm import RingComm
from ..kernels import lse_for_backward
from .base import Strategy


def ring_forward(call: AttentionCall, q, k, v):
    """Forward pass with K, V rotating (burstattention.md Alg. 1-2, forward).

    q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen, nheads_k, headdim), this rank's shard.
    Returns out in q's dtype and lse (batch, nheads, seqlen) float32.
    """
    comm = RingComm(call.group, "forward")
    out_acc, lse_acc = empty_accumulators(q)
    kv = [k, v]
    steps = call.ring_steps
    for step in range(steps):
        if step + 1 < steps:
            next_kv = comm.send_recv(kv)
        src = (call.rank - step) % call.world  # owner of the K, V we hold now
        attend_forward(call.kernel, q, kv[0], kv[1], call.tiles(call.rank, src), out_acc, lse_acc, call.scale)
        if step + 1 < steps:
            comm.wait()
            kv = next_kv
    return out_acc.to(q.dtype), lse_acc


def ring_backward(call: AttentionCall, dout, q, k, v, out, lse):
    """Backward with K, V, dK, dV rotating (burstengine.md Alg. 1). Returns dq, dk, dv in input dtypes."""
    kv_comm = RingComm(call.group, "backward", tag=0)
    grad_comm = RingComm(call.group, "backward", tag=2)
    lse = lse_for_backward(lse)
    dq = accumulator_zeros_like(q)
    kv = [k, v]
    steps = call.ring_steps
    for step in range(steps):
        if step + 1 < steps:
            next_kv = kv_comm.send_recv(kv)
        src = (call.rank - step) % call.world
        # The visiting block's dK, dV: onto what the ranks before us added (zeros at step 0).
        grads = ArrivingAccumulators([k, v], grad_comm, incoming if step > 0 else None)
        attend_backward(call.kernel, dout, q, kv[0], kv[1], out, lse, call.tiles(call.rank, src), dq,
                        grads.part(0), grads.part(1), call.scale)
        # Pass the gradients on along the ring; after the last step send them straight home to src.
        incoming = grad_comm.send_recv(grads(), offset=1 if step + 1 < steps else -step)
        del grads
        if step + 1 < steps:
            kv_comm.wait()
            kv = next_kv
    grad_comm.wait()  # our own block's gradients, home
    return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype)


RING = Strategy("ring", forward=ring_forward, backward=ring_backward)
