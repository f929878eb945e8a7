"""The model features burst's transformers backend hands off, one entry each: FEATURES.

Families ask more of attention than q, k, v: Doge a bias per key, MLA a latent instead of heads,
DeepSeek-V4 compressed entries beside its keys, some layers positions they keep to themselves. Each
such feature is one `Feature`, read by every door: `prepare_features` (shard_batch, SequenceParallel,
SequenceParallelTrainer) prepares the model with each entry's `prepare`, and the attention function
(attention.py) runs the `check`, `take` and `hand` of the entries whose `detect` matches the layer on
a LayerCall, in FEATURES' order. A new family adds one entry. The prepares, and the detects that are
more than a layer kind, are preparations.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from burst import api
from burst import layout as layout_mod

from ..keywords import check_model_features, model_name, window_from_config
from ..layers import block_indexer, compressed, dynamic_mask, latent, positions
from ..layers.mixers import shard_mixers
from ..layers.router_loss import balance_routers_across_ranks
from .documents import documents
from .preparations import (
    capture_positions,
    compress_whole_sequence,
    left_entries,
    move_latents,
    refuse_kept_logits,
    see_global_length,
    show_blocks_whole_sequence,
    show_whole_sequence,
    take_over_dynamic_masks,
    tunes_temperature,
)
from .registry import Backend, world_size


@dataclass
class LayerCall:
    """One layer's call of the attention function on its way to burst.attention; the features edit it.

    query: (batch, heads, seq_local, head_dim); key, value: (batch, kv_heads, seq_local, head_dim), or
    what the layer handed in their place (None once a feature hands burst something else); kwargs: the
    call's keywords (keywords.ACCEPTED_KEYWORDS); decoding: a ShardedCache decode step runs;
    sliding_window, softcap, chunk_size, scaling: as the checks read them; held: what a feature took
    from its layer, by feature name, for its hand; burst: keywords the features add to burst.attention's
    (cu_seqlens=, latent=, compressed=); width: the output's head dim kept (None: all of it); features:
    the entries of FEATURES this layer has, found once (a take may clear what detect reads)."""

    name: str
    module: torch.nn.Module
    backend: Backend | None
    query: torch.Tensor
    key: torch.Tensor | None
    value: torch.Tensor | None
    attention_mask: torch.Tensor | None = None
    kwargs: dict = field(default_factory=dict)
    decoding: bool = False
    sliding_window: int | None = None
    softcap: float = 0.0
    chunk_size: int | None = None
    scaling: float | None = None
    values_are_keys: bool = False
    held: dict = field(default_factory=dict)
    burst: dict = field(default_factory=dict)
    width: int | None = None
    features: tuple = field(init=False, default=())

    def __post_init__(self):
        self.features = tuple(f for f in FEATURES if f.detect(self.module))

    @property
    def model(self) -> str:
        return model_name(self.module)


def _every_layer(module) -> bool:
    return True


@dataclass(frozen=True)
class Feature:
    """One model feature and its hand-off to burst.

    detect(attention module) -> bool: whether a layer has it (the hooks below run only there);
    prepare(model, group, layout): what the doors do to the model first (the layers it takes over);
    check(call): before a decode step too, the settings it reads and ValueError for what burst refuses (in a
    decode step, also what the layer handed that the ShardedCache reads apart);
    take(call): outside decoding, what the layer handed the attention function (ValueError where it is
    not what burst knows); hand(call): what it hands burst, once q, k, v share a dtype and the scale
    is known. Each hook may be None."""

    name: str
    detect: Callable[[torch.nn.Module], bool] = _every_layer
    prepare: Callable | None = None
    check: Callable[[LayerCall], None] | None = None
    take: Callable[[LayerCall], None] | None = None
    hand: Callable[[LayerCall], None] | None = None


# ---- positions: global ones, from the call or kept on the layer ----------------------------------------------


def _hand_documents(call: LayerCall) -> None:
    """cu_seqlens from the shard's global positions (restarts at 0 begin documents)."""
    found = call.kwargs.get("position_ids")
    if found is None:  # an attention module that takes position_ids but keeps them (capture_position_ids)
        found = getattr(call.module, positions.POSITIONS, None)
    if found is None:
        captured = hasattr(call.module, positions.POSITIONS)  # prepared: the modules above it got none either
        advice = (
            "it was prepared, and no module above its attention got position_ids in this forward (a family that "
            "makes its own positions, such as Qwen2-VL's mrope, is not supported across ranks)"
            if captured
            else "models that do pass them: Llama, Qwen, Mistral, GPT-OSS, ...; a model prepared by "
            "bt.shard_batch(..., model=model) or SequenceParallelTrainer has them captured"
        )
        raise ValueError(
            f"attn_implementation={call.name!r}: {call.model} does not pass position_ids to its attention "
            "function, so burst can neither check that the shards sit at their global positions nor see packed "
            f"documents; refused ({advice})"
        )
    call.burst["cu_seqlens"] = documents(found, call.query.shape[0], call.query.shape[2], call.backend)


