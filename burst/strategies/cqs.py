"""CQS-Attention (cqs-attention.md): quorum-scheduled attention with no talk during compute.

Each rank owns its shard (its token group) and is also a worker. The distilled schedule (schedules/cqs.py)
gives every block pair the mask needs to exactly one worker whose cyclic quorum holds both groups.
Forward, in three phases:

1. one exchange: every owner sends its queries and its keys/values to the workers that need them;
2. each worker computes its block pairs, with no communication at all;
3. one exchange: partial (out, lse) go back to the query groups' owners, which merge them in
   float32, in worker order (the paper's Tiler, without a central node).

Backward (beyond the paper): the same three phases with Q, dO, D, lse and K, V as materials; each
worker recomputes its pairs with the global lse and returns partial dQ, dK, dV (float32) to the
owners, which add them up.

Option `lost_workers=(r, ...)`: those ranks compute nothing (a failed or withdrawn accelerator whose
data is still reachable); their pairs go to surviving workers and the result stays exact.
Bytes per rank: what the schedule's material lists say (about |I| - 1 ~ sqrt(G) groups in, and the
partial results back), against G - 1 blocks per pass for the ring: fewer from G = 7 on. The price is
memory: a worker holds its quorum's groups (and in the backward their Q, dO, D, lse and float32 partial
dQ, dK, dV) at once, 2-3x the ring's live heap per rank at G = 4..8 (benchmarks/cqs.md). The schedule
gives the straggler the least possible number of block pairs (ceil(pairs / workers)).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..call import AttentionCall
from ..comm import exchange, tagged, tags
from ..kernels.accumulators import accumulator_zeros_like, empty_accumulators, lse_for_backward, row_delta
from ..masks import may_attend
from ..merge import merge_partial
from ..schedules.cqs import Schedule, schedule
from .base import Options, Strategy


@dataclass(frozen=True)
class CQSOptions(Options):
    """lost_workers: ranks that compute nothing (their pairs go to survivors), kept sorted and distinct."""

    lost_workers: tuple[int, ...] = ()

    def __post_init__(self):
        lost = () if self.lost_workers is None else self.lost_workers
        # a list, tuple or set: a generator would be used up by the check below and the ranks dropped
        sequence = isinstance(lost, (list, tuple, set, frozenset))
        if not sequence or not all(isinstance(r, int) and not isinstance(r, bool) for r in lost):
            raise ValueError(f"lost_workers={lost!r} must be a sequence of ranks (a list, tuple or set of ints)")
        if len(set(lost)) != len(lost):  # (1, 1): a typo for (1, 2) would lose one worker, not two
            raise ValueError(f"lost_workers={lost!r} names a rank twice: give each lost rank once")
        object.__setattr__(self, "lost_workers", tuple(sorted(set(lost))))


def check_cqs(call: AttentionCall, q, k) -> None:
    lost = call.options.lost_workers
    if any(not 0 <= r < call.world for r in lost) or len(lost) >= call.world:
        raise ValueError(
            f"lost_workers={lost!r} must be distinct ranks of 0..{call.world - 1}, leaving at least one worker"
        )


def call_schedule(call: AttentionCall) -> Schedule:
    """The distilled schedule for this call's mask (pairs the mask skips are never given out)."""
    needed = frozenset(
        (x, y)
        for x in range(call.world)
        for y in range(call.world)
        if may_attend(call.segments(x), call.segments(y), call.spec)
    )
    return schedule(call.world, lost=call.options.lost_workers, needed=needed)


def _fetch(call: AttentionCall, sched: Schedule, phase: str, q_side: list, kv_side: list):
    """One exchange: every owner sends its materials to the workers that need them.

    Returns ({query group: its q_side tensors}, {key group: its kv_side tensors}) for this worker.
    """
    me = call.rank
    sends, recvs = [], []
    for w in range(call.world):
        if w == me:
            continue
        if me in sched.q_materials[w]:
            sends += tagged(q_side, w, tags.CQS_QUERIES)
        if me in sched.kv_materials[w]:
            sends += tagged(kv_side, w, tags.CQS_KV)
    q_from = [x for x in sched.q_materials[me] if x != me]
    kv_from = [y for y in sched.kv_materials[me] if y != me]
    recvs += [r for x in q_from for r in tagged(q_side, x, tags.CQS_QUERIES)]
    recvs += [r for y in kv_from for r in tagged(kv_side, y, tags.CQS_KV)]
    got = iter(exchange(call.group, phase, sends, recvs, topology=call.topology).wait())
    q_groups = {x: [next(got) for _ in q_side] for x in q_from}
    kv_groups = {y: [next(got) for _ in kv_side] for y in kv_from}
    q_groups[me], kv_groups[me] = list(q_side), list(kv_side)
    return q_groups, kv_groups


