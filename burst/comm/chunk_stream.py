"""The owner-served chunk stream: a ring's block pairs, in its order, holding a few chunks instead of
two blocks.

A ring (double_ring.py) forwards each block from rank to rank, so a rank holds two whole travelling
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
node's switch (NVLink/NVSwitch, PCIe switch, a TCP host). Across nodes the double ring stays.

Every rank issues the same sequence of exchanges: labels (step, slot), each step with as many slots
as a shard has chunks (one where every rank is on its own block), and per label first the next
chunk's exchange, then the finished chunk's accumulators. Two ranks' matching ops sit at the same
label on both, so backends that match in issue order (NCCL) pair them right and no two ranks wait
on each other in a cycle; gloo matches by tag, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .double_ring import RingSchedule
from .p2p import Transfer, exchange

# Message tags, apart from double_ring's (0..23): chunk tensors 24.., accumulator chunks 32..
CHUNK_TAG, ACC_TAG = 24, 32
MIN_CHUNK_ROWS = 256  # below this per-call overheads show (kernel calls, messages); shards this short go whole
CHUNKS_PER_BLOCK = 8  # by default a block travels as 8 chunks: a rank holds ~11/8 of a block above its own


def default_chunk_rows(local_len: int, kernel_max_rows: int) -> int:
    """Rows per chunk: an eighth of the shard, at least MIN_CHUNK_ROWS, at most a kernel call's rows."""
    return min(kernel_max_rows, max(MIN_CHUNK_ROWS, math.ceil(local_len / CHUNKS_PER_BLOCK)))


