"""DistFlashAttn's load-balanced causal schedule (distflashattn.md §3.2, Alg. 2): who meets whom at
each step. Plans only; strategies/distflash.py runs it (owner work, helper work, the even-world split).

Contiguous shards, causal mask, P ranks, steps t = 1..P//2. Owner work: rank p >= t attends its
queries against the K, V of rank p - t. Helper work (2t < P): rank p < t, with no block of its own
left, attends the queries of rank p + P - t against its own K, V and returns the partial result. At an
even world's last step the owner and the keys' rank each take half of the owner's query rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    """Who this rank meets at step t. None where there is nothing to do.

    own_rows: the rows of our queries that owner work covers; help_rows: the rows of the helped
    rank's queries that helper work covers (both all rows except at an even world's last step).
    """

    t: int
    kv_from: int | None  # owner work: attend our queries against this rank's K, V
    kv_to: int | None  # ... and this rank needs our K, V
    helped_by: int | None  # a helper attends our queries (against its K, V) and returns the result
    help_for: int | None  # helper work: we attend this rank's queries against our K, V
    own_rows: slice = field(default_factory=lambda: slice(None))
    help_rows: slice = field(default_factory=lambda: slice(None))


def schedule(rank: int, world: int, local_len: int) -> list[Step]:
    """Steps 1..world//2 of the balanced schedule for `rank` (step 0 is the own diagonal)."""
    steps = []
    for t in range(1, world // 2 + 1):
        owner = dict(t=t, kv_from=rank - t if rank >= t else None, kv_to=rank + t if rank + t < world else None)
        if 2 * t == world:
            # Even world, last step: the keys' rank (idle in the paper) takes the second half of
            # the owner's query rows, so both do half a block.
            half = local_len // 2
            steps.append(
                Step(
                    **owner,
                    helped_by=owner["kv_from"],
                    help_for=owner["kv_to"],
                    own_rows=slice(0, half),
                    help_rows=slice(half, local_len),
                )
            )
        else:
            helping = 2 * t < world  # helpers are needed for distances > world/2 only
            steps.append(
                Step(
                    **owner,
                    helped_by=rank + t - world if helping and rank + t >= world else None,
                    help_for=rank + world - t if helping and rank < t else None,
                )
            )
    return steps
