"""CQS-Attention's own lists, as the paper writes them (cqs-attention.md §III, Code Blocks 1-4).

self_distillation gives each worker unordered token-group pairs (the paper's Table 1); the token-level
lists (tg_tk_map, distilled_cqs, material_lists, task_list, ban_list) and slr(N, W) = m_Tk / N
reproduce the m_Tk column of its Table 2 (N = 10K..49K, W = 4, 7, 8, 31). They check our reading of
the paper (tests/test_cqs.py); the strategy runs schedules/cqs.py's `schedule` (ordered pairs,
balanced, causal- and lost-worker-aware) instead.
"""

from __future__ import annotations

from .cqs import interest_set


def self_distillation(w: int) -> list[list[tuple[int, int]]]:
    """The paper's self-distillation (cqs-attention.md §III-B2, Table 1): each worker's share of the
    unordered token-group pairs (x < y), which it computes in both directions.

    Worker w's quorum lists w + I[0], w + I[1], ...; of its position pairs (i < j), it keeps, for
    each difference class ±(I[j] - I[i]), only the first in lexicographic order, and for the class
    that is its own negative (W/2), only when the lower position holds the smaller group. Every
    unordered pair then belongs to exactly one worker, with no communication to decide it.
    For W = 4: [(0, 1), (0, 2)], [(1, 2), (1, 3)], [(2, 3)], [(0, 3)], as the paper's Table 1.
    """
    interest = interest_set(w)
    canonical: dict[int, tuple[int, int]] = {}
    for i in range(len(interest)):
        for j in range(i + 1, len(interest)):
            d = (interest[j] - interest[i]) % w
            canonical.setdefault(min(d, w - d), (i, j))
    lists = []
    for worker in range(w):
        quorum = [(worker + a) % w for a in interest]
        mine = []
        for c, (i, j) in sorted(canonical.items(), key=lambda item: item[1]):
            x, y = quorum[i], quorum[j]
            if x == y or (2 * c == w and x > y):
                continue
            mine.append((min(x, y), max(x, y)))
        lists.append(mine)
    return lists


# The paper's token-level lists (cqs-attention.md §III-A, Code Blocks 1-4): TG-Tk map, Distilled-CQS,
# material lists, task and ban lists, SLR = m_Tk / N. Token indices are global (0..N-1); pairs are
# (query token, key token) cells of P.


def tg_tk_map(n: int, w: int) -> list[list[int]]:
    """Token group -> token indices: N = kW + r, the first W - r groups get k tokens, the last r get k + 1."""
    if n < w:
        raise ValueError(f"need at least one token per worker: N={n} < W={w}")
    k, r = divmod(n, w)
    sizes = [k] * (w - r) + [k + 1] * r
    starts = [sum(sizes[:g]) for g in range(w)]
    return [list(range(s, s + size)) for s, size in zip(starts, sizes)]


def distilled_cqs(w: int) -> list[list[int]]:
    """Each worker's token groups after self-distillation: its own group (it computes the diagonal
    pair) and the groups of its distilled pairs, sorted. For W = 4: [0,1,2], [1,2,3], [2,3], [0,3]."""
    return [sorted({i} | {g for pair in pairs for g in pair}) for i, pairs in enumerate(self_distillation(w))]


def material_lists(n: int, w: int) -> list[list[int]]:
    """MtrlL_i: the tokens worker i receives (R.r.1 applied to its Distilled-CQS)."""
    groups = tg_tk_map(n, w)
    return [[t for g in quorum for t in groups[g]] for quorum in distilled_cqs(w)]


def task_list(n: int, w: int, worker: int) -> list[tuple[int, int]]:
    """TL_i (Code Block 4): the cells of P worker i computes: its diagonal block and both directions
    of each distilled pair (R.r.2)."""
    groups = tg_tk_map(n, w)
    own = groups[worker]
    cells = [(a, b) for a in own for b in own]
    for x, y in self_distillation(w)[worker]:
        cells += [(a, b) for a in groups[x] for b in groups[y]] + [(b, a) for a in groups[x] for b in groups[y]]
    return cells


def ban_list(n: int, w: int, worker: int) -> list[tuple[int, int]]:
    """BL_i: cells among worker i's material tokens that it must mask (another worker owns them)."""
    mine = set(task_list(n, w, worker))
    tokens = material_lists(n, w)[worker]
    return [(a, b) for a in tokens for b in tokens if (a, b) not in mine]


def max_subsequence_length(n: int, w: int) -> int:
    """m_Tk: the longest material list (the straggler's subsequence)."""
    return max(len(m) for m in material_lists(n, w))


def slr(n: int, w: int) -> float:
    """SLR = m_Tk / N (Fig. 7): the share of the sequence the straggler holds."""
    return max_subsequence_length(n, w) / n
