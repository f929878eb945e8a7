"""The published configs of burst/bench/hf_zoo_real.py: for each family users shard most, the
checkpoint, what shapes its attention as its config.json has it (kept), and what is shrunk beyond the
common small sizes. Written here by hand (nothing is fetched from the Hub); the LongRoPE lists, gpt-oss,
DeepSeek-V3, Gemma 3 27B, Gemma 4 26B-A4B, Granite 3.1, GLM-4-0414 and Qwen3-Next values were checked
against public copies of those config.json files, the others are the published values as known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Phi-3.5-mini-instruct's and Phi-4-mini-instruct's config.json (rope_scaling, 48 = rotary dim / 2 each)
PHI35_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
              1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
              4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
              17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
              32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
              50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
              62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
              63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
              64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
              64.51000213623047, 64.52999877929688, 64.83999633789062]
PHI35_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
               1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
               1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
               1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
               1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
               2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
               2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
               2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
               2.729999542236328, 2.749999523162842, 2.8399994373321533]
PHI4_MINI_LONG = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                  2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                  5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                  11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                  25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                  32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]
PHI4_MINI_SHORT = [1.0] * 48


@dataclass(frozen=True)
class Case:
    name: str                # the row: the family, and what the variant shrank
    model_type: str
    source: str              # the published checkpoint whose config.json `kept` is from
    kept: dict               # its attention-shaping values, as published
    small: dict = field(default_factory=dict)   # family-specific shrinking beyond SMALL (experts, layer kinds)
    heads: tuple[int, int] | None = None        # (query, KV) heads when fewer than published: the ratio kept
    # kept values set after the config is built: Phi3Config checks the LongRoPE lists' length against
    # hidden_size / heads, which no longer is the head dim once hidden_size is shrunk
    after: tuple[str, ...] = ()
    # length-gated values as {dotted key: fraction of n}: the variant sets each to int(fraction * n)
    gated: dict = field(default_factory=dict)
    note: str = ""
    parent: str = ""         # a variant's published case


def _yarn(factor, original, theta, **more) -> dict:
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
            "rope_theta": float(theta), **more}


def _longrope(short, long, original, theta) -> dict:
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original, "rope_theta": float(theta)}


PUBLISHED = [
    Case("llama", "llama", "meta-llama/Llama-3.1-8B",
         {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    Case("qwen2", "qwen2", "Qwen/Qwen2.5-7B-Instruct (+ the YaRN its card gives for long context)",
         {"num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 131072,
          "use_sliding_window": False, "rope_parameters": _yarn(4, 32768, 1e6)},
         note="q/k/v biases"),
    Case("qwen3", "qwen3", "Qwen/Qwen3-8B (+ the YaRN its card gives for long context)",
         {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
          "rope_parameters": _yarn(4, 32768, 1e6)}, note="q/k RMSNorm"),
    Case("mistral", "mistral", "mistralai/Mistral-7B-v0.1",
         {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
          "sliding_window": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
         gated={"sliding_window": 1 / 4}),
    Case("ministral", "ministral", "mistralai/Ministral-8B-Instruct-2410",
         {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
          "sliding_window": 32768, "rope_parameters": {"rope_type": "default", "rope_theta": 1e8}},
         small={"layer_types": ["sliding_attention", "full_attention"]}, gated={"sliding_window": 1 / 4}),
    Case("gemma2", "gemma2", "google/gemma-2-9b",
         {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096,
          "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
         small={"layer_types": ["sliding_attention", "full_attention"]}, gated={"sliding_window": 1 / 4},
         note="softcap 50 barely bites on random weights (scores << 50): tests/test_hf_flagships.py caps at 1"),
    Case("gemma3", "gemma3_text", "google/gemma-3-27b-it (text)",
         {"num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
          "sliding_window": 1024, "max_position_embeddings": 131072,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         small={"layer_types": ["sliding_attention", "full_attention"]}, gated={"sliding_window": 1 / 4},
         note="5 of 6 layers sliding in the checkpoint; query_pre_attn_scalar 168 != head_dim 128"),
    Case("gemma4", "gemma4_text", "google/gemma-4-26B-A4B (text; values from public copies of its config)",
         {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
          "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
          "final_logit_softcapping": 30.0, "max_position_embeddings": 262144,
          "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         small={"layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 0,
                "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
         gated={"sliding_window": 1 / 4}, note="full layers: head_dim 512, 2 KV heads, K = V"),
    Case("phi3", "phi3", "microsoft/Phi-3.5-mini-instruct",
         {"num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 96, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "sliding_window": 262144,
          "rope_parameters": {**_longrope(PHI35_SHORT, PHI35_LONG, 4096, 10000), "partial_rotary_factor": 1.0}},
         after=("rope_parameters",),
         gated={"rope_parameters.original_max_position_embeddings": 1 / 2, "original_max_position_embeddings": 1 / 2,
                "sliding_window": 1 / 4},
         note="LongRoPE: the long factors only past original_max_position_embeddings"),
    Case("phi4", "phi3", "microsoft/Phi-4-mini-instruct",
         {"num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096, "sliding_window": 262144, "tie_word_embeddings": True,
          "rope_parameters": {**_longrope(PHI4_MINI_SHORT, PHI4_MINI_LONG, 4096, 10000), "partial_rotary_factor": 0.75}},
         after=("rope_parameters",),
         gated={"rope_parameters.original_max_position_embeddings": 1 / 2, "original_max_position_embeddings": 1 / 2,
                "sliding_window": 1 / 4},
         note="partial rotary 0.75"),
    Case("gpt_oss", "gpt_oss", "openai/gpt-oss-20b",
         {"num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
          "attention_bias": True, "max_position_embeddings": 131072,
          "rope_parameters": _yarn(32, 4096, 150000, beta_fast=32.0, beta_slow=1.0, truncate=False)},
         small={"layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 4,
                "num_experts_per_tok": 2},
         heads=(32, 4), note="learned sinks per head"),
    Case("deepseek_v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3",
         {"num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
          "rope_interleave": True,
          "rope_parameters": _yarn(40, 4096, 10000, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)},
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
