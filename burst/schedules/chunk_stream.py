"""The owner-served chunk stream's plan (BurstAttention's backward on one node): which chunks of
whose block a rank computes at each step, and which of its own it serves.

Plans only, no process group: strategies/burst_stream.py runs them (why the stream exists, and its
memory, are said there). A step of the plan is a step of the ring schedule (schedules/ring.py): rank r
works on the block of holding(j), in the ring's order, chunk by chunk, and only the chunks the mask
needs are planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .ring import RingSchedule

# Below this per-call overheads show (kernel calls, messages); shards this short go whole. 128 since
# CPU messages go through shared memory (comm/shm_p2p.py): at 1K-row shards 128-row chunks run at
# 0.95x ring's backward with the live heap at 1.06x the ideal share (256: 0.92x, 1.14x);
# benchmarks/small_shards.md.
MIN_CHUNK_ROWS = 128
CHUNKS_PER_BLOCK = 8  # by default a block travels as 8 chunks: a rank holds ~11/8 of a block above its own


def default_chunk_rows(local_len: int, kernel_max_rows: int, kernel_min_rows: int = 0) -> int:
    """Rows per chunk: an eighth of the shard, at least MIN_CHUNK_ROWS, at most a kernel call's rows; and at
    least the kernel's own floor for the dtype (its MIN_CHUNK_ROWS_BY_DTYPE), which may be more than one call's."""
    return max(kernel_min_rows, min(kernel_max_rows, max(MIN_CHUNK_ROWS, math.ceil(local_len / CHUNKS_PER_BLOCK))))


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


def plan_stream(
    schedule: RingSchedule, local_len: int, chunk_rows: int, needs: Callable[[int, int, int, int], bool]
) -> list[StreamStep]:
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


CACHE_LIMIT = 256  # entries a plan cache keeps: a model's layers share a few, each new mask adds one


class BoundedCache:
    """Values made once per key, all dropped at once when what they hold would pass `limit`: packed
    documents bring a new mask with every batch, which would grow a plain cache without end.

    size(value): what a value counts against the limit (default 1: the limit counts entries).
    largest: a value counting more is made every time and never kept (default: no such bound).
    """

    def __init__(self, limit: int, size: Callable[[Any], int] | None = None, largest: int | None = None):
        self.limit, self.largest = limit, largest
        self._size = size or (lambda value: 1)
        self._values: dict = {}
        self._held = 0

    def get(self, key, make: Callable[[], Any]) -> Any:
        """The value under `key`, made by make() the first time."""
        if key in self._values:
            return self._values[key]
        value = make()
        size = self._size(value)
        if self.largest is not None and size > self.largest:
            return value
        if self._held + size > self.limit:
            self._values.clear()
            self._held = 0
        self._values[key] = value
        self._held += size
        return value


_PLANS = BoundedCache(CACHE_LIMIT)  # plan_stream's results by (plan_key, schedule, local_len, chunk_rows)


def cached_plan(plan_key, schedule: RingSchedule, local_len: int, chunk_rows: int, needs) -> list[StreamStep]:
    """plan_stream, once per key: every layer of a model asks for the same plan at every step, and
    planning asks `needs` up to a few thousand times. plan_key must fix what `needs` answers."""
    return _PLANS.get(
        (plan_key, schedule, local_len, chunk_rows), lambda: plan_stream(schedule, local_len, chunk_rows, needs)
    )
