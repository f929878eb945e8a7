"""Emulated slow links: make one machine behave like nodes joined by a slower network.

Set BURST_EMULATE_INTER_GBPS (and/or BURST_EMULATE_INTRA_GBPS) to a bandwidth in GB/s, and give the
call a burst.Topology: every transfer then takes at least latency + bytes / bandwidth of the link it
crosses, measured from when it was posted, and a link carries one transfer at a time (messages on
it queue). Both ends apply the delay, so a receiver waits as it would for the real link. Compute
still overlaps the emulated transfer exactly as it would a real one. `burst bench --inter-node-gbps`
sets these for its ranks; every output it writes says "emulated". Nothing is delayed when unset.
"""

from __future__ import annotations

import os
import time

_busy_until: dict[str, float] = {}


def bandwidth(link: str | None) -> float | None:
    """Bytes/s of the emulated `link` ("intra" / "inter"), or None when it is not emulated."""
    if link is None:
        return None
    value = os.environ.get(f"BURST_EMULATE_{link.upper()}_GBPS")
    return float(value) * 1e9 if value else None


def latency() -> float:
    return float(os.environ.get("BURST_EMULATE_LATENCY_US", "0")) * 1e-6


def active() -> bool:
    return bool(os.environ.get("BURST_EMULATE_INTER_GBPS") or os.environ.get("BURST_EMULATE_INTRA_GBPS"))


def reserve(link: str | None, nbytes: int, posted: float, direction: str = "out") -> float:
    """The time the transfer of `nbytes` posted at `posted` on `link` ends (0 when not emulated);
    that direction of the link (links are full duplex) is busy until then."""
    bw = bandwidth(link)
    if bw is None or nbytes == 0:
        return 0.0
    key = f"{link}:{direction}"
    start = max(posted, _busy_until.get(key, 0.0))
    end = start + latency() + nbytes / bw
    _busy_until[key] = end
    return end


def wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
