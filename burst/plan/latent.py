"""What burst's ring moves per block, for the cost model: the side its backward takes (grouped heads:
the keys) and, for multi-head latent attention, the latent instead of expanded heads.

strategies/burst.py picks the backward's side from the bytes (side_bytes_per_row); burst/latent.py
moves MLA's latent (kv_lora_rank + rope numbers a token) on the key side and expands every block a
rank attends with kv_b_proj: 2·rank·expanded FLOPs a token forward, and in the backward the same
expansion again plus its two transposed products (the latent's and the weight's gradients).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Latent:
    """MLA's shapes as the planner needs them: the latent's rank (kv_lora_rank), the shared rotary key's
    width (qk_rope_head_dim) and the numbers kv_b_proj expands a token into (heads x (nope + v))."""

    rank: int
    rope: int
    expanded: int

    @property
    def numbers(self) -> int:
        """Numbers a token puts on the ring."""
        return self.rank + self.rope


def latent_of(text_config) -> Latent | None:
    """The Latent of a transformers text config with MLA (kv_lora_rank), else None."""
    rank = getattr(text_config, "kv_lora_rank", None)
    if not rank:
        return None
    per_head = getattr(text_config, "qk_nope_head_dim", 0) + getattr(text_config, "v_head_dim", 0)
    return Latent(rank, getattr(text_config, "qk_rope_head_dim", 0), text_config.num_attention_heads * per_head)


def burst_blocks(w, s) -> tuple[float, str, float, float]:
    """(forward block bytes, backward side, travelling bytes, accumulator bytes going home) of burst's
    ring for workload w with block sizes s (cost._Sizes): the latent for MLA, else the smaller side."""
    if w.latent is not None:
        latent = w.batch * s.n * w.latent.numbers
        return latent * s.dtype_bytes, "keys (the latent)", latent * s.dtype_bytes, latent * 4
    if s.kv + s.dkv32 < 2 * s.q + 2 * s.stat + s.dq32:  # as strategies/burst.py's backward_side; ties: queries
        return s.kv, "keys", s.kv, s.dkv32
    return s.kv, "queries", 2 * s.q + 2 * s.stat, s.dq32


def expansion_flops(w) -> tuple[float, float]:
    """(forward, backward) FLOPs per device and layer of expanding the latent (0 without MLA): every
    rank expands the whole sequence's blocks it attends (about all of them)."""
    if w.latent is None:
        return 0.0, 0.0
    forward = 2.0 * w.batch * w.seq_len * w.latent.rank * w.latent.expanded
    return forward, 3 * forward
