"""DistFlashAttn's load-balanced causal schedule (distflashattn.md §3.2, Alg. 2), forward and backward.

Contiguous shards, causal mask. Rank p must attend its own diagonal block and the p blocks before
it; with a plain ring the early ranks sit idle while the late ones work. Here, at step t = 1..P//2:

- owner work: a rank p >= t fetches K, V of rank p - t and attends them with its own queries;
- helper work: a rank p < t, which has no block of its own left, fetches the queries of the busy
  rank r = p + P - t, attends them against its own K, V, and sends the partial (out, lse) back,
  which r merges with online softmax (the paper's rescale).

Helper work exists when 2t < P, so for odd P every rank works at every step (idle fraction 0). For
even P the paper leaves half the ranks idle at the last step (1/(2P)); we split that step's blocks
by query rows instead: the owner attends the first half of its rows, the keys' rank (idle otherwise)
the second half, so every rank does the same work for every P. The backward follows the schedule:
the owner sends dK, dV back to the keys' rank, the helper sends dQ back to the queries' rank.
The schedule (who meets whom at each step) is schedules/distflash.py; this file runs it.
Every transfer of step t+1 is posted before step t is computed, and the results of step t are
collected after step t+1's compute, so communication overlaps computation.
"""

from __future__ import annotations

from ..call import AttentionCall
from ..comm import Transfer, exchange, tagged, tags
from ..kernels.accumulators import accumulator_zeros_like, empty_accumulators, lse_for_backward, row_delta
from ..layout import Segment
from ..merge import merge_partial
from ..schedules.distflash import Step, schedule
from .base import Strategy


def _query_tiles(call: AttentionCall, q_rank: int, rows: slice, k_rank: int, rebase: bool):
    """Tiles for rows `rows` of `q_rank`'s queries against `k_rank`'s keys; with `rebase`, tile rows
    index a tensor that holds just those rows (what a helper receives)."""
    seg = call.segments(q_rank)[0]
    start, stop, _ = rows.indices(seg.length)
    sub = seg.sub(start, stop)
    if rebase:
        sub = Segment(0, sub.length, sub.first, sub.stride)
    return call.plan([sub], call.segments(k_rank))


def _post_inputs(call: AttentionCall, step: Step, phase: str, mine_kv: list, mine_q: list) -> Transfer:
    """Post the step's inputs: K, V for owner work, query rows (and extras) for helper work.

    mine_q: per-row tensors, (batch, seqlen, ...) or (batch, heads, seqlen) when 3-D (lse, D).
    """
    sends, recvs = [], []
    if step.kv_to is not None:
        sends += tagged(mine_kv, step.kv_to, tags.DISTFLASH_KV)
    if step.helped_by is not None:
        sends += tagged(_rows(mine_q, step.help_rows), step.helped_by, tags.DISTFLASH_QUERIES)
    if step.kv_from is not None:
        recvs += tagged(mine_kv, step.kv_from, tags.DISTFLASH_KV)
    if step.help_for is not None:
        recvs += tagged(_rows(mine_q, step.help_rows), step.help_for, tags.DISTFLASH_QUERIES)
    return exchange(call.group, phase, sends, recvs, topology=call.topology)


def _rows(tensors: list, rows: slice) -> list:
    """The query rows `rows` of each per-row tensor (sequence is dim 1, or dim 2 for lse and D)."""
    return [t[:, :, rows] if t.dim() == 3 else t[:, rows] for t in tensors]


def _split_received(step: Step, received: list, n_kv: int):
    """(K, V) for owner work or None, and the helped rank's tensors or None."""
    kv = received[:n_kv] if step.kv_from is not None else None
    rest = received[n_kv:] if step.kv_from is not None else received
    return kv, (rest if step.help_for is not None else None)


def distflash_forward(call: AttentionCall, q, keys):
    """Balanced forward. Returns out in q's dtype and lse (batch, nheads, seqlen) float32."""
    k, v = keys.k, keys.v
    out_acc, lse_acc = empty_accumulators(q)
    call.attend_forward(q, k, v, call.tiles(call.rank, call.rank), out_acc, lse_acc)
    steps = schedule(call.rank, call.world, call.local_len)
    pending = _post_inputs(call, steps[0], "forward", [k, v], [q]) if steps else None
    results = None  # the previous step's helper result, merged after this step's compute
    for i, step in enumerate(steps):
        kv, helped_q = _split_received(step, pending.wait(), 2)
        if i + 1 < len(steps):
            pending = _post_inputs(call, steps[i + 1], "forward", [k, v], [q])
        if kv is not None:
            tiles = _query_tiles(call, call.rank, step.own_rows, step.kv_from, rebase=False)
            call.attend_forward(q, kv[0], kv[1], tiles, out_acc, lse_acc)
        sends, recvs = [], []
        if helped_q is not None:
            o_h, lse_h = empty_accumulators(helped_q[0])
            tiles = _query_tiles(call, step.help_for, step.help_rows, call.rank, rebase=True)
            call.attend_forward(helped_q[0], k, v, tiles, o_h, lse_h)
            sends = [(o_h, step.help_for, tags.DISTFLASH_RESULTS), (lse_h, step.help_for, tags.DISTFLASH_RESULTS + 1)]
        if step.helped_by is not None:
            rows = _rows([out_acc, lse_acc], step.help_rows)
            recvs = [
                (rows[0], step.helped_by, tags.DISTFLASH_RESULTS),
                (rows[1], step.helped_by, tags.DISTFLASH_RESULTS + 1),
            ]
        _merge_result(results, out_acc, lse_acc)
        results = (exchange(call.group, "forward", sends, recvs, topology=call.topology), step)
    _merge_result(results, out_acc, lse_acc)
    return out_acc.to(q.dtype), lse_acc


