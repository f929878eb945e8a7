"""RingAttention (ring-attention.md; burstengine.md Alg. 1).

Forward: K, V travel around the ring; each rank merges its queries' attention against every block
with online softmax (merge.py). BurstAttention (strategies/burst.py) runs this forward too, except on
one node when a mask needs only part of some rank's keys (then they are served in chunks).
Backward: K, V, dK, dV travel; each rank adds its queries' contribution to the visiting dK, dV, which
arrive home after a full turn. Bytes per rank: forward 2·(G-1) KV blocks; backward 2·(G-1) KV blocks
plus 2·G gradient blocks (float32), i.e. about 4Nd for large G.

Transfers are double-buffered: the next block is posted before the current one is computed. When
the mask leaves nothing to do beyond s ring steps (sliding windows, local documents), the ring stops
after s steps and the gradients take one direct hop home. On a topology with several nodes the same
loops run on the double ring (schedules/ring.py: intra-node rings inside inter-node steps).

`visit_blocks` is the loop itself, shared by BurstAttention's forward and its cross-node backward:
the schedule (schedules/ring.py) says who holds which block when; RingComm (comm/ring.py) moves them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..call import AttentionCall
from ..comm import tags
from ..comm.ring import RingComm
from ..kernels.accumulators import (
    ArrivingAccumulators,
    accumulator_dtype,
    accumulator_zeros_like,
    empty_accumulators,
    lse_for_backward,
)
from ..keys import KeyBlocks
from ..masks import Tile
from ..schedules.ring import RingSchedule
from .base import Strategy


def ring_forward(call: AttentionCall, q, keys: KeyBlocks):
    """Forward pass with K, V rotating (burstattention.md Alg. 1-2, forward), on the flat ring or,
    across nodes, the double ring (schedules/ring.py).

    q: (batch, seqlen, nheads, headdim); keys: this rank's key side (burst/keys.py), keys.k, keys.v
    (batch, seqlen, nheads_k, headdim), or what travels instead (MLA's latent). Returns out in q's dtype
    and lse (batch, nheads, seqlen) float32.
    """
    alone = one_call(call)
    if alone is not None:  # the kernel's own out and lse: no float32 accumulator, no merge
        out, lse = call.kernel.forward(q, *keys.expand(keys.travelling), call.scale, alone.causal, alone.kernel_mask)
        return out.contiguous(), lse.to(accumulator_dtype(q.dtype))
    out_acc, lse_acc = empty_accumulators(q)

    def attend(src, held, _):  # our queries against the K, V of rank src (one block when v is k)
        k_src, v_src = keys.expand(held)
        call.attend_forward(q, k_src, v_src, call.tiles(call.rank, src), out_acc, lse_acc)

    visit_blocks(call, call.kv_schedule, "forward", keys.travelling, attend)
    return out_acc.to(q.dtype), lse_acc


def ring_backward(call: AttentionCall, dout, q, keys: KeyBlocks, out, lse):
    """Backward with K, V, dK, dV rotating (burstengine.md Alg. 1). Returns dq, dk, dv in input dtypes."""
    k, v = keys.k, keys.v
    alone = one_call(call)
    if alone is not None:  # the kernel's gradients as they are: no float32 accumulators
        dq, dk, dv = call.kernel.backward(
            dout, q, k, v, out, lse_for_backward(lse), call.scale, alone.causal, alone.kernel_mask
        )
        return (dq, *keys.gradients([dk + dv] if v is k else [dk, dv]))
    dq, grads = ring_key_backward(call, dout, q, keys, out, lse_for_backward(lse))
    return (dq.to(q.dtype), *keys.gradients(grads))


def one_call(call: AttentionCall) -> Tile | None:
    """The tile of a call that is one kernel call (one rank, no index selection, the shard one tile
    under the kernel's own size): nothing travels and nothing merges, so the kernel's results are the
    call's. None otherwise."""
    if call.world != 1 or call.indices is not None:
        return None
    tiles = call.tiles(call.rank, call.rank)
    if len(tiles) != 1 or tiles[0].q.length != call.local_len or tiles[0].k.length != call.local_len:
        return None
    return tiles[0]


def ring_key_backward(call: AttentionCall, dout, q, keys: KeyBlocks, out, lse):
    """The key side's blocks and their float32 gradient accumulators around the ring; dq stays here.
    lse as kernels.lse_for_backward gives it. Returns (dq float32, the accumulators that came home)."""
    dq = accumulator_zeros_like(q)

    def attend(src, held, grads):  # the visiting block's dK, dV add onto what the ranks before us added
        k_src, v_src, dk, dv, finish = keys.for_backward(held, grads.part(0), grads.part(-1))
        call.attend_backward(dout, q, k_src, v_src, out, lse, call.tiles(call.rank, src), dq, dk, dv)
        finish()

    # with v is k one block and one accumulator, dK and dV added into it
    grads = visit_blocks(call, call.kv_schedule, "backward", keys.travelling, attend, acc_likes=keys.travelling)
    return dq, grads


def visit_blocks(
    call,
    schedule: RingSchedule,
    phase: str,
    block: Sequence[torch.Tensor],
    compute: Callable,
    acc_likes: Sequence[torch.Tensor] | None = None,
):
    """Run `compute(src, held, accs)` for every step of `schedule` while blocks move.

    block: this rank's tensors that travel. held: the block of rank `src` at that step. accs: when
    acc_likes is given, an ArrivingAccumulators for the held block's float32 accumulators
    (shaped like acc_likes), which travel with it inside the node and then go home; else None.
    Returns the sum of the accumulators that came home for this rank's own block (acc_likes given).
    """
    s = schedule
    intra = RingComm(call.group, phase, tag=tags.RING_INTRA, topology=call.topology)
    inter = RingComm(call.group, phase, tag=tags.RING_INTER, topology=call.topology)
    accs_comm = RingComm(call.group, phase, tag=tags.RING_ACCUMULATORS, topology=call.topology) if acc_likes else None
    mine, home, pending_home = None, None, False
    outer_block = list(block)
    plan = s.by_outer()
    for n_outer, (o, inner) in enumerate(plan):
        more_outer = n_outer + 1 < len(plan)
        if more_outer:  # posted first: it has the whole inner ring to arrive
            next_outer = inter.send_recv(outer_block, to=s.inter_next, frm=s.inter_prev)
        held, incoming = outer_block, None
        for n_inner, j in enumerate(inner):
            more_inner = n_inner + 1 < len(inner)
            if more_inner:
                next_held = intra.send_recv(held, to=s.intra_next, frm=s.intra_prev)
            src = s.holding(o, j)
            accs = (
                ArrivingAccumulators(list(acc_likes), accs_comm, incoming if n_inner > 0 else None)
                if acc_likes
                else None
            )
            compute(src, held, accs)
            if acc_likes:
                done = accs()  # (fetched already unless this step had no tile)
                if pending_home:  # the previous node's gradients, home while this step computed
                    mine = _add_home(mine, home, accs_comm)
                    pending_home = False
                if more_inner:
                    incoming = accs_comm.send_recv(done, to=s.intra_next, frm=s.intra_prev)
                else:  # straight home to the block's owner
                    home = accs_comm.send_recv(done, to=src, frm=s.holder_of_mine(o, j))
                    pending_home = True
                del accs, done
            if more_inner:
                intra.wait()
                held = next_held
        if more_outer:
            inter.wait()
            outer_block = next_outer
    if pending_home:
        mine = _add_home(mine, home, accs_comm)
    return mine


def _add_home(mine, arrived, comm: RingComm):
    comm.wait()
    if mine is None:
        return list(arrived)
    for acc, part in zip(mine, arrived):
        acc.add_(part)
    return mine


RING = Strategy("ring", forward=ring_forward, backward=ring_backward, takes_indices=True)
