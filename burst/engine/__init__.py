"""BurstEngine: long-context training on sequence-parallel attention (burstengine.md §2-4).

Built so far: loss.py, the sequence-level fusion of LM head and cross-entropy (Alg. 3). The model,
checkpointing modes, FSDP2 and `burst train` are the open part of issue 15.
"""

from .loss import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]
