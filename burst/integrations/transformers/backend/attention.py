"""burst as a transformers attention implementation: `register` puts the attention function and the
mask function under a name, through transformers' own interfaces (AttentionInterface for the
attention function, AttentionMaskInterface so transformers never builds an N x N mask): no model code
is patched.

Every layer's attention call checks the model (checks.check_config) and its keywords
(../keywords.py), runs a ShardedCache's decode step when generate() is decoding on one (the running
cache, registry.py), and otherwise runs burst.attention on this rank's shard, with the packed
documents found from position_ids (documents.py). What the backend cannot do raises on every rank.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import replace

import torch

from burst import api, layout as layout_mod
from burst.agreement import agree

from ..keywords import check_keywords, check_model_features, generate_cache_keyword, model_name
from ..layers import compressed, dynamic_mask as dynamic_masks, latent as latents
from ..layers.configs import text_config
from .checks import check_config
from .documents import documents
from .registry import BACKENDS, Backend, backend_of, running_cache, world_size

TESTED_TRANSFORMERS = ">=5.23.0,<6"  # the `hf` extra of pyproject.toml: the releases scripts/test.sh tests


def register(name: str = "burst", *, strategy: str = "burst", layout: str = "contiguous", group=None,
             **options) -> str:
    """Register burst as attention implementation `name`; returns the name for `attn_implementation`.

    strategy, layout, group and **options are those of `burst.attention`; the batch must be sharded
    with the same layout and group (`shard_batch`). Registering a name again replaces its settings.
    """
    interfaces = _transformers_interfaces()
    if layout not in layout_mod.DOCUMENT_LAYOUTS:  # doc_*: the documents come with each batch's position_ids
        layout_mod.check_layout(layout)
    if "flash" in name or "/" in name or ":" in name:  # transformers routes such names to its flash / hub kernels
        raise ValueError(f"name {name!r}: transformers treats names containing 'flash', '/' or ':' as its own "
                         "flash-attention or hub kernels; choose another (e.g. 'burst')")
    if strategy not in api.STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {api.STRATEGY_NAMES}, got {strategy!r}")
    BACKENDS[name] = Backend(strategy, layout, group, dict(options))
    attention_interface, mask_interface = interfaces
    attention_interface.register(name, burst_attention_forward)
    mask_interface.register(name, burst_attention_mask)
    return name


def _transformers_interfaces():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"burst.integrations.transformers needs transformers and accelerate: pip install "
            f"'transformers{TESTED_TRANSFORMERS}' 'accelerate>=1.1' (or, from a clone of burst, pip install '.[hf]')"
        ) from err
    return AttentionInterface, AttentionMaskInterface


def burst_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface on burst.attention.

    query: (batch, heads, seq_local, head_dim); key, value: (batch, kv_heads, seq_local, head_dim),
    this rank's shard. Returns (out (batch, seq_local, heads, head_dim), None). Keywords: those of
    keywords.ACCEPTED_KEYWORDS; any other raises (deny by default).
    """
    name, backend = backend_of(module)
    check_config(name, getattr(module, "config", None), world_size(backend.group))
    check_keywords(name, module, kwargs)
    scaling = kwargs.get("scaling")
    sliding_window = dynamic_masks.window(module, kwargs.get("sliding_window"))
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    softcap = float(kwargs.get("softcap") or 0.0)
    cache = running_cache()
    decoding = cache is not None and cache.phase == "decode"
    chunk_size = check_model_features(name, module, sliding_window, decoding=decoding)
    bias = dynamic_masks.handed_over(module)  # Doge: a bias per key, folded into the keys below
    decoded = _decode_step(name, module, query, scaling, sliding_window, sinks, softcap, chunk_size)
    if decoded is not None:
        return decoded
    if bias is not None:  # the (batch, heads, 1, keys) mask the layer made of it is consumed
        dynamic_masks.check_length(name, module, model_name(module), query.shape[2] * world_size(backend.group))
        attention_mask = None
    handed = latents.handed_over(module, key, value)  # MLA: the latent and rotary key, not expanded heads
    values_are_keys = value is key  # DeepSeek-V4 passes one tensor as both: one block travels
    key, value, entries = _compressed_entries(name, module, query, key, value)
    _refuse_unsupported(name, query, query if handed is not None else key, attention_mask)
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = None
    if sliding_window is not None:  # transformers: key j attends when j > i - sliding_window
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    positions = kwargs.get("position_ids")
    if positions is None:  # an attention module that takes position_ids but keeps them (shard_mixers captures them)
        positions = getattr(module, "_burst_position_ids", None)
    if positions is None:
        raise ValueError(
            f"attn_implementation={name!r}: {model_name(module)} does not pass position_ids to its attention "
            "function, so burst can neither check that the shards sit at their global positions nor see packed "
            "documents; refused (models that do pass them: Llama, Qwen, Mistral, GPT-OSS, ...; a model prepared "
            "by bt.shard_batch(..., model=model) or SequenceParallelTrainer has them captured)")
    cu_seqlens = documents(positions, query.shape[0], query.shape[2], backend)
    query = global_temperature(name, module, query, backend)
    query, key, value = _one_dtype(query, key, value)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if handed is not None:
        return _latent_attention(query, handed, backend, causal, window, scaling, cu_seqlens, kwargs.get("indices"),
                                 sinks, softcap, chunk_size), None
    if bias is not None:
        query, key = dynamic_masks.fold(query, key, bias, scaling)
    query, key, value, head_dim_v = _one_head_dim(query, key, value)
    indices = kwargs.get("indices")
    if entries is not None:  # in the attention's dtype, as q, k, v are
        entries = replace(entries, k=entries.k.to(query.dtype), v=entries.v.to(query.dtype))
    key = key.transpose(1, 2)
    value = key if values_are_keys else value.transpose(1, 2)  # the same steps made both from one tensor
    out = api.attention(query.transpose(1, 2), key, value, group=backend.group,
                        strategy=backend.strategy, layout=backend.layout, causal=causal, window=window,
                        softmax_scale=scaling, cu_seqlens=cu_seqlens, sinks=sinks, softcap=softcap,
                        chunk_size=chunk_size, indices=indices, compressed=entries, **backend.options)
    return out[..., :head_dim_v], None


