"""burst as a transformers attention implementation: `register` puts the attention function and the
mask function under a name, through transformers' own interfaces (AttentionInterface for the
attention function, AttentionMaskInterface so transformers never builds an N x N mask): no model code
is patched.

Every layer's attention call checks the model (checks.check_config) and its keywords
(../keywords.py), runs a ShardedCache's decode step when generate() is decoding on one (the running
cache, registry.py), and otherwise runs burst.attention on this rank's shard. What a model feature
adds (positions kept on a layer, Doge's bias, MLA's latent, DeepSeek-V4's compressed entries...) is
checked, taken and handed to burst by its entry of features.py. What the backend cannot do raises on
every rank.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from burst.launch import under_torchrun
from burst.parent_watch import end_with_launcher
from burst import api
from burst import layout as layout_mod
from burst.agreement import agree

from ..decoding import chosen_positions
from ..keywords import check_keywords, generate_cache_keyword
from ..layers import compressed
from ..layers.configs import text_config
from . import features
from .checks import check_config
from .features import LayerCall
from .registry import BACKENDS, Backend, backend_of, inside_generate, running_cache, world_size

TESTED_TRANSFORMERS = ">=5.23.0,<6"  # the `hf` extra of pyproject.toml: the releases scripts/test.sh tests


TRANSFORMERS_OWN = ("eager", "sdpa", "flex_attention", "paged_attention")  # and the flash ones, refused by name


def register(name: str = "burst", *, strategy: str = "burst", layout: str = "contiguous", group=None, **options) -> str:
    """Register burst as attention implementation `name`; returns the name for `attn_implementation`.

    strategy, layout and group are those of `burst.attention`; **options are the strategy's own
    options (chunk_rows, backward_side...) and burst.attention's `topology` and `block_sparse`. The
    rest of burst.attention's keywords (causal, window, softmax_scale, sinks, softcap...) come from
    each layer's config and call, so passing one here raises, as does an option the strategy does not
    take. The batch must be sharded with the same layout and group (`shard_batch`). Registering a name
    again replaces its settings.
    """
    interfaces = _transformers_interfaces()
    if layout not in layout_mod.DOCUMENT_LAYOUTS:  # doc_*: the documents come with each batch's position_ids
        layout_mod.check_layout(layout)
    if "flash" in name or "/" in name or ":" in name:  # transformers routes such names to its flash / hub kernels
        raise ValueError(
            f"name {name!r}: transformers treats names containing 'flash', '/' or ':' as its own "
            "flash-attention or hub kernels; choose another (e.g. 'burst')"
        )
    if name in TRANSFORMERS_OWN or name.endswith("_paged"):  # replaced for every model of the process, undone never
        raise ValueError(f"name {name!r} is one of transformers' own attention implementations; choose another")
    if strategy not in api.STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {api.STRATEGY_NAMES}, got {strategy!r}")
    _check_options(strategy, options)
    BACKENDS[name] = Backend(strategy, layout, group, dict(options))
    if under_torchrun():  # a Trainer's ranks never pass through burst.launch: they end with torchrun's agent too
        end_with_launcher(None)
    attention_interface, mask_interface = interfaces
    attention_interface.register(name, burst_attention_forward)
    mask_interface.register(name, burst_attention_mask)
    return name


# burst.attention's keywords a registered backend may set; the others come from each layer's call
REGISTERED_KEYWORDS = ("topology", "block_sparse")


def _check_options(strategy: str, options: dict) -> None:
    """ValueError for a burst.attention keyword the layers set themselves, or an option the strategy
    (for "auto": every strategy) does not take, before any model runs."""
    from burst.strategies import check_options

    per_layer = sorted(set(options) & set(inspect.signature(api.attention).parameters) - set(REGISTERED_KEYWORDS))
    if per_layer:
        raise ValueError(
            f"register(): {', '.join(per_layer)}: set by each layer from its config and call (causal, window, "
            f"scale, sinks, softcap...), not by the backend, which takes the strategy's options and "
            f"{', '.join(REGISTERED_KEYWORDS)}"
        )
    check_options("register()", strategy, {k: v for k, v in options.items() if k not in REGISTERED_KEYWORDS})


def _transformers_interfaces():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"burst.integrations.transformers needs transformers and accelerate: pip install "
            f"'transformers{TESTED_TRANSFORMERS}' 'accelerate>=1.1' (or, from a clone of burst, pip install '.[hf]')"
        ) from err
    _warn_if_untested()
    return AttentionInterface, AttentionMaskInterface


@functools.lru_cache(maxsize=None)
def _warn_if_untested() -> None:
    """Once a process: transformers outside TESTED_TRANSFORMERS. What the backend relies on in transformers
    (its interfaces, keywords, configs, the Trainer's loss arithmetic) changes between releases; 5.17's
    Trainer, for one, left sequence-parallel losses 1/sp_size of one process's (trainer.py refuses it)."""
    import transformers
    from packaging.specifiers import SpecifierSet

    if transformers.__version__ not in SpecifierSet(TESTED_TRANSFORMERS, prereleases=True):
        warnings.warn(
            f"burst's transformers backend is tested on transformers{TESTED_TRANSFORMERS}, not on "
            f"{transformers.__version__}: pip install 'transformers{TESTED_TRANSFORMERS}'",
            stacklevel=4,  # the caller of register
        )


def burst_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface on burst.attention.

    query: (batch, heads, seq_local, head_dim); key, value: (batch, kv_heads, seq_local, head_dim),
    this rank's shard. Returns (out (batch, seq_local, heads, head_dim), None). Keywords: those of
    keywords.ACCEPTED_KEYWORDS; any other raises (deny by default). What a family adds (a bias, a
    latent, compressed entries...) is handed over by its entry of features.FEATURES.
    """
    name, backend = backend_of(module)
    check_config(name, getattr(module, "config", None), world_size(backend.group))
    check_keywords(name, module, kwargs)
    cache = running_cache()
    call = LayerCall(
        name,
        module,
        backend,
        query,
        key,
        value,
        attention_mask,
        kwargs,
        decoding=cache is not None and cache.phase == "decode",
        scaling=kwargs.get("scaling"),
        sliding_window=kwargs.get("sliding_window"),
    )
    features.run("check", call)
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")  # GPT-OSS's name, others'
    if call.decoding:
        block_size = getattr(getattr(module, "indexer", None), "block_size", None)
        chosen = chosen_positions(kwargs, block_size, cache.seen + 1)
        return cache.attend(module, query, call.key, call.value, call, sinks, chosen), None
    if cache is None:  # a ShardedCache's prefill runs below
        _refuse_generate_without_cache(name)
    features.run("take", call)
    _refuse_unsupported(call)
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if not causal and getattr(getattr(module, "config", None), "use_bidirectional_attention", False):
        raise ValueError(  # PaliGemma's: not causal by the layer, causal by the mask (with prefix blocks)
            f"attn_implementation={name!r}: {call.model} has use_bidirectional_attention, and its attention follows "
            "the mask transformers builds (causal, with bidirectional blocks: a prefix, images), which burst does "
            "not build; not supported across ranks"
        )
    if cache is not None and not causal:  # a ShardedCache's prefill: the same layer on every rank
        raise ValueError(
            f"attn_implementation={name!r}: generate() on a ShardedCache needs causal attention, and "
            f"{type(module).__name__} attends both ways (an encoder run as a language model, such as BERT without "
            "is_decoder=True): transformers runs its whole sequence again at every step, which no cache can"
        )
    window = None
    if call.sliding_window is not None:  # transformers: key j attends when j > i - sliding_window
        if isinstance(call.sliding_window, bool) or not isinstance(call.sliding_window, int) or call.sliding_window < 1:
            raise ValueError(  # 0 would become burst's (-1, 0), no window at all
                f"attn_implementation={name!r}: {call.model} passes sliding_window={call.sliding_window!r}; a window "
                "is a whole number of keys, at least 1 (the query's own): fix the config's sliding_window"
            )
        window = (call.sliding_window - 1, 0 if causal else call.sliding_window - 1)
    call.query, call.key, call.value = _one_dtype(call.query, call.key, call.value)
    if call.scaling is None:
        call.scaling = call.query.shape[-1] ** -0.5
    features.run("hand", call)
    handed = {"indices": kwargs.get("indices"), **call.burst}  # a feature's selection (BlockIndices) or DSA's
    out = api.attention(
        *_transposed(call),
        group=backend.group,
        strategy=backend.strategy,
        layout=backend.layout,
        causal=causal,
        window=window,
        softmax_scale=call.scaling,
        sinks=sinks,
        softcap=call.softcap,
        chunk_size=call.chunk_size,
        **handed,
        **backend.options,
    )
    return out[..., : call.width], None


def _transposed(call: LayerCall) -> tuple:
    """(q, k, v) in burst's (batch, seq_local, heads, head_dim), k, v None where a feature handed them
    otherwise; v is k when the layer passed one tensor as both, so one block travels."""
    if call.key is None:
        return call.query.transpose(1, 2), None, None
    key = call.key.transpose(1, 2)
    return call.query.transpose(1, 2), key, key if call.values_are_keys else call.value.transpose(1, 2)


def _refuse_generate_without_cache(name: str) -> None:
    """generate() without a ShardedCache raises: every rank would run the whole prompt and decode
    against a whole, unsharded cache."""
    if not torch.is_grad_enabled() and inside_generate():  # generate runs under no_grad: training skips the walk
        raise ValueError(
            f"attn_implementation={name!r}: model.generate() needs {generate_cache_keyword()}=bt.ShardedCache(model), "
            "or **bt.sharded_cache(model) (import burst.integrations.transformers as bt). Without it every rank would "
            "run the whole prompt and decode against a whole, unsharded cache. (Where a ShardedCache was given, one of "
            "generate()'s forwards ran without it, as guidance_scale's unconditional pass does: not supported across "
            "ranks)"
        )


def _one_dtype(query, key, value):
    """q, k, v in one dtype, as SDPA and transformers' flash path take them: the autocast dtype under
    torch.autocast (RoPE hands q, k in float32 beside a bf16 v; burst.attention casts them), else
    the widest of the three."""
    if torch.is_autocast_enabled(query.device.type):
        return query, key, value
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _refuse_unsupported(call: LayerCall) -> None:
    """What this backend cannot run beyond its keywords (../keywords.py) and the features' hand-offs, as
    a clear error. Every condition is one every rank of an SPMD program sees alike (the padding mask is
    agreed on in burst_attention_mask)."""
    name, query, key, attention_mask = call.name, call.query, call.key, call.attention_mask
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation={name!r} got {query.shape[2]} queries against {key.shape[2]} keys: burst attends a "
            "shard's queries to the same shard's keys. Cached decoding needs burst's sharded KV cache: "
            f"model.generate(ids, {generate_cache_keyword()}=bt.ShardedCache(model)) (import "
            "burst.integrations.transformers as bt); a model that adds keys of its own (compressed or memory tokens) "
            "is not supported"
        )
    if attention_mask is not None and not getattr(attention_mask, "_burst_placeholder", False):
        raise ValueError(
            f"attn_implementation={name!r} got an attention mask it cannot apply "
            f"(shape {tuple(attention_mask.shape)}); pass no mask, or packed position_ids"
        )


def burst_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    config=None,
    **kwargs,
):
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
            "become burst's cu_seqlens), or pad at the end with labels -100 and pass no attention_mask"
        )
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
