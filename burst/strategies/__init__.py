"""One file per strategy; each defines its forward and backward loops and a `Strategy`."""

from .allgather import ALLGATHER
from .base import Strategy
from .burst import BURST
from .cqs import CQS
from .distflash import DISTFLASH
from .ring import RING
from .ulysses import ULYSSES
from .usp import USP

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (BURST, RING, ALLGATHER, DISTFLASH, ULYSSES, USP, CQS)}

RING_VARIANTS = ("flat",)  # burst and ring on the flat ring of a multi-node topology (default: the double ring)


def split_variant(name: str) -> tuple[str, str]:
    """("burst", "flat") for "burst:flat", ("burst", "") for "burst": the one spelling of a strategy's
    variant, in `burst bench --strategies` and the planner's strategy names (burst.plan, `burst plan`).
    Only burst and ring have one, ":flat": on several nodes they run the topology-aware double ring
    (burstengine.md §3.1) unless told to keep the flat ring."""
    base, colon, variant = name.partition(":")
    if colon and (variant not in RING_VARIANTS or base not in ("burst", "ring")):
        raise ValueError(
            f"unknown strategy {name!r}: burst:flat and ring:flat keep the flat ring across nodes, "
            "no other strategy has a variant"
        )
    return base, variant


def check_options(entry: str, strategy: str, options: dict) -> None:
    """ValueError naming `entry`, before any collective, for strategy options (chunk_rows=, ulysses_degree=...)
    that `strategy` does not take or whose values it refuses; for "auto", options that no strategy takes, or
    whose values every strategy taking them refuses."""
    candidates = [STRATEGIES[strategy]] if strategy != "auto" else [s for s in STRATEGIES.values() if s.takes(options)]
    if not candidates:
        raise ValueError(f"{entry}: no strategy takes the options {sorted(options)}")
    refusals = []
    for candidate in candidates:
        try:
            candidate.parse_options(options)
            return
        except ValueError as err:
            refusals.append(err)
    raise ValueError(f"{entry}: {refusals[0]}")


__all__ = ["STRATEGIES", "Strategy", "RING_VARIANTS", "check_options", "split_variant"]
