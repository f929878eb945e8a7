"""BurstEngine: long-context training on sequence-parallel attention (burstengine.md §2-4).

model.py: the LLaMA-style decoder (plain PyTorch) and parallelize(); loss.py: the sequence-level
fusion of LM head and cross-entropy (Alg. 3); checkpointing.py: none / full / remat (DistFlashAttn's
rematerialization-aware) / selective (BurstEngine's sequence-level) activation checkpointing;
offload.py: checkpointed activations and AdamW's state and step in host memory (the numbers unchanged);
parallel.py: the dp x sp DeviceMesh and FSDP2; resume.py: DCP checkpoints and exact resume;
train.py: `burst train`; out_of_memory.py: its one-line error when a step does not fit the device.
"""

from . import model
from .loss import fused_linear_cross_entropy
from .model import PRESETS, ModelConfig, Transformer, parallelize

__all__ = ["fused_linear_cross_entropy", "PRESETS", "ModelConfig", "Transformer", "parallelize", "model"]
