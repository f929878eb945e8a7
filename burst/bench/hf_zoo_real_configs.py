"""The published configs of burst/bench/hf_zoo_real.py: for each family users shard most, the
checkpoint, what shapes its attention as its config.json has it (kept), and what is shrunk beyond the
common small sizes. Written here by hand (nothing is fetched from the Hub); the LongRoPE lists, gpt-oss,
DeepSeek-V3, Gemma 3 27B, Gemma 4 26B-A4B, Granite 3.1, GLM-4-0414 and Qwen3-Next values were checked
against public copies of those config.json files, the others are the published values as known.
"""

from __future__ import annotations

from .hf_zoo_real_case import Case, yarn
from .hf_zoo_real_gqa import GQA

# hf_zoo_real_gqa.py's Llama-to-Phi rows, then the families whose attention goes further: sinks, MLA,
# compressed and sparse indexers, chunks, a linear-attention hybrid, its own scale, norms, partial rotary
PUBLISHED = GQA + [
    Case("gpt_oss", "gpt_oss", "openai/gpt-oss-20b",
         {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
          "attention_bias": True, "max_position_embeddings": 131072,
          "rope_parameters": yarn(32, 4096, 150000, beta_fast=32.0, beta_slow=1.0, truncate=False)},
         small={"layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                "num_experts_per_tok": 2},
         heads=(32, 4), note="learned sinks per head"),
    Case("deepseek_v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3",
         {"num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
          "rope_interleave": True,
          "rope_parameters": yarn(40, 4096, 10000, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)},
         small={"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                "first_k_dense_replace": 1, "moe_intermediate_size": 32},
         heads=(32, 32), note="MLA: queries and keys 192 wide, values 128"),
    Case("deepseek_v4", "deepseek_v4", "deepseek-ai/DeepSeek-V4-Flash (as transformers' DeepseekV4Config documents it)",
         {"num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
          "q_lora_rank": 1024, "o_groups": 8, "sliding_window": 128, "index_topk": 512, "index_head_dim": 128,
          "index_n_heads": 64, "max_position_embeddings": 1048576,
          "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
          "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                              "compress": {"rope_type": "default", "rope_theta": 160000.0,
                                           "partial_rotary_factor": 0.125}}},
         small={"layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
                "mlp_layer_types": ["hash_moe", "moe"], "num_local_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "o_lora_rank": 64},
         heads=(16, 1), note="CSA: top-512 of N/4 entries; HCA: N/128 entries; 128-token window, sinks, K = V"),
    Case("llama4", "llama4_text", "meta-llama/Llama-4-Scout-17B-16E (text)",
         {"num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192,
          "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "use_qk_norm": True,
          "max_position_embeddings": 10485760,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
         small={"no_rope_layers": [1, 0], "num_local_experts": 4, "num_experts_per_tok": 1,
                "intermediate_size_mlp": 256},
         heads=(30, 6), gated={"attention_chunk_size": 1 / 4, "floor_scale": 1 / 4},
         note="layer 0 RoPE + chunked, layer 1 NoPE + temperature tuning (every 4th layer in the checkpoint)"),
    Case("qwen3_next", "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct",
         {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144,
          "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}},
         small={"layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
         note="gated delta net + gated full attention (3:1 in the checkpoint)"),
    Case("granite", "granite", "ibm-granite/granite-3.1-8b-instruct",
         {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "attention_multiplier": 0.0078125,
          "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 16.0,
          "max_position_embeddings": 131072, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}},
         note="attention_multiplier 1/128 replaces 1/sqrt(128)"),
    Case("olmo2", "olmo2", "allenai/OLMo-2-1124-7B",
         {"num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 4096,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
         note="q/k RMSNorm over all heads"),
    Case("glm4", "glm4", "zai-org/GLM-4-9B-0414",
         {"num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": True,
          "max_position_embeddings": 32768,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
         note="partial rotary 0.5, interleaved"),
]
CASES = {case.name: case for case in PUBLISHED}
