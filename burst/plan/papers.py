"""The papers' own cost formulas, kept verbatim so the model in cost.py can be tested against them.

- ring-attention.md §3, Table 2: a ring hides its transfers when the block (tokens per device) is
  at least c = F / B (FLOP/s over bytes/s: 4dc² FLOPs against 4cd bytes per step), and the sequence
  must be at least 6c.
- burstattention.md Table 1: per-device communication of one layer, forward 2BZNd, backward
  3BZNd + 2BZN (BurstAttention) against 6BZNd (RingAttention as that paper implements it) and
  4BZNd both ways for tensor parallelism.
- burstengine.md Table 1: communication time of RingAttention, DoubleRing and BurstAttention with
  T = Lat + P/B per link.
"""

from __future__ import annotations


def min_block_size(flops: float, bandwidth: float) -> float:
    """ring-attention.md: tokens per device for which compute hides the ring's transfer."""
    return flops / bandwidth


def min_sequence_length(flops: float, bandwidth: float) -> float:
    return 6 * min_block_size(flops, bandwidth)


# ring-attention.md Table 2: hardware -> (TFLOP/s, GB/s, min block size, min sequence length), as printed.
RING_ATTENTION_TABLE2 = {
    "A100 NVLink": (312, 300, 1.0e3, 6.2e3),
    "A100 InfiniBand": (312, 12.5, 24.5e3, 149.5e3),
    "TPU v3": (123, 112, 1.1e3, 6.6e3),
    "TPU v4": (275, 268, 1.0e3, 6.2e3),
    "TPU v5e": (196, 186, 1.1e3, 6.3e3),
}


def burstattention_volumes(B: int, Z: int, N: int, d: int) -> dict:
    """burstattention.md Table 1, elements communicated (forward, backward) per layer."""
    return {
        "BurstAttention": (2 * B * Z * N * d, 3 * B * Z * N * d + 2 * B * Z * N),
        "RingAttention": (2 * B * Z * N * d, 6 * B * Z * N * d),
        "TensorParallelism": (4 * B * Z * N * d, 4 * B * Z * N * d),
    }


def burstengine_comm_time(G: int, n_inter: int, t_intra: float, t_inter: float) -> dict:
    """burstengine.md Table 1 (N there is the ring length G; n_inter the number of nodes)."""
    return {
        "RingAttention": 6 * max(G * t_intra, G * t_inter),
        "DoubleRing": 4 * max((G - n_inter) * t_intra, n_inter * t_inter)
        + 2 * ((G - n_inter) * t_intra + n_inter * t_inter),
        "BurstAttention": 5 * max((G - n_inter) * t_intra, n_inter * t_inter),
    }
