"""Tiny configs for the zoo (burst/bench/hf_zoo.py): a family's own config class, its default shrunk.

Rules driven by what the config declares, applied to the config and to each of its sub-configs (text,
vision, audio, attention, feed-forward): every size attribute of SIZES it has as a number is set small
(0 stays 0: a part switched off), or as None where the class declares an int there and None is not
how the family switches a feature off (OFF_WHEN_NONE); a per-layer pattern (`layer_types`) keeps one
layer of each kind, and every per-layer list (one value a layer) is cut to that depth; per-layer
overrides (`per_layer_config`, e.g. Gemma 4's wider full-attention heads) keep their layers below
that depth, their sizes in the same ratio to the global ones; no vocabulary (of any name: a decoder's,
per-layer inputs', hashed byte groups') is larger than the tiny one, and token ids stay within it.
Where the causal-LM class is built from one sub-config (the text model of a multimodal wrapper), that
one alone is shrunk. OVERRIDES (hf_zoo_overrides.py) holds what a family needs beyond these, with why.
"""

from __future__ import annotations

import copy

from .hf_zoo_overrides import DRAWN, OVERRIDES, draw  # noqa: F401 (hf_zoo.py's names)

SEQ_LEN, VOCAB = 128, 256

# config attribute -> tiny value, applied where the family's config has the attribute as a nonzero number, or
# as None where its class declares an int there (_sized: a feature its default leaves off with None, such
# as sliding_window=None, stays off)
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "embed_dim": 64,
    "n_embed": 64,
    "hidden_size_global": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "kv_n_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    "attention_head_size": 16,
    "rotary_dim": 8,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "d_ff": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "moe_ffn_hidden_size": 32,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "moe_top_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "sliding_window": 32,
    "attention_chunk_size": 64,
    # indexers choosing each query's keys (DeepSeek sparse attention, Qwen4's compressed blocks): fewer than 128
    # index_topk 16 of 128 tokens: the selection prunes (a top-k covering every key would prove nothing)
    "index_topk": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 32,
    "indexer_compress_ratio": 4,
    # per-layer embeddings (Gemma 3n / 4)
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "backbone_hidden_size": 64,
    # recurrent mixers (the backend's layers/mixers): value heads narrower than keys, scan chunks shorter than a shard
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "n_mamba_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
}
# Sizes whose None switches a feature off (no sliding window, no query compression): left None.
OFF_WHEN_NONE = ("sliding_window", "attention_chunk_size", "q_lora_rank")
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
ZEROED = (
    "attention_dropout",
    "attn_pdrop",
    "attention_probs_dropout_prob",
    "dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "activation_dropout",
)

# Size attributes left at the family's default when a config refuses the full set of SIZES (per-layer
# attributes, head dims tied to rotary dims, validated layer counts): each retry keeps one group more.
_KEPT_IN_TURN = (
    ("head_dim", "kv_channels", "attention_head_dim"),
    (
        "num_key_value_heads",
        "num_kv_heads",
        "n_kv_heads",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "q_lora_rank",
        "kv_lora_rank",
    ),
    (
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
        "decoder_layers",
        "encoder_layers",
        "layer_types",
        "intermediate_size",
        "moe_intermediate_size",
        "first_k_dense_replace",
    ),
)
RETRIES = tuple(sum(_KEPT_IN_TURN[:i], ()) for i in range(len(_KEPT_IN_TURN) + 1))


def tiny_config(model_type: str, keep_default: tuple[str, ...] = ()):
    """The family's config class, its default shrunk to SIZES but for the attributes in keep_default
    (raises when the config refuses the values). Where the family's causal-LM class is built from a
    sub-config (its text model), that sub-config alone is shrunk, the others left as they are; where
    transformers' auto class does not pick that sub-config itself (MusicGen's `decoder`), it is returned."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    extra = OVERRIDES.get(model_type, {})
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a default its own validators refuse: the family's overrides first
        default = cls(**copy.deepcopy(extra))
    taken = _taken(cls)  # a sub-config's class where the model is built from that sub-config alone
    taken = taken if any(isinstance(sub, taken) for sub in list(_configs(default))[1:]) else cls
    kwargs = _shrunk(default, keep_default, extra, None if taken is cls else taken)
    config = cls(**{k: v for k, v in kwargs.items() if v is not _DERIVED})
    for part in _configs(config):
        for attr in ZEROED:
            if isinstance(getattr(part, attr, None), float):
                setattr(part, attr, 0.0)
        for attr in TOKEN_IDS:
            value = getattr(part, attr, None)
            if isinstance(value, int) and value >= VOCAB:
                setattr(part, attr, 0)
    if taken is cls or "text_config" in getattr(cls, "sub_configs", {}):  # the auto class swaps a text_config in
        return config
    return next((sub for sub in _configs(config) if isinstance(sub, taken)), config)


def _taken(cls):
    """The config class the family's causal-LM class is built from."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[cls].config_class
    except (KeyError, AttributeError):
        return cls