def _return_partials(
    call: AttentionCall,
    sched: Schedule,
    phase: str,
    mine_by_group: dict,
    likes: list,
    role: int,
    tag: int = tags.CQS_RESULTS,
):
    """One exchange: send each owner its partial results; return those sent to us, in worker order.

    mine_by_group: {group: [tensors]} computed here (our own group included, kept). role: 0 for the
    query side (results for query groups), 1 for the key side.
    """
    me = call.rank
    sends = [s for g, parts in mine_by_group.items() if g != me for s in tagged(parts, g, tag)]
    senders = [w for w in range(call.world) if w != me and any(p[role] == me for p in sched.tasks[w])]
    recvs = [r for w in senders for r in tagged(likes, w, tag)]
    got = iter(exchange(call.group, phase, sends, recvs, topology=call.topology).wait())
    return [[next(got) for _ in likes] for _ in senders]


def worker_forward(call: AttentionCall, tasks, q_groups: dict, kv_groups: dict) -> dict:
    """One worker's block pairs: {query group: (out_acc, lse_acc)} float32 partial results.

    q_groups / kv_groups: {group: [q]} / {group: [k, v]} of the groups the tasks use. Shared by the
    distributed forward and the one-process simulation (bench/cqs_sim.py), so both run one plan.
    """
    partial = {}
    for x, y in tasks:
        if x not in partial:
            partial[x] = empty_accumulators(q_groups[x][0])
        call.attend_forward(q_groups[x][0], *kv_groups[y], call.tiles(x, y), *partial[x])
    return partial


def cqs_forward(call: AttentionCall, q, keys):
    k, v = keys.k, keys.v
    sched = call_schedule(call)
    q_groups, kv_groups = _fetch(call, sched, "forward", [q], [k, v])
    partial = worker_forward(call, sched.tasks[call.rank], q_groups, kv_groups)  # no communication in here
    out_acc, lse_acc = partial.pop(call.rank, None) or empty_accumulators(q)
    arrived = _return_partials(
        call, sched, "forward", {x: list(p) for x, p in partial.items()}, [out_acc, lse_acc], role=0
    )
    for out_w, lse_w in arrived:  # the Tiler: merge where the rows live
        merge_partial(out_acc, lse_acc, out_w, lse_w)
    return out_acc.to(q.dtype), lse_acc


def cqs_backward(call: AttentionCall, dout, q, keys, out, lse):
    k, v = keys.k, keys.v
    sched = call_schedule(call)
    delta = row_delta(dout, out)
    q_groups, kv_groups = _fetch(call, sched, "backward", [q, dout, delta, lse_for_backward(lse)], [k, v])
    dq_parts, dkv_parts = {}, {}
    for x, y in sched.tasks[call.rank]:
        if x not in dq_parts:
            dq_parts[x] = [accumulator_zeros_like(q)]
        if y not in dkv_parts:
            dkv_parts[y] = [accumulator_zeros_like(k), accumulator_zeros_like(v)]
        q_x, dout_x, delta_x, lse_x = q_groups[x]
        call.attend_backward(
            dout_x, q_x, *kv_groups[y], None, lse_x, call.tiles(x, y), dq_parts[x][0], *dkv_parts[y], delta=delta_x
        )
    (dq,) = dq_parts.pop(call.rank, None) or [accumulator_zeros_like(q)]
    dk, dv = dkv_parts.pop(call.rank, None) or [accumulator_zeros_like(k), accumulator_zeros_like(v)]
    for (part,) in _return_partials(call, sched, "backward", dq_parts, [dq], role=0):
        dq += part
    for part_k, part_v in _return_partials(
        call, sched, "backward", dkv_parts, [dk, dv], role=1, tag=tags.CQS_KV_RESULTS
    ):
        dk += part_k
        dv += part_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CQS = Strategy("cqs", forward=cqs_forward, backward=cqs_backward, options=CQSOptions, check=check_cqs)
