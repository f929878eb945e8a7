"""All-gather attention: gather every rank's K, V once, then attend locally (the Llama 3 baseline).

Each rank holds the whole sequence's K, V (kv heads only) for the duration of the call: memory grows
with the full sequence, which is what the ring strategies avoid. Backward computes dK, dV for every
block locally and reduce-scatters them (float32) to their owners.
Bytes per rank: forward (G-1) KV blocks; backward (G-1) KV blocks again plus (G-1) float32 dKV blocks.
"""

from __future__ import annotations

import time

import torch

from ..call import AttentionCall
from ..comm import tensor_bytes
from ..comm.collectives import all_gather_flat, record_to_peers, reduce_scatter_flat
from ..kernels.accumulators import accumulator_zeros_like, empty_accumulators, lse_for_backward
from .base import Strategy


def _gather_kv(call: AttentionCall, k, v, phase: str) -> torch.Tensor:
    """(2·G, batch, seqlen, nheads_k, headdim): K and V of every rank, in rank order."""
    kv = torch.stack([k, v])
    if call.world == 1:
        return kv
    gathered = kv.new_empty((2 * call.world, *k.shape))
    posted = time.perf_counter()
    all_gather_flat(gathered, kv, group=call.group)
    record_to_peers(phase, tensor_bytes(kv), call.group, call.topology, posted)
    return gathered


def allgather_forward(call: AttentionCall, q, keys):
    kv_all = _gather_kv(call, keys.k, keys.v, "forward")
    out_acc, lse_acc = empty_accumulators(q)
    for src in range(call.world):
        call.attend_forward(q, kv_all[2 * src], kv_all[2 * src + 1], call.tiles(call.rank, src), out_acc, lse_acc)
    return out_acc.to(q.dtype), lse_acc


def allgather_backward(call: AttentionCall, dout, q, keys, out, lse):
    k, v = keys.k, keys.v
    kv_all = _gather_kv(call, k, v, "backward")  # re-gathered, not kept: saves memory between passes
    lse = lse_for_backward(lse)
    dq = accumulator_zeros_like(q)
    dkv_all = accumulator_zeros_like(kv_all)
    for src in range(call.world):
        call.attend_backward(
            dout,
            q,
            kv_all[2 * src],
            kv_all[2 * src + 1],
            out,
            lse,
            call.tiles(call.rank, src),
            dq,
            dkv_all[2 * src],
            dkv_all[2 * src + 1],
        )
    if call.world == 1:
        dkv = dkv_all
    else:
        dkv = dkv_all.new_empty(dkv_all[:2].shape)
        posted = time.perf_counter()
        reduce_scatter_flat(dkv, dkv_all, group=call.group)
        record_to_peers("backward", tensor_bytes(dkv), call.group, call.topology, posted)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


ALLGATHER = Strategy("allgather", forward=allgather_forward, backward=allgather_backward, takes_indices=True)
