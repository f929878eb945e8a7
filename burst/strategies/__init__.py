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


__all__ = ["STRATEGIES", "Strategy", "RING_VARIANTS", "split_variant"]
