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

__all__ = ["STRATEGIES", "Strategy"]
