"""CQS-Attention's scheduling mathematics (cqs-attention.md §II-III): cyclic quorums of token groups.

W workers, the sequence cut into W token groups. An interest set I is a cyclic difference cover of
Z_W (every residue is a difference a - b of two of its elements); worker w's quorum is the token
groups w + I (mod W). Any block pair (query group x, key group y) lies in some quorum: with
y - x = a - b, worker x - b holds both. So a worker that receives its quorum's groups once can
compute its share of the pairs with no further communication, and the owners merge the partial
results (the paper's Tiler).

Distillation (Code Block 3, "self-distillation"): each block pair is given to exactly one worker
whose quorum holds it, balancing the count per worker; the diagonal pair (x, x) stays with its
owner x (0 is in I). With a causal mask the pairs above the diagonal are dropped first and the rest
balanced. Lost workers (§V-A2): their pairs go to surviving workers (to one whose quorum holds
the pair when there is one, else to the least loaded, which then fetches the extra groups);
the result stays exact.

    interest_set(7)            -> (0, 1, 3)
    schedule(W, causal=True)   -> Schedule: tasks[w] = [(query group, key group), ...]

The strategy (strategies/cqs.py) runs `schedule` (ordered pairs, balanced, causal- and
lost-worker-aware). The paper's own token-level lists (its Code Blocks 1-4, Tables 1-2) are in
schedules/cqs_paper.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

EXHAUSTIVE_UP_TO = 40  # minimum difference covers by search for W up to this; a construction beyond


def is_difference_cover(elements, w: int) -> bool:
    """True when every residue of Z_w is a difference of two of `elements`."""
    return len({(a - b) % w for a in elements for b in elements}) == w


@lru_cache(maxsize=None)
def interest_set(w: int) -> tuple[int, ...]:
    """A cyclic difference cover of Z_w containing 0 and 1, as a sorted tuple.

    Minimum size for w <= EXHAUSTIVE_UP_TO (exhaustive search with pruning; w = 7 gives (0, 1, 3),
    the Fano plane of the paper); beyond, a Wichmann ruler's marks, about sqrt(1.5 w) (within 1.25x of
    the lower bound k(k-1) + 1 >= w), found in milliseconds for w up to 10^4 and more.
    """
    if not isinstance(w, int) or w < 1:
        raise ValueError(f"the number of workers must be a positive int, got {w!r}")
    if w <= 2:
        return tuple(range(w))
    if w <= EXHAUSTIVE_UP_TO:
        return _minimum_cover(w)
    return _constructed_cover(w)


def lower_bound(w: int) -> int:
    """The smallest k with k(k - 1) + 1 >= w: no difference cover of Z_w is smaller."""
    return math.ceil((1 + math.sqrt(4 * w - 3)) / 2)


def _minimum_cover(w: int) -> tuple[int, ...]:
    """Depth-first search over increasing elements, from size lower_bound(w) up; 0 and 1 fixed
    (any cover can be shifted to hold 0, and a minimum cover of these sizes can hold 1)."""
    for k in range(lower_bound(w), w + 1):
        found = _search([0, 1], k, w, {1, w - 1, 0})
        if found:
            return tuple(found)
    raise AssertionError("unreachable: Z_w itself is a cover")


def _search(chosen: list[int], k: int, w: int, covered: set[int]):
    if len(covered) == w:
        return chosen
    left = k - len(chosen)
    # Each new element covers at most 2 * len(chosen + new ones) new differences: prune.
    if left <= 0 or len(covered) + left * (2 * len(chosen) + left - 1) < w:
        return None
    for x in range(chosen[-1] + 1, w - left + 1):
        new = {(x - c) % w for c in chosen} | {(c - x) % w for c in chosen}
        if not new - covered:
            continue
        found = _search(chosen + [x], k, w, covered | new)
        if found:
            return found
    return None


def _constructed_cover(w: int) -> tuple[int, ...]:
    """The marks of a Wichmann sparse ruler of length >= w // 2, taken mod w: every distance 0..w//2 is
    a difference of two marks, so every residue d is (d or w - d). A ruler of 4r + s + 3 marks has length
    4r(r + s + 2) + 3(s + 1); the fewest marks for the length is about sqrt(1.5 w), within 1.25x of the
    lower bound (w = 64: 10 against 9; the construction it replaced, {0..s-1} and the multiples of s,
    took 16, and CQS's bytes and memory grow with the quorum)."""
    r, s = min(((r, _fewest_fours(r, w // 2)) for r in range(math.isqrt(w) + 2)), key=lambda rs: 4 * rs[0] + rs[1])
    gaps = [1] * r + [r + 1] + [2 * r + 1] * r + [4 * r + 3] * s + [2 * r + 2] * (r + 1) + [1] * r
    marks, at = {0}, 0
    for gap in gaps:
        at += gap
        marks.add(at % w)
    cover = tuple(sorted(marks))
    assert is_difference_cover(cover, w) and cover[:2] == (0, 1)
    return cover


def _fewest_fours(r: int, length: int) -> int:
    """The smallest s whose Wichmann ruler (r, s) is at least `length` long."""
    return max(0, -(-(length - 4 * r * (r + 2) - 3) // (4 * r + 3)))


@dataclass(frozen=True)
class Schedule:
    """Who computes which block pair, and which token groups each worker receives.

    tasks[w]: (query group, key group) pairs worker w computes; q_materials[w] / kv_materials[w]:
    the groups whose queries (with dO, D, lse in the backward) / keys and values it needs; lost:
    workers given no task.
    """

    workers: int
    interest: tuple[int, ...]
    tasks: tuple[tuple[tuple[int, int], ...], ...]
    lost: tuple[int, ...] = ()

    @property
    def q_materials(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted({x for x, _ in t})) for t in self.tasks)

    @property
    def kv_materials(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted({y for _, y in t})) for t in self.tasks)

    def quorum(self, w: int) -> tuple[int, ...]:
        return tuple(sorted((w + a) % self.workers for a in self.interest))

    def load(self) -> list[int]:
        return [len(t) for t in self.tasks]


def sequence_length_ratio(w: int) -> float:
    """SLR = m_Tk / N: the share of the sequence one worker holds (its quorum's |I| groups of N/W)."""
    return len(interest_set(w)) / w


@lru_cache(maxsize=256)
def schedule(w: int, causal: bool = False, lost: tuple[int, ...] = (), needed=None) -> Schedule:
    """The distilled CQS: every needed block pair (x, y) given to exactly one worker.

    needed: optional frozenset of (x, y) pairs (default: all, or y <= x with `causal`). The owner
    computes its diagonal; other pairs go, in a fixed order, to the least loaded surviving worker
    whose quorum holds the pair (ties to the lowest rank), then move along augmenting paths until the
    largest load is the least possible (ceil(pairs / survivors) whenever the quorums allow it); every
    rank derives the same schedule.
    """
    lost = tuple(sorted(set(lost)))
    if any(not 0 <= r < w for r in lost) or len(lost) >= w:
        raise ValueError(f"lost workers {lost} must be distinct ranks of 0..{w - 1}, leaving at least one")
    interest = interest_set(w)
    alive = [r for r in range(w) if r not in lost]
    if needed is None:
        needed = frozenset((x, y) for x in range(w) for y in range(w) if not causal or y <= x)
    holders = {d: sorted({(-b) % w for a in interest for b in interest if (a - b) % w == d}) for d in range(w)}
    tasks: list[list[tuple[int, int]]] = [[] for _ in range(w)]

    def candidates(pair):  # surviving workers whose quorum holds both groups (any survivor if none)
        x, y = pair
        if x == y and x not in lost:
            return [x]  # the owner computes its diagonal
        held = [(x + h) % w for h in holders[(y - x) % w]]
        return [c for c in held if c not in lost] or alive

    # Most constrained pairs first (the owners' diagonals, then pairs with one possible worker), each
    # to its least loaded candidate: a fixed order, so every rank derives the same schedule.
    options = {p: candidates(p) for p in needed}
    for pair in sorted(needed, key=lambda p: (len(options[p]), p)):
        best = min(options[pair], key=lambda c: (len(tasks[c]), c))
        tasks[best].append(pair)
    # Greedy leaves the straggler a pair or two above the least possible; move pairs along augmenting
    # paths (worker -> another holder of one of its pairs -> ...) down to the optimum min-max load.
    target = -(-len(needed) // len(alive))
    while not _rebalance(tasks, options, target):
        target += 1
    return Schedule(w, interest, tuple(tuple(sorted(t)) for t in tasks), lost)


def _rebalance(tasks: list, options: dict, target: int) -> bool:
    """Move pairs until no worker holds more than `target`; False when that is impossible (some
    overloaded worker reaches, through workers that could take its pairs, none below `target`: then
    those workers' pairs cannot fit in `target` each). Deterministic: same moves on every rank."""
    while True:
        over = [r for r in range(len(tasks)) if len(tasks[r]) > target]
        if not over:
            return True
        start = over[0]
        came_from = {start: None}  # worker -> (previous worker, pair moved from it)
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for r in frontier:
                for pair in sorted(tasks[r]):
                    for c in options[pair]:
                        if c in came_from:
                            continue
                        came_from[c] = (r, pair)
                        if len(tasks[c]) < target:
                            found = c
                            break
                        nxt.append(c)
                    if found is not None:
                        break
                if found is not None:
                    break
            frontier = nxt
        if found is None:
            return False
        c = found
        while came_from[c] is not None:
            r, pair = came_from[c]
            tasks[r].remove(pair)
            tasks[c].append(pair)
            c = r