# ---- DeepSeek-V4: K = V, and compressed entries beside the shard's keys ---------------------------------------


def _take_values_are_keys(call: LayerCall) -> None:
    call.values_are_keys = call.value is call.key  # one block travels for both


def _take_entries(call: LayerCall) -> None:
    """The layer concatenated the entries its compressor made for the whole sequence (layers/compressed.py)
    after this shard's keys: they go to burst.attention apart, as a burst.CompressedKV every rank holds."""
    rate, count, chosen = compressed.pending(call.module)
    local = call.query.shape[2]
    if count == 0 and call.key.shape[2] == local:  # no window has ended yet (a sequence shorter than one)
        return
    if call.key.shape[2] != local + count:
        raise ValueError(
            f"attn_implementation={call.name!r}: {call.model} handed {call.key.shape[2]} keys for "
            f"{local} queries and {count} compressed entries; this transformers release arranges "
            "DeepSeek-V4's attention differently from what burst knows"
        )
    entries = api.CompressedKV(
        call.key[:, :, local:].transpose(1, 2), call.value[:, :, local:].transpose(1, 2), rate, chosen
    )
    call.held["compressed entries"] = entries
    call.key, call.value = call.key[:, :, :local], call.value[:, :, :local]


def _take_decoded_entries(call: LayerCall) -> None:
    """A ShardedCache decode step: the entries the compressor made (layers/compressed.py) leave the keys, held
    with the indexer's choice, (batch, entries) bool, for ShardedCache.attend, which gives each rank its share
    of them beside its cached keys."""
    if not call.decoding:
        return
    found = compressed.pending(call.module)
    if found is None:
        return
    _, count, chosen = found
    if call.key.shape[2] != 1 + count:
        raise ValueError(
            f"attn_implementation={call.name!r}: {call.model} handed {call.key.shape[2]} keys in a decode step "
            f"with {count} compressed entries; this transformers release arranges DeepSeek-V4's attention "
            "differently from what burst knows"
        )
    k, v = call.key[:, :, 1:].transpose(1, 2), call.value[:, :, 1:].transpose(1, 2)  # (batch, entries, kv_heads, d)
    if chosen is None:  # HCA: every entry made so far has ended
        chosen = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
    call.held["decoded entries"] = (k, v, chosen)
    call.key, call.value = call.key[:, :, :1], call.value[:, :, :1]


def _hand_entries(call: LayerCall) -> None:
    entries = call.held.get("compressed entries")
    if entries is not None:  # in the attention's dtype, as q, k, v are
        call.burst["compressed"] = replace(entries, k=entries.k.to(call.query.dtype), v=entries.v.to(call.query.dtype))


# ---- MiniMax-M3: key blocks chosen per KV head by an indexer that sees the whole sequence ---------------------


def _take_block_selection(call: LayerCall) -> None:
    chosen = call.kwargs.get("block_indices")
    if chosen is None:
        return
    if world_size(call.backend.group) > 1 and not block_indexer.prepared(call.module.config):
        raise ValueError(
            f"attn_implementation={call.name!r}: {call.model} picks key blocks with an indexer that must "
            "score every key of the sequence, not its shard's: prepare the model with "
            "bt.shard_batch(..., model=model) (or SequenceParallelTrainer / SequenceParallel)"
        )
    call.held["block selection"] = block_indexer.block_selection(call.module, chosen)


