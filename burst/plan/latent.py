"""Multi-head latent attention (MLA) as the planner sees it: the latent's shapes, and the FLOPs of
expanding it.

burst/latent.py moves MLA's latent (kv_lora_rank + rope numbers a token) on BurstAttention's key side
and expands every block a rank attends with kv_b_proj: 2·rank·expanded FLOPs a token forward, and in
the backward the same expansion again plus its two transposed products (the latent's and the
weight's gradients). What burst's ring then moves per block: rings.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatentShape:
    """MLA's shapes as the planner needs them: the latent's rank (kv_lora_rank), the shared rotary key's
    width (qk_rope_head_dim) and the numbers kv_b_proj expands a token into (heads x (nope + v)).
    Not burst.LatentKV (the tensors a call hands burst) nor burst/latent.py's LatentKeys (its blocks)."""

    rank: int
    rope: int
    expanded: int

    @property
    def numbers(self) -> int:
        """Numbers a token puts on the ring."""
        return self.rank + self.rope


def latent_of(text_config) -> LatentShape | None:
    """The LatentShape of a transformers text config with MLA (kv_lora_rank), else None."""
    rank = getattr(text_config, "kv_lora_rank", None)
    if not rank:
        return None
    per_head = getattr(text_config, "qk_nope_head_dim", 0) + getattr(text_config, "v_head_dim", 0)
    return LatentShape(rank, getattr(text_config, "qk_rope_head_dim", 0), text_config.num_attention_heads * per_head)


def expansion_flops(w) -> tuple[float, float]:
    """(forward, backward) FLOPs per device and layer of expanding the latent (0 without MLA): every
    rank expands the whole sequence's blocks it attends (about all of them)."""
    if w.latent is None:
        return 0.0, 0.0
    forward = 2.0 * w.batch * w.seq_len * w.latent.rank * w.latent.expanded
    return forward, 3 * forward
