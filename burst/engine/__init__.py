"""BurstEngine: long-context training on sequence-parallel attention (burstengine.md §2-4).

model.py: the LLaMA-style decoder (plain PyTorch) and parallelize(); loss.py: the sequence-level
fusion of LM head and cross-entropy (Alg. 3); train.py: `burst train`. Not built yet: the
checkpointing modes, FSDP2, checkpoints and resume (the open part of issue 15).
"""

from . import model
from .loss import fused_linear_cross_entropy
from .model import PRESETS, ModelConfig, Transformer, parallelize

__all__ = ["fused_linear_cross_entropy", "PRESETS", "ModelConfig", "Transformer", "parallelize", "model"]
