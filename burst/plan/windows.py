"""Sliding windows in the cost model: a causal layer whose queries see only their last `window` keys
(Mistral, gpt-oss's and Gemma's sliding layers, DeepSeek-V4's every layer).

Four things change against full causal attention, all from the window alone:

- the work: each query attends min(i + 1, window) keys, N·W − W(W − 1)/2 pairs for W < N;
- the balance: with contiguous shards a window no longer than a shard gives every rank the same
  work (full causal leaves the last rank the most);
- the ring's length: with contiguous shards a rank needs keys from ceil((W − 1) / n) ranks back, and
  the ring stops after those steps (burst's schedules do: distflashattn.md App. D); zigzag and striped
  shards neighbour shards on every side, so their ring goes round;
- what burst moves on one node: its chunk stream serves only the rows the window needs (served_share).

A model that mixes windowed and full layers is costed per kind and summed (`blend`).
"""

from __future__ import annotations

import math
from dataclasses import replace


def causal_pairs(seq_len: int, window: int | None) -> float:
    """(query, key) pairs of causal attention over seq_len tokens, each query seeing at most `window`."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) / 2
    return seq_len * window - window * (window - 1) / 2


def layer_pairs(seq_len: int, causal: bool, window: int | None) -> float:
    """Pairs of one layer: all of them, half with a causal mask (the model's long-standing count), or
    what a causal window shorter than the sequence leaves."""
    if causal and window is not None and window < seq_len:
        return causal_pairs(seq_len, window)
    return seq_len**2 * (0.5 if causal else 1.0)


def balanced(seq_len: int, gpus: int, window: int | None) -> bool:
    """Contiguous causal shards do equal work when the window is no longer than a shard."""
    return window is not None and window <= seq_len / gpus


def ring_steps(seq_len: int, gpus: int, window: int | None, layout: str) -> int:
    """Steps of the K, V ring a causal layer needs (its own block included)."""
    if window is None or layout != "contiguous":
        return gpus
    return min(gpus, 1 + math.ceil((window - 1) / (seq_len / gpus)))


def served_share(seq_len: int, gpus: int, window: int | None, layout: str) -> float:
    """burst's chunk stream on one node serves a causal window only the rows it needs: the W - 1 rows
    before each run, from the rank holding the run before (G - 1 such pairs across ranks for contiguous
    shards, 2G - 2 for zigzag). The share of a whole block it moves per ring hop; 1 where the window
    reaches past the run before, or the layout has no runs."""
    if window is None or layout not in ("contiguous", "zigzag") or gpus == 1:
        return 1.0
    runs, shard = (2 if layout == "zigzag" else 1), seq_len / gpus
    if window - 1 > shard / runs:
        return 1.0
    pairs = 2 * gpus - 2 if layout == "zigzag" else gpus - 1
    hops = ring_steps(seq_len, gpus, window, layout) - 1
    if hops == 0:  # a window of one token, its own: no rank serves another
        return 0.0
    return (window - 1) * pairs / gpus / shard / hops


def blend(windowed, full, share: float):
    """The estimate of a model whose `share` of layers are windowed and the rest full: times and bytes
    add by share (each estimate covers all layers), memory and fit take the larger."""
    numbers = (
        "compute_s",
        "comm_s",
        "exposed_comm_s",
        "wall_s",
        "inter_node_bytes_per_device",
        "intra_node_bytes_per_device",
    )
    mixed = replace(windowed, **{n: share * getattr(windowed, n) + (1 - share) * getattr(full, n) for n in numbers})
    mixed.mem_bytes_per_device = max(windowed.mem_bytes_per_device, full.mem_bytes_per_device)
    mixed.fits = windowed.fits and full.fits
    mixed.note = "; ".join(dict.fromkeys(n for n in (windowed.note, full.note) if n))
    return mixed


__all__ = ["balanced", "blend", "causal_pairs", "layer_pairs", "ring_steps", "served_share"]