def _hand_block_selection(call: LayerCall) -> None:
    chosen = call.held.get("block selection")
    if chosen is not None:
        call.burst["indices"] = chosen


# ---- Doge: a bias per key instead of a dense mask ---------------------------------------------------------------


def _check_dynamic_mask(call: LayerCall) -> None:
    if call.decoding:  # the ShardedCache reckons every cached key's bias itself (dynamic_mask.decoded_bias)
        dynamic_mask.handed_over(call.module)
        call.attention_mask = None


def _take_bias(call: LayerCall) -> None:
    bias, kept = dynamic_mask.handed_over(call.module)
    if bias is None:  # the layer built its dense mask: refused with the mask
        return
    call.held["dynamic mask"] = bias
    call.held["dynamic mask kept"] = kept()  # past keep_window_size: each row's keys per KV head (collective)
    call.attention_mask = None  # the (batch, heads, 1, keys) mask the layer made of it is consumed


def _hand_bias(call: LayerCall) -> None:
    bias = call.held.get("dynamic mask")
    if bias is not None:  # one more channel: ones in the queries, bias / scale in the keys
        call.query, call.key = dynamic_mask.fold(call.query, call.key, bias, call.scaling)
    kept = call.held.get("dynamic mask kept")
    if kept is not None:
        if call.burst.get("cu_seqlens") is not None:
            raise ValueError(
                f"attn_implementation={call.name!r}: {call.model}'s dynamic mask past keep_window_size="
                f"{call.module.keep_window_size} keys picks each row's keys over one sequence; packed "
                "documents (position_ids restarting inside a row) are refused there"
            )
        call.burst["indices"] = kept


# ---- MLA: the latent and rotary key travel, each rank expands what it holds -----------------------------------


def _take_latent(call: LayerCall) -> None:
    handed = latent.handed_over(call.module, call.key, call.value)
    if handed is not None:
        call.held["latent"] = handed


def _hand_latent(call: LayerCall) -> None:
    """burst.attention(latent=...) in the attention's dtype, as q: no K, V."""
    handed = call.held.get("latent")
    if handed is not None:
        call.burst["latent"] = replace(
            handed, latent=handed.latent.to(call.query.dtype), rope=handed.rope.to(call.query.dtype)
        )
        call.key = call.value = None


# ---- what the config asks of attention beyond the call: windows and chunks, softcap -------------------------


def _take_window_from_config(call: LayerCall) -> None:
    call.sliding_window = window_from_config(call.module, call.sliding_window)  # its model's, on every layer


def _check_windows_and_chunks(call: LayerCall) -> None:
    call.chunk_size = check_model_features(call.name, call.module, call.sliding_window, decoding=call.decoding)


def _check_softcap(call: LayerCall) -> None:
    call.softcap = float(call.kwargs.get("softcap") or 0.0)  # decoding too: decode_attention caps alike


# ---- Llama 4: attention temperature at global indices -----------------------------------------------------------


def _hand_global_temperature(call: LayerCall) -> None:
    call.query = global_temperature(call.name, call.module, call.query, call.backend)


