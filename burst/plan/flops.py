"""FLOPs of a training step as torchtitan counts them, and the dense peaks MFU divides by.

torchtitan (pytorch/torchtitan, torchtitan/utils.py `get_num_flop_per_token`, later
torchtitan/models/utils.py): per token, forward + backward, 6 x the parameters without the embedding
(2 FLOPs per weight forward, 4 backward) plus 12 x layers x heads x head_dim x seq_len for attention
(2 matmuls forward and 4 backward, 2 FLOPs each; flash attention's recompute not counted), and, in
its words, "we follow the convention and do not account for sparsity in causal attention": the
causal mask's half is not taken off. Counting the same way makes our MFU comparable to torchtitan's
published ones (docs/performance.md: Llama-3.1-8B, 32K tokens on H100s).
"""

from __future__ import annotations

# bf16 dense datasheet peaks (no sparsity), FLOP/s per device: what torchtitan's get_peak_flops uses
DENSE_BF16_PEAK = {"A100": 312e12, "A800": 312e12, "H100": 989e12, "H200": 989e12}


def train_flops_per_token(m, seq_len: int) -> float:
    """Forward + backward FLOPs per token of model `m` (a ModelConfig) at `seq_len`, torchtitan's count."""
    return 6 * (m.parameters() - m.vocab_size * m.dim) + 12 * m.layers * m.heads * m.head_dim * seq_len


def peak_flops_of(device_name: str) -> float:
    """The dense bf16 peak of a device named like torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3"),
    0.0 when unknown."""
    for name, peak in DENSE_BF16_PEAK.items():
        if name in device_name.upper():
            return peak
    return 0.0