def hands_over_latent(layer) -> bool:
    """Whether an MLA layer hands burst its latent (layers/latent.py): its attention is burst's with
    the "burst" strategy (whose key side moves the latent), outside a generation cache's steps."""
    backend = BACKENDS.get(getattr(getattr(layer, "config", None), "_attn_implementation", None))
    return (backend is not None and backend.strategy in ("burst", "auto") and running_cache() is None
            and backend.options.get("backward_side", "auto") != "queries")


def hands_over_dynamic_mask(layer) -> bool:
    """Whether a dynamic-mask layer (Doge's) hands burst its bias per key (layers/dynamic_mask.py): its
    attention is one registered with burst."""
    return getattr(getattr(layer, "config", None), "_attn_implementation", None) in BACKENDS


def _latent_attention(query, handed, backend: Backend, causal, window, scaling, cu_seqlens, indices, sinks, softcap,
                      chunk_size):
    """out (batch, seq_local, heads, v_head_dim) of burst.attention(latent=...): the latent (in the
    attention's dtype, as q) rides the ring, each rank expands it with the layer's kv_b_proj."""
    handed = replace(handed, latent=handed.latent.to(query.dtype), rope=handed.rope.to(query.dtype))
    return api.attention(query.transpose(1, 2), latent=handed, group=backend.group, strategy=backend.strategy,
                         layout=backend.layout, causal=causal, window=window, softmax_scale=scaling,
                         cu_seqlens=cu_seqlens, indices=indices, sinks=sinks, softcap=softcap, chunk_size=chunk_size,
                         **backend.options)