def _shrunk(config, keep_default, extra: dict, only=None) -> dict:
    """The keyword arguments of a tiny `config`: its sub-configs shrunk the same way, as dicts (only those
    of class `only`, and nothing else, where it is given)."""
    out = {}
    for key in getattr(config, "sub_configs", {}):
        sub = config._getattr_without_heterogeneous_validation(key, None)
        if hasattr(sub, "to_dict") and (only is None or isinstance(sub, only)):
            out[key] = {
                k: v
                for k, v in {**sub.to_dict(), **_shrunk(sub, keep_default, extra.get(key, {}))}.items()
                if v is not _DERIVED
            }
    if only is not None:
        return {**out, **{k: v for k, v in extra.items() if k not in out}}
    sized = {k: v for k, v in _overrides(config).items() if k not in keep_default}
    sized.update({k: v for k, v in extra.items() if k not in out})
    depth = next((sized[k] for k in LAYER_COUNTS if k in sized), None)
    return {**out, **(_per_layer(config, depth, sized) if depth is not None else {}), **sized}


def _overrides(text) -> dict:
    """SIZES for the attributes the config has and can be given (not read-only properties), layer
    counts deep enough for one layer of each kind of its per-layer pattern."""
    out = {key: value for key, value in SIZES.items() if _sized(text, key) and _settable(text, key, value)}
    for key, value in vars(text).items():  # no vocabulary larger than the tiny one (decoder's, per-layer inputs')
        if "vocab" in key and _number(value) and value > VOCAB:
            out.setdefault(key, VOCAB)
    if "qk_rope_head_dim" in out and "head_dim" in out:  # MLA: head_dim names the rotary part
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out:  # MLA expands its latent to every query head: as many KV heads as heads
        for key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
            if key in out:
                out[key] = out.get("num_attention_heads", 4)
    layer_types = _get(text, "layer_types")
    if isinstance(layer_types, (list, tuple)) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        depth = max(2, max(list(layer_types).index(kind) for kind in kinds) + 1)
        if _settable(text, "layer_types", list(layer_types[:depth])):
            out["layer_types"] = list(layer_types[:depth])
        for key in LAYER_COUNTS:
            if key in out:
                out[key] = depth
    return out


_DERIVED = object()  # a per-layer list the config derives itself: left out, derived again for the tiny depth


def _per_layer(config, depth: int, sized: dict) -> dict:
    """Per-layer values cut to `depth` layers: lists of one value a layer that the class declares with a
    default of its own (a size among them set to its tiny value; those it derives when None are derived
    again), and per-layer overrides below that depth, sized in the ratio of the default's."""
    layers = next((_get(config, k) for k in LAYER_COUNTS if _number(_get(config, k))), None)
    fields = getattr(type(config), "__dataclass_fields__", {})
    out = {}
    for key, value in vars(config).items():
        if key in sized or key.startswith("_"):
            continue
        if key.endswith("_layers") and _number(value) and value == layers:  # every layer (an assistant's KV sharing)
            out[key] = depth
        if not isinstance(value, list) or len(value) != layers:
            continue
        if key not in fields or fields[key].default is None:
            out[key] = _DERIVED
        elif key in SIZES and all(_number(v) for v in value):
            out[key] = [SIZES[key]] * depth
        else:
            out[key] = list(value[:depth])
    spec = getattr(config, "__dict__", {}).get("_heterogeneity_spec")
    if spec is not None:
        out["per_layer_config"] = {
            index: {attr: _scaled(value, sized.get(attr), _get(config, attr)) for attr, value in overrides.items()}
            for index, overrides in spec.per_layer_overrides.items()
            if index < depth
        }
    return out


def _scaled(value, tiny, default):
    """A per-layer size in the ratio to the tiny global size that it had to the default one."""
    if not (_number(value) and _number(tiny) and _number(default)) or not default:
        return value
    return max(1, round(tiny * value / default))


def _sized(config, key: str) -> bool:
    """A size to set: a nonzero number, or None where the class declares an int and None switches nothing off
    (DeepSeek-V2's n_group, Hunyuan's head_dim, Nemotron's num_key_value_heads, Qwen4's indexer sizes)."""
    value = _get(config, key, 0)
    if value is None:
        return key not in OFF_WHEN_NONE and "int" in str(_annotations(type(config)).get(key, ""))
    return _number(value) and value != 0


def _annotations(cls) -> dict:
    out = {}
    for klass in reversed(cls.__mro__):
        out.update(getattr(klass, "__annotations__", {}))
    return out


def _settable(config, key: str, value) -> bool:
    """The config takes `value` for `key`: not a read-only property (Bamba's layer_types), nor a setter
    that raises (XLNet's max_position_embeddings)."""
    key = getattr(type(config), "attribute_map", {}).get(key, key)
    attribute = getattr(type(config), key, None)
    if not isinstance(attribute, property):
        return True
    if attribute.fset is None:
        return False
    try:
        attribute.fset(copy.copy(config), value)
    except Exception:  # noqa: BLE001 - the family's own refusal of the attribute
        return False
    return True


def _get(config, key: str, default=None):
    return config._getattr_without_heterogeneous_validation(key, default)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _configs(config):
    """The config and every sub-config in it (a copy returned by get_text_config is not one of them)."""
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = config._getattr_without_heterogeneous_validation(key, None)
        if hasattr(sub, "to_dict"):
            yield from _configs(sub)


def causal_lm(model_type: str, config, **kwargs):
    """The family's causal-LM model on `config` (tiny_config's), as AutoModelForCausalLM.from_config would
    build it, or from the family's class where the config is a decoder sub-config the auto class does not map."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    family = CONFIG_MAPPING[model_type]
    if isinstance(config, family):
        return AutoModelForCausalLM.from_config(config, **kwargs)
    return MODEL_FOR_CAUSAL_LM_MAPPING[family]._from_config(config, **kwargs)