def _merge_result(results, out_acc, lse_acc) -> None:
    """Wait for a helper's (out, lse) for some of our rows, if one is coming, and merge it (the
    paper's rescale)."""
    if results is None:
        return
    transfer, step = results
    received = transfer.wait()
    if received:
        out_rows, lse_rows = _rows([out_acc, lse_acc], step.help_rows)
        merge_partial(out_rows, lse_rows, *received)


def distflash_backward(call: AttentionCall, dout, q, keys, out, lse):
    """Balanced backward on the forward's schedule. Returns dq, dk, dv in input dtypes."""
    k, v = keys.k, keys.v
    lse = lse_for_backward(lse)
    delta = row_delta(dout, out)
    dq, dk, dv = accumulator_zeros_like(q), accumulator_zeros_like(k), accumulator_zeros_like(v)
    call.attend_backward(dout, q, k, v, out, lse, call.tiles(call.rank, call.rank), dq, dk, dv)
    steps = schedule(call.rank, call.world, call.local_len)
    mine_q = [q, dout, delta, lse]
    pending = _post_inputs(call, steps[0], "backward", [k, v], mine_q) if steps else None
    returning = None  # (transfer, step): the previous step's partial gradients coming back to us
    for i, step in enumerate(steps):
        kv, helped = _split_received(step, pending.wait(), 2)
        if i + 1 < len(steps):
            pending = _post_inputs(call, steps[i + 1], "backward", [k, v], mine_q)
        sends, recvs = [], []
        if kv is not None:  # owner work: our dQ here, their dK, dV go back
            dk_r, dv_r = accumulator_zeros_like(k), accumulator_zeros_like(v)
            tiles = _query_tiles(call, call.rank, step.own_rows, step.kv_from, rebase=False)
            call.attend_backward(dout, q, kv[0], kv[1], out, lse, tiles, dq, dk_r, dv_r)
            sends += [(dk_r, step.kv_from, tags.DISTFLASH_RESULTS), (dv_r, step.kv_from, tags.DISTFLASH_RESULTS + 1)]
        if helped is not None:  # helper work: our dK, dV here, their dQ goes back
            q_r, dout_r, delta_r, lse_r = helped
            dq_r = accumulator_zeros_like(q_r)
            tiles = _query_tiles(call, step.help_for, step.help_rows, call.rank, rebase=True)
            call.attend_backward(dout_r, q_r, k, v, None, lse_r, tiles, dq_r, dk, dv, delta=delta_r)
            sends += [(dq_r, step.help_for, tags.DISTFLASH_RESULTS + 2)]
        if step.kv_to is not None:
            recvs += [(dk, step.kv_to, tags.DISTFLASH_RESULTS), (dv, step.kv_to, tags.DISTFLASH_RESULTS + 1)]
        if step.helped_by is not None:
            recvs += [(dq[:, step.help_rows], step.helped_by, tags.DISTFLASH_RESULTS + 2)]
        _add_returned(returning, dq, dk, dv)
        returning = (exchange(call.group, "backward", sends, recvs, topology=call.topology), step)
    _add_returned(returning, dq, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_returned(returning, dq, dk, dv) -> None:
    """Add the partial gradients that came back for a step into our float32 accumulators."""
    if returning is None:
        return
    transfer, step = returning
    received = list(transfer.wait())
    if step.kv_to is not None:
        dk += received.pop(0)
        dv += received.pop(0)
    if step.helped_by is not None:
        dq[:, step.help_rows] += received.pop(0)


def check_distflash(call: AttentionCall, q, k) -> None:
    """The schedule is for causal attention on contiguous shards only."""
    spec = call.spec
    if call.layout != "contiguous" or not spec.causal or spec.window or spec.cu_seqlens or spec.block_sparse:
        raise ValueError(
            "strategy='distflash' supports layout='contiguous' with causal=True and no window, "
            "cu_seqlens, chunk_size or block_sparse; use 'burst' or 'ring' (any layout and mask) otherwise"
        )


DISTFLASH = Strategy("distflash", forward=distflash_forward, backward=distflash_backward, check=check_distflash)