def row_chunks(local_len: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most chunk_rows rows, as equal as can be, covering the shard."""
    count = math.ceil(local_len / chunk_rows)
    bounds = [round(i * local_len / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class StreamStep:
    """One step of the stream on this rank: whose chunks it computes and whom it serves.

    src: the rank whose chunks this rank computes (chunks_in, in order); peer: the rank computing
    this rank's chunks (chunks_out). slots: the same on every rank at a step.
    """

    src: int
    peer: int
    chunks_in: tuple[tuple[int, int], ...]
    chunks_out: tuple[tuple[int, int], ...]
    slots: int


def plan_stream(schedule: RingSchedule, local_len: int, chunk_rows: int,
                needs: Callable[[int, int, int, int], bool]) -> list[StreamStep]:
    """The steps of a flat schedule, with the chunks this rank receives and serves.

    needs(src, dst, start, stop): does rank dst compute anything with rows [start, stop) of src's
    block? It must give the same answer on every rank (it decides what is sent and received).

    Every step where blocks move has as many slots as a shard has chunks (the step where each rank
    works on its own block, one slot and one chunk), and every pair fills them all when it can:
    its needed rows (found in quarter chunks) are cut into that many chunks, smaller where a pair
    needs fewer rows (zigzag: half the queries against all the keys on one side, all the queries
    against half the keys on the other). Slots then carry equal work on every rank, and no rank
    waits on a sender that paces slower.
    """
    if schedule.nodes != 1:
        raise ValueError("the chunk stream runs on one flat ring; several nodes take the double ring")
    slots = len(row_chunks(local_len, chunk_rows))
    fine = row_chunks(local_len, max(1, math.ceil(chunk_rows / 4)))

    def chunks(src, dst, groups):
        return _grouped(_needed(fine, lambda a, b: needs(src, dst, a, b)), groups)

    steps = []
    for _, j in schedule.steps:
        src, peer = schedule.holding(0, j), schedule.holder_of_mine(0, j)
        # Every rank on its own block (step 0): nothing moves, so one slot and one chunk.
        n = 1 if src == peer == schedule.rank else slots
        steps.append(StreamStep(src, peer, chunks(src, schedule.rank, n), chunks(schedule.rank, peer, n), n))
    return steps


def _needed(parts: list[tuple[int, int]], needs: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """The parts for which needs(start, stop) holds, asking about whole runs of parts first: a run
    nothing of which is needed is dropped in one question (masks leave long runs of either kind)."""
    if not parts or not needs(parts[0][0], parts[-1][1]):
        return []
    if len(parts) == 1:
        return list(parts)
    half = len(parts) // 2
    return _needed(parts[:half], needs) + _needed(parts[half:], needs)


def _grouped(parts: list[tuple[int, int]], groups: int) -> tuple[tuple[int, int], ...]:
    """Consecutive parts in at most `groups` chunks, each spanning its first part's start to its last's stop."""
    groups = min(groups, len(parts))
    if groups == 0:
        return ()
    bounds = [round(i * len(parts) / groups) for i in range(groups + 1)]
    return tuple((parts[lo][0], parts[hi - 1][1]) for lo, hi in zip(bounds[:-1], bounds[1:]))


_PLANS: dict = {}  # plan_stream's results by (plan_key, schedule, local_len, chunk_rows)


def cached_plan(plan_key, schedule: RingSchedule, local_len: int, chunk_rows: int, needs) -> list[StreamStep]:
    """plan_stream, once per key: every layer of a model asks for the same plan at every step, and
    planning asks `needs` up to a few thousand times. plan_key must fix what `needs` answers."""
    key = (plan_key, schedule, local_len, chunk_rows)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        plan = _PLANS[key] = plan_stream(schedule, local_len, chunk_rows, needs)
    return plan


def stream_chunks(call, schedule: RingSchedule, phase: str, block: Sequence[torch.Tensor],
                  row_dims: Sequence[int], chunk_rows: int, needs: Callable, compute: Callable,
                  acc_likes: Sequence[torch.Tensor], plan_key=None) -> list[torch.Tensor]:
    """Run `compute(src, (start, stop), held, accs)` for every chunk this rank works on.

    block: this rank's tensors that are served, each cut along its dim in row_dims. held: rows
    [start, stop) of rank src's block. accs: float32 accumulators for those rows, shaped like rows of
    acc_likes (cut along the same dims as the block tensors of the same index), to add into; they go
    home to src. Returns this rank's float32 accumulators, zeros plus every contribution.
    plan_key: when given, the plan is cached under it (see cached_plan).
    """
    from ..block import accumulator_zeros_like

    me = schedule.rank
    homes = [accumulator_zeros_like(t) for t in acc_likes]
    acc_dims = list(row_dims[: len(homes)])
    steps = (plan_stream(schedule, call.local_len, chunk_rows, needs) if plan_key is None
             else cached_plan(plan_key, schedule, call.local_len, chunk_rows, needs))
    labels = [(step, slot) for step in steps for slot in range(step.slots)]

    def rows_of(tensors, dims, chunk):
        return [t.narrow(d, chunk[0], chunk[1] - chunk[0]) for t, d in zip(tensors, dims)]

    def post_chunk(label) -> Transfer | None:
        step, slot = label
        sends = recvs = ()
        if step.peer != me and slot < len(step.chunks_out):
            sends = [(t, step.peer, CHUNK_TAG + i) for i, t in enumerate(rows_of(block, row_dims, step.chunks_out[slot]))]
        if step.src != me and slot < len(step.chunks_in):
            recvs = [(t, step.src, CHUNK_TAG + i) for i, t in enumerate(rows_of(block, row_dims, step.chunks_in[slot]))]
        return exchange(call.group, phase, sends, recvs, topology=call.topology) if sends or recvs else None

    def post_accs(label, built) -> tuple[Transfer, tuple[int, int]] | None:
        step, slot = label
        sends = [(t, step.src, ACC_TAG + i) for i, t in enumerate(built)] if built is not None else ()
        recvs, chunk = (), None
        if step.peer != me and slot < len(step.chunks_out):
            chunk = step.chunks_out[slot]
            recvs = [(t, step.peer, ACC_TAG + i) for i, t in enumerate(rows_of(homes, acc_dims, chunk))]
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
