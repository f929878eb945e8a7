"""CommStats: what this rank sent and computed, by phase.

Strategies report every point-to-point or collective send through `record_sent` and every block of
attention they compute through `record_pairs`; an active `CommStats` context collects them. Nothing
is recorded (and nothing costs) when no context is active.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

_ACTIVE: list["CommStats"] = []


class CommStats:
    """Bytes this rank sent and (query, key) pairs it computed, by phase.

    Phases are "forward" and "backward". Bytes count each tensor this rank handed to the network once
    per destination (a ring hop, or one share of a collective). Pairs count the (query, key) pairs
    that the mask lets attend and that this rank's kernels computed, for all heads (a rank that computes
    some heads' pairs, Ulysses', counts that share: head_share); a skipped block counts 0.

    Example::

        with burst.CommStats() as stats:
            out = burst.attention(q, k, v)
            out.sum().backward()
        stats.sent("forward"), stats.sent("backward"), stats.pairs("forward")
    """

    def __init__(self) -> None:
        self._sent: dict[str, int] = defaultdict(int)
        self._sent_by_link: dict[tuple[str, str], int] = defaultdict(int)
        self._pairs: dict[str, int] = defaultdict(int)
        self._messages: dict[str, int] = defaultdict(int)
        self._compute: dict[str, float] = defaultdict(float)
        self._dense_masks = 0
        self._choices: dict[str, int] = defaultdict(int)

    def __enter__(self) -> "CommStats":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def sent(self, phase: str | None = None, link: str | None = None) -> int:
        """Bytes sent in `phase` (all phases when None), over `link`: "intra" (to a rank on this
        node), "inter" (to another node, by the call's burst.Topology) or None (both)."""
        if link is None:
            return _total(self._sent, phase)
        if link not in ("intra", "inter"):
            raise ValueError(f"link must be 'intra', 'inter' or None, got {link!r}")
        return sum(n for (p, l), n in self._sent_by_link.items() if l == link and (phase is None or p == phase))

    def messages(self, phase: str | None = None) -> int:
        """Number of tensors sent in `phase` (all phases when None)."""
        return _total(self._messages, phase)

    def pairs(self, phase: str | None = None) -> int:
        """(query, key) pairs computed in `phase` (all phases when None)."""
        return _total(self._pairs, phase)

    def compute_seconds(self, phase: str | None = None) -> float:
        """Wall seconds this rank spent inside attention kernels in `phase` (host time: on CUDA it
        measures launches unless the caller synchronizes)."""
        return _total(self._compute, phase)

    def dense_masks(self) -> int:
        """Kernel calls that took a dense additive mask (a bias the size of the tile): the last resort
        for masks that no kernel takes as arguments (block-sparse, runs of unequal strides), or every
        masked tile on a backend without band arguments (the CPU one, aten's efficient kernel)."""
        return self._dense_masks

    def choices(self) -> dict[str, int]:
        """How often each choice a strategy made per call was taken, as "what=choice": count (burst's
        backward: "backward_side=queries" or "backward_side=keys"; MLA's latent on the key side: "keys=latent")."""
        return dict(self._choices)

    def as_dict(self) -> dict:
        return {
            "sent": dict(self._sent),
            "messages": dict(self._messages),
            "pairs": dict(self._pairs),
            "compute_seconds": dict(self._compute),
            "dense_masks": self._dense_masks,
            "choices": dict(self._choices),
        }

    def __repr__(self) -> str:
        return f"CommStats(sent={dict(self._sent)}, pairs={dict(self._pairs)})"


def _total(table: dict[str, int], phase: str | None) -> int:
    return sum(table.values()) if phase is None else table.get(phase, 0)


def record_sent(phase: str, nbytes: int, messages: int = 1, link: str | None = "intra") -> None:
    """Count bytes this rank sent; `link` classifies them ("intra" when no topology says otherwise)."""
    for stats in _ACTIVE:
        stats._sent[phase] += nbytes
        stats._messages[phase] += messages
        stats._sent_by_link[(phase, link or "intra")] += nbytes


def record_pairs(phase: str, pairs: int) -> None:
    for computed, heads in _HEAD_SHARES:
        pairs = pairs * computed // heads
    for stats in _ACTIVE:
        stats._pairs[phase] += pairs


_HEAD_SHARES: list[tuple[int, int]] = []


@contextlib.contextmanager
def head_share(computed: int, heads: int):
    """Pairs recorded inside count `computed`/`heads` of a pair each: Ulysses (and USP's ring) compute the pairs
    of the whole sequence for their own heads only, and a pair counts for all heads, so that every strategy's
    pairs add up to the mask's over the ranks (burst bench's useful FLOPs)."""
    _HEAD_SHARES.append((computed, heads))
    try:
        yield
    finally:
        _HEAD_SHARES.pop()


def record_compute(phase: str, seconds: float) -> None:
    for stats in _ACTIVE:
        stats._compute[phase] += seconds


def record_choice(what: str, choice: str) -> None:
    """A choice a strategy made for one call (see CommStats.choices)."""
    for stats in _ACTIVE:
        stats._choices[f"{what}={choice}"] += 1


def record_dense_mask() -> None:
    for stats in _ACTIVE:
        stats._dense_masks += 1


def active() -> bool:
    """True when some CommStats is collecting (strategies skip bookkeeping otherwise)."""
    return bool(_ACTIVE)


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()
