"""What each ring strategy moves per block, for the cost model (cost.py's _ring_family): one entry per
strategy in RING_BLOCKS, so the ring pass is costed once for both.

burst (strategies/burst.py) moves the side of its backward that puts fewer bytes on the wire, by its
own rule (row_bytes, smaller_side), MLA's latent on the key side, and on one node serves chunks
(strategies/burst_stream.py); ring (strategies/ring.py) moves K, V both ways, whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..strategies.burst import row_bytes, smaller_side
from .latent import expansion_flops


@dataclass(frozen=True)
class RingBlocks:
    """Bytes of one block of n = N/G rows (cost._Sizes) on a ring strategy's passes.

    forward: the forward's travelling block; side: what the backward moves ("queries", "keys" or
    "keys (the latent)"); moving: its travelling block; acc: the float32 accumulators going home;
    streamed: one node's chunk stream (a few chunks held, only the rows a window needs served);
    expansion: (forward, backward) FLOPs per device and layer added by expanding MLA's latent; note:
    what the estimate says of the backward."""

    forward: float
    side: str
    moving: float
    acc: float
    streamed: bool = False
    expansion: tuple[float, float] = (0.0, 0.0)
    note: str = ""


def burst_blocks(w, s, one_node: bool) -> RingBlocks:
    """burst's ring for workload w (cost.Workload) with block sizes s: the latent for MLA, else the
    side strategies/burst.py's backward_side picks for these shapes."""
    if w.latent is not None:  # burst/latent.py: the latent travels on the key side, forward and backward
        numbers, side = w.batch * s.n * w.latent.numbers, "keys (the latent)"
        block = numbers * s.dtype_bytes
        return RingBlocks(block, side, block, numbers * 4, one_node, expansion_flops(w), f"backward moves the {side}")
    key_numbers = w.kv * w.head_dim
    side = smaller_side(
        row_bytes(
            heads=w.heads,
            head_dim=w.head_dim,
            q_bytes=s.dtype_bytes,
            dout_bytes=s.dtype_bytes,
            keys=[(key_numbers, s.dtype_bytes)] * 2,
        )
    )
    moving, acc = (s.kv, s.dkv32) if side == "keys" else (2 * s.q + 2 * s.stat, s.dq32)
    return RingBlocks(s.kv, side, moving, acc, one_node, note=f"backward moves the {side}")


def ring_blocks(w, s, one_node: bool) -> RingBlocks:
    """RingAttention's: K, V in both passes, dK, dV (float32) going home, whole blocks."""
    return RingBlocks(s.kv, "keys", s.kv, s.dkv32)


RING_BLOCKS = {"burst": burst_blocks, "ring": ring_blocks}