def global_temperature(name: str, module, query: torch.Tensor, backend: Backend) -> torch.Tensor:
    """query (batch, heads, seq_local, head_dim) with Llama 4's attention temperature tuning at the
    rows' global indices. Its NoPE layers scale each query by log1p(floor((i + 1) / floor_scale)) *
    attn_scale + 1 with i = arange(seq_local) of the forward: a rank's own 0..n-1. The factor is
    divided out and the one of the row's place in the whole sequence applied."""
    world, rank = layout_mod._world_and_rank(backend.group)
    if world == 1:
        return query
    if backend.layout not in layout_mod.LAYOUTS:
        raise ValueError(
            f"attn_implementation={name!r}: {model_name(module)} scales queries by their index in the "
            f"sequence (attn_temperature_tuning), which burst applies under {layout_mod.LAYOUTS}, not "
            f"{backend.layout!r}"
        )
    local = query.shape[2]
    mine = layout_mod.shard_indices(backend.layout, rank, world, local * world, device=query.device)
    own = torch.arange(local, device=query.device)

    def factor(i):
        return torch.log1p(torch.floor((i.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    return (query * (factor(mine) / factor(own))[None, None, :, None]).to(query.dtype)


# ---- MLA expanded: values narrower than queries and keys ----------------------------------------------------------


def _hand_one_head_dim(call: LayerCall) -> None:
    """One head dim for q, k, v: MLA's values (DeepSeek: 128) are narrower than its queries and keys (192),
    and burst moves K, V as one shape. The narrower side gets zero columns, which change no score (q, k)
    and no output column that is kept (v)."""
    if call.key is None:
        return
    dim_qk, dim_v = call.query.shape[-1], call.value.shape[-1]
    if dim_qk == dim_v:
        return
    width = max(dim_qk, dim_v)

    def widened(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    call.query, call.key, call.value, call.width = widened(call.query), widened(call.key), widened(call.value), dim_v


# In this order: a take or hand may rely on an earlier entry's (K = V is read before the entries are cut from the
# keys; a window read from the config (Doge's, PhiMoE's) before the config's windows are checked; the positions'
# documents before Doge's kept keys are handed; the bias folded before the head dims are made one).
FEATURES: tuple[Feature, ...] = (
    Feature("positions", prepare=capture_positions, hand=_hand_documents),
    Feature("logits the model keeps", prepare=refuse_kept_logits),
    Feature("rotary embeddings of the whole length", prepare=see_global_length),
    Feature("DeepSeek sparse attention's indexer", prepare=show_whole_sequence),
    Feature(
        "block selection per KV head",
        detect=block_indexer.has_block_indexer,
        prepare=show_blocks_whole_sequence,
        take=_take_block_selection,
        hand=_hand_block_selection,
    ),
    Feature("keys as values", take=_take_values_are_keys),
    Feature(
        "compressed entries",
        detect=left_entries,
        prepare=compress_whole_sequence,
        check=_take_decoded_entries,
        take=_take_entries,
        hand=_hand_entries,
    ),
    Feature("recurrent and convolutional mixers", prepare=shard_mixers),
    Feature("MoE routers' load-balancing loss", prepare=balance_routers_across_ranks),
    Feature("window from the config", check=_take_window_from_config),
    Feature(
        "dynamic mask",
        detect=dynamic_mask.is_dynamic_mask_attention,
        prepare=take_over_dynamic_masks,
        check=_check_dynamic_mask,
        take=_take_bias,
        hand=_hand_bias,
    ),
    Feature("latent", detect=latent.is_latent_attention, prepare=move_latents, take=_take_latent, hand=_hand_latent),
    Feature("windows and chunks in the config", check=_check_windows_and_chunks),
    Feature("softcap", check=_check_softcap),
    Feature("attention temperature", detect=tunes_temperature, hand=_hand_global_temperature),
    Feature("values narrower than keys", hand=_hand_one_head_dim),
)


def prepare_features(model: torch.nn.Module, group=None, layout: str = "contiguous") -> None:
    """Every feature's preparation of `model` for a sequence sharded by `layout` over `group`, in
    FEATURES' order; once per (group, layout), as shard_batch runs it every step."""
    done = getattr(model, "_burst_features", None)
    if done is not None and done.group is group and done.layout == layout:
        return
    for feature in FEATURES:
        if feature.prepare is not None:
            feature.prepare(model, group, layout)
    model._burst_features = _Prepared(group, layout)


class _Prepared:
    """What prepare_features last prepared `model` for. Pickled as nothing: a model loaded from torch.save is
    prepared again (burst's registries of prepared configs and modules are this process's)."""

    __slots__ = ("group", "layout")

    def __init__(self, group, layout):
        self.group, self.layout = group, layout

    def __reduce__(self):
        return (type(None), ())


def run(hook: str, call: LayerCall) -> None:
    """The `hook` ("check", "take" or "hand") of every feature the call's layer has, in FEATURES' order."""
    for feature in call.features:
        step = getattr(feature, hook)
        if step is not None:
            step(call)