def _compressed_entries(name, module, query, key, value):
    """(key, value, burst.CompressedKV or None): DeepSeek-V4's layers concatenate the compressed entries
    their compressor made for the whole sequence (layers/compressed.py) after this shard's keys; they
    go to burst.attention apart, as entries every rank holds."""
    found = compressed.pending(module)
    if found is None:
        return key, value, None
    rate, count, chosen = found
    local = query.shape[2]
    if count == 0 and key.shape[2] == local:  # no window has ended yet (a sequence shorter than one)
        return key, value, None
    if key.shape[2] != local + count:
        raise ValueError(f"attn_implementation={name!r}: {model_name(module)} handed {key.shape[2]} keys for {local} "
                         f"queries and {count} compressed entries; this transformers release arranges DeepSeek-V4's "
                         "attention differently from what burst knows")
    entries = api.CompressedKV(key[:, :, local:].transpose(1, 2), value[:, :, local:].transpose(1, 2), rate, chosen)
    return key[:, :, :local], value[:, :, :local], entries


def _one_head_dim(query, key, value):
    """(q, k, v, v's head dim) with one head dim: MLA's values (DeepSeek: 128) are narrower than its
    queries and keys (192), and burst moves K, V as one shape. The narrower side gets zero columns,
    which change no score (q, k) and no output column that is kept (v)."""
    dim_qk, dim_v = query.shape[-1], value.shape[-1]
    if dim_qk == dim_v:
        return query, key, value, dim_v
    width = max(dim_qk, dim_v)

    def widened(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    return widened(query), widened(key), widened(value), dim_v


def global_temperature(name: str, module, query: torch.Tensor, backend: Backend) -> torch.Tensor:
    """query (batch, heads, seq_local, head_dim) with Llama 4's attention temperature tuning at the
    rows' global indices. Its NoPE layers scale each query by log1p(floor((i + 1) / floor_scale)) *
    attn_scale + 1 with i = arange(seq_local) of the forward: a rank's own 0..n-1. The factor is
    divided out and the one of the row's place in the whole sequence applied."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    world, rank = layout_mod._world_and_rank(backend.group)
    if world == 1:
        return query
    if backend.layout not in layout_mod.LAYOUTS:
        raise ValueError(f"attn_implementation={name!r}: {model_name(module)} scales queries by their index in the "
                         f"sequence (attn_temperature_tuning), which burst applies under {layout_mod.LAYOUTS}, not "
                         f"{backend.layout!r}")
    local = query.shape[2]
    mine = layout_mod.shard_indices(backend.layout, rank, world, local * world, device=query.device)
    own = torch.arange(local, device=query.device)

    def factor(i):
        return torch.log1p(torch.floor((i.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    return (query * (factor(mine) / factor(own))[None, None, :, None]).to(query.dtype)


def _decode_step(name: str, module, query: torch.Tensor, scaling: float | None, sliding_window: int | None,
                 sinks: torch.Tensor | None = None, softcap: float = 0.0, chunk_size: int | None = None):
    """What the attention function runs inside generate(): (out (batch, 1, heads, head_dim), None) in a
    ShardedCache decode step; None where burst's sequence-parallel path runs (a ShardedCache prefill,
    or any forward outside generate()). generate() without a ShardedCache raises."""
    cache = running_cache()
    if cache is not None:
        if cache.phase != "decode":
            return None
        if softcap or chunk_size:
            raise ValueError(f"attn_implementation={name!r}: {model_name(module)} decodes with "
                             f"{'softcap' if softcap else 'chunked attention'}, which the sharded KV cache does not "
                             "run yet; generate on one rank (prefill and training are exact across ranks)")
        if dynamic_masks.is_dynamic_mask_attention(module):
            raise ValueError(f"attn_implementation={name!r}: {model_name(module)} adds a dynamic mask (a bias per "
                             "key) that the sharded KV cache's decoding does not apply; generate on one rank "
                             "(training and forwards are exact)")
        return cache.attend(module.layer_idx, query, scaling, sliding_window, sinks), None
    if not torch.is_grad_enabled() and _inside_generate():  # generate runs under no_grad: training skips the walk
        raise ValueError(
            f"attn_implementation={name!r}: model.generate() needs {generate_cache_keyword()}=bt.ShardedCache(model), "
            "or **bt.sharded_cache(model) (import burst.integrations.transformers as bt). Without it every rank would "
            "run the whole prompt and decode against a whole, unsharded cache")
    return None


def _inside_generate() -> bool:
    """Whether transformers' generate() is on the call stack. Nothing else tells the attention function:
    generate's DynamicCache is not passed to it, and its inputs look like any forward's."""
    code = _generate_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@functools.lru_cache(maxsize=None)
def _generate_code():
    from transformers import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__


def _one_dtype(query, key, value):
    """q, k, v in one dtype, as SDPA and transformers' flash path take them: the autocast dtype under
    torch.autocast (RoPE hands q, k in float32 beside a bf16 v; burst.attention casts them), else
    the widest of the three."""
    if torch.is_autocast_enabled(query.device.type):
        return query, key, value
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _refuse_unsupported(name, query, key, attention_mask) -> None:
    """What this backend cannot run beyond its keywords (../keywords.py), as a clear error. Every
    condition is one every rank of an SPMD program sees alike (the padding mask is agreed on in
    burst_attention_mask)."""
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation={name!r} got {query.shape[2]} queries against {key.shape[2]} keys: burst attends a "
            "shard's queries to the same shard's keys. Cached decoding needs burst's sharded KV cache: "
            f"model.generate(ids, {generate_cache_keyword()}=bt.ShardedCache(model)) (import "
            "burst.integrations.transformers as bt); a model that adds keys of its own (compressed or memory tokens) "
            "is not supported")
    if attention_mask is not None and not getattr(attention_mask, "_burst_placeholder", False):
        raise ValueError(f"attn_implementation={name!r} got an attention mask it cannot apply "
                         f"(shape {tuple(attention_mask.shape)}); pass no mask, or packed position_ids")


def burst_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                         mask_function=None, attention_mask: torch.Tensor | None = None, config=None, **kwargs):
    """transformers' mask interface: burst needs no mask tensor (causality, windows and documents
    are its own options), so this returns None; a padding mask with holes raises on every rank.

    Called once per forward on every rank, so the padding check is agreed on here, not per layer.
    """
    name = getattr(config, "_attn_implementation", None)
    backend = BACKENDS.get(name)
    problem = None
    group = backend.group if backend is not None else None
    world = world_size(group)
    try:
        check_config(name, config, world)
    except ValueError as err:  # every rank runs the same model: the agreement below raises it everywhere
        problem = err
    if problem is None and attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        problem = ValueError(
            f"attn_implementation={name!r}: the attention_mask has padding (zeros); burst runs whole "
            "sequences only. Pack documents into one row instead (position_ids restarting at 0 per document "
            "become burst's cu_seqlens), or pad at the end with labels -100 and pass no attention_mask")
    agree("burst (transformers mask)", {} if problem is None else None, problem, group, world)
    return _placeholder(batch_size, q_length, kv_length, kwargs.get("device")) if _indexed(config) else None


def _indexed(config) -> bool:
    """A model whose V3.2-style indexers slice the attention mask (DeepSeek-V4's use none)."""
    text = text_config(config)
    return bool(getattr(text, "index_topk", None)) and not (compressed.prepared(config) or compressed.prepared(text))


def _placeholder(batch_size: int, q_length: int, kv_length: int, device) -> torch.Tensor:
    """A mask that is never applied, for DeepSeek sparse attention's layers, which slice the attention
    mask (`attention_mask[:, 0]`) to hand it to their indexer before calling the attention function:
    burst's indexer builds its own (layers/indexer.py) and the attention function ignores this one.
    An expanded view of one element: nothing of (batch, 1, q, kv) is allocated."""
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
    mask._burst_placeholder = True
    return mask
