"""Model shapes the engine builds (burst.engine.model) and the planner costs (plan/model_cost.py), and
how a world splits into data-parallel replicas: facts both need, kept below both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary frequency scaling ("rope_type": "llama3" in its config.json): wavelengths
    longer than original_max_positions / low_freq_factor are stretched by `factor`, shorter than
    original_max_positions / high_freq_factor kept, the band between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 1 << 20  # the longest sequence (prompt + generated) the model is meant for
    rope_scaling: Llama3RopeScaling | None = None  # None: plain rotary at rope_theta

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def parameters(self) -> int:
        """Parameter count (embeddings and LM head untied)."""
        attn = self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return (
            self.layers * (attn + 3 * self.dim * self.ffn_dim + 2 * self.dim)
            + 2 * self.vocab_size * self.dim
            + self.dim
        )


PRESETS = {
    "tiny": ModelConfig(vocab_size=256, dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128),
    # A LLaMA vocabulary on a narrow model: where the LM head and activations, not the weights,
    # set the memory (the CPU benchmarks of benchmarks/engine.md).
    "small": ModelConfig(vocab_size=32000, dim=256, layers=4, heads=4, kv_heads=2, ffn_dim=688),
    "llama-7b": ModelConfig(vocab_size=32000, dim=4096, layers=32, heads=32, kv_heads=32, ffn_dim=11008),
    "llama-14b": ModelConfig(vocab_size=120000, dim=5120, layers=40, heads=40, kv_heads=40, ffn_dim=13824),
    # Llama-3.1-8B's published shapes (its config.json; random weights, nothing downloaded). Its
    # published context is 131072 tokens; longer sequences run as ALST trains them (arXiv 2506.13996).
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_dim=14336,
        rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(),
        norm_eps=1e-5,
    ),
}


def model_presets() -> dict:
    """The engine's presets (PRESETS) and the papers' models."""
    papers = {
        # OpenLLaMA-3B (ring-attention.md Table 3): 26 layers, 32 heads x 100
        "llama-3b": ModelConfig(vocab_size=32000, dim=3200, layers=26, heads=32, kv_heads=32, ffn_dim=8640),
        "llama-13b": ModelConfig(vocab_size=32000, dim=5120, layers=40, heads=40, kv_heads=40, ffn_dim=13824),
        # distflashattn.md §4: LLaMA-7B with 8 KV heads, and with 33 heads of 128
        "llama-7b-gqa": ModelConfig(vocab_size=32000, dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim=11008),
        "llama-33h": ModelConfig(vocab_size=32000, dim=4224, layers=32, heads=33, kv_heads=33, ffn_dim=11008),
    }
    return {**PRESETS, **papers}


def check_dp(dp: int, world: int) -> None:
    """ValueError unless `dp` data-parallel replicas split a world of `world` ranks (`burst train`
    before it starts, `burst plan` over --gpus, and setup)."""
    if dp < 1 or world % dp:
        raise ValueError(
            f"--dp: {dp} does not divide the world of {world} ranks (sequence-parallel ranks = world / dp)"
        )
