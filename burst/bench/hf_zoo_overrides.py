"""What a family of the zoo needs beyond burst/bench/hf_zoo_configs.py's rules for shrinking its config:
values set on its tiny config (OVERRIDES) and parameters drawn in its eager model (DRAWN), each with why.
"""

from __future__ import annotations

# What a family needs beyond the rules (a sub-config's as a dict under its key), and why.
OVERRIDES = {
    # hybrids whose default has none of the layers that make the family what it is (LFM2's default is all
    # attention), or whose sizes the rules cannot shrink consistently
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8},  # heads x head_dim must be hidden_size x expand
    "bamba": {"attn_layer_indices": [1]},
    "falcon_h1": {"mamba_d_ssm": 128},
    # Zamba ties its shared attention block across its hybrid layers: it needs two of them; its attention
    # is twice the hidden size wide. Weights 5x transformers' default scale (as ZAYA's): at 0.02 its Mamba
    # mixers' outputs are too small for a missing state to show (a planted one: 1e-7 off; at 0.1, 1e-3)
    "zamba": {
        "layer_types": ["mamba", "hybrid", "hybrid"],
        "num_hidden_layers": 3,
        "attention_hidden_size": 128,
        "initializer_range": 0.1,
    },
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare, and clamps q, k, v
    # to clip_qkv, which torch refuses with no bound (the default None)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Dots3's sliding layers are MLA with wider no-rope heads (their own per-layer sizes): head_dim is those
    # layers' no-rope plus rope dims, checked by its validator (scaled: 192 + 64 = 256 becomes 24 + 8 = 32)
    "dots3_note_text": {"head_dim": 32, "qk_nope_head_dim": 16},
    # (and its vision and audio adapters' outputs, checked against the text's hidden size, though unused here)
    "dots3_note": {
        "text_config": {"head_dim": 32, "qk_nope_head_dim": 16},
        "vision_config": {"adapter_out_dim": 64},
        "audio_config": {"adapter_out_dim": 64},
    },
    # Gemma 3n's last layers reuse earlier layers' KV (num_kv_shared_layers), of each kind that produces one
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
    },
    # MusicGen's decoder reads one row of token ids per codebook: one codebook takes the zoo's (1, 128) ids
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    # Xmod's adapters need a language; its default config names none
    "xmod": {"default_language": "en_XX"},
    # ReformerModelWithLMHead asserts is_decoder; its axial position embeddings' dims sum to the hidden size
    # and their shape covers the sequence
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [16, 48],
        "axial_pos_shape": [8, 16],
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
    },
    # ZAYA validates top-1 routing only; weights 5x the default scale, so that a chunk run without its halo
    # shows (planted: gradients 1.2e-4 off at 0.02, 5e-3 at 0.1)
    "zaya": {"num_experts_per_tok": 1, "initializer_range": 0.1},
    # per-layer-type rope parameters whose default is empty (no rope for any layer: KeyError in the model)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # DeepSeek-V4: one layer of each compressed kind, HCA's windows of 8 tokens instead of 128 (so that a 128-token
    # sequence has 16 entries and a shard of 4 ranks' zigzag (16 tokens) holds whole windows), a grouped output
    # projection of a tiny rank
    "deepseek_v4": {
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe"],
        "num_hidden_layers": 2,
        "o_groups": 2,
        "o_lora_rank": 16,
    },
    # Doge past keep_window_size: each row keeps its 64 largest biases per KV head of up to 128 keys (a selection per
    # KV head: burst's indices=); tests/test_hf_selection.py runs the published keep_window_size of 2048 past it
    "doge": {"keep_window_size": 64},
    # PhiMoE: its default has no window; Phi-3.5-MoE-instruct's config.json sets sliding_window (131072, its context),
    # which PhimoeModel's mask applies to every layer and its attention does not pass: 32 here, so it bites
    "phimoe": {"sliding_window": 32},
    # MiniMax-M3: its default has no block-sparse layer; one of each kind, blocks of 8 keys (16 in 128 tokens) of
    # which each query keeps 4 per KV head (its own block among them): the selection prunes
    "minimax_m3_vl_text": {
        "layer_types": ["minimax_m3_sparse", "full_attention"],
        "index_block_size": 8,
        "index_topk_blocks": 4,
        "index_local_blocks": 1,
    },
    # MiniMax: its lightning attention's decay per token shrinks with the layer's depth, to ~1e-5 at the last layer,
    # where the default puts it (after a full-attention layer): first here, decaying by up to e^-0.25 a token, so a
    # state passed or kept without its decay shows
    "minimax": {"layer_types": ["linear_attention", "full_attention"]},
    # the assistant shares every layer's KV with its backbone and has no per-layer inputs (its validator)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}

# Parameters whose initialisation hides a feature, drawn from a normal distribution (seeded) in the zoo's eager
# model before its weights are copied: Doge's dynamic-mask decay A starts at 0, so every key's bias is exp(0) = 1
# (one constant, which the softmax cancels, and a top-k over ties)
DRAWN = {"doge": ("self_attn.A",)}


def draw(model_type: str, model) -> None:
    """Draw the DRAWN parameters of the family's `model` in place (standard normal, seed 2)."""
    import torch

    endings = DRAWN.get(model_type, ())
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(endings):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
