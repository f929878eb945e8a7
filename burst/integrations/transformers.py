"""Run any Hugging Face transformers model's attention sequence-parallel through burst.

Registered through transformers' own interfaces (AttentionInterface for the attention function,
AttentionMaskInterface so transformers never builds an N x N mask): no model code is patched.

    import burst.integrations.transformers as bt

    name = bt.register(strategy="burst", layout="zigzag")        # -> "burst"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, layout="zigzag", model=model)
    loss = model(**batch).loss            # this rank's share of the global mean loss
    loss.backward()
    bt.reduce_gradients(model)            # sum the ranks' shares: the single-process gradients
    total = bt.reduce_loss(loss)          # the single-process mean loss, on every rank

Every rank runs the model on its shard of the sequence. `shard_batch` gives each rank its tokens
with `position_ids` at their *global* positions (so RoPE is right under zigzag / striped) and labels
shifted on the global sequence. Packed sequences (position_ids restarting at 0 for each document in
a row, transformers' packing convention) become burst's `cu_seqlens`, computed on the global
positions, so packed training needs no padding. What the backend cannot do raises on every rank:
padding masks with holes, dropout and `output_attentions=True`. Generation: `model.generate(ids,
past_key_values=ShardedCache(model))` prefills sequence-parallel and decodes on a sharded KV cache
(transformers_generate.py); generate() without it raises. FSDP2: `fully_shard(model)` here, or
torch's own, with `reduce_gradients` (which sees FSDP-managed gradients). Under torch.autocast q, k,
v run in the autocast dtype. layout="doc_zigzag" / "doc_contiguous" cut each packed document on its own.
Hybrid models (gated delta net, Mamba / Mamba2 layers, short convolutions: hf_mixers.FAMILIES) pass
their recurrent state across ranks once `shard_mixers(model, group, layout)` (or shard_batch(...,
model=model)) has hooked them; until then more than one rank is refused.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import api, layout as layout_mod
from ..agreement import agree
from ..comm.collectives import all_reduce_in_place
from .hf_backends import BACKENDS, Backend, backend_of
from .hf_mixers import shard_mixers
from .hf_keywords import check_backend_compatible, check_config, check_keywords, check_model_features, model_name

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
            f"burst.integrations.transformers needs transformers{TESTED_TRANSFORMERS}: pip install 'burst[hf]'"
        ) from err
    return AttentionInterface, AttentionMaskInterface


def burst_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface on burst.attention.

    query: (batch, heads, seq_local, head_dim); key, value: (batch, kv_heads, seq_local, head_dim),
    this rank's shard. Returns (out (batch, seq_local, heads, head_dim), None). Keywords: those of
    hf_keywords.ACCEPTED_KEYWORDS; any other raises (deny by default).
    """
    name, backend = backend_of(module)
    check_config(name, getattr(module, "config", None), _world(backend.group))
    check_keywords(name, module, kwargs)
    scaling, sliding_window = kwargs.get("scaling"), kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    check_model_features(name, module, sliding_window)
    from . import transformers_generate  # generate(): decode steps on a ShardedCache (imports transformers)
    decoded = transformers_generate.generate_attention(name, module, query, scaling, sliding_window, sinks)
    if decoded is not None:
        return decoded
    _refuse_unsupported(name, query, key, attention_mask)
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = None
    if sliding_window is not None:  # transformers: key j attends when j > i - sliding_window
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    positions = kwargs.get("position_ids")
    if positions is None:  # an attention module that takes position_ids but keeps them (hf_mixers captures them)
        positions = getattr(module, "_burst_position_ids", None)
    if positions is None:
        raise ValueError(
            f"attn_implementation={name!r}: {model_name(module)} does not pass position_ids to its attention "
            "function, so burst can neither check that the shards sit at their global positions nor see packed "
            "documents; refused (models that do pass them: Llama, Qwen, Mistral, GPT-OSS, ...; a model prepared "
            "by bt.shard_batch(..., model=model) or SequenceParallelTrainer has them captured)")
    cu_seqlens = _documents(positions, query.shape[0], query.shape[2], backend)
    query, key, value = _one_dtype(query, key, value)
    out = api.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=backend.group,
                        strategy=backend.strategy, layout=backend.layout, causal=causal, window=window,
                        softmax_scale=scaling, cu_seqlens=cu_seqlens, sinks=sinks, **backend.options)
    return out, None


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _one_dtype(query, key, value):
    """q, k, v in one dtype, as SDPA and transformers' flash path take them: the autocast dtype under
    torch.autocast (RoPE hands q, k in float32 beside a bf16 v; burst.attention casts them), else
    the widest of the three."""
    if torch.is_autocast_enabled(query.device.type):
        return query, key, value
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _refuse_unsupported(name, query, key, attention_mask) -> None:
    """What this backend cannot run beyond its keywords (hf_keywords), as a clear error. Every
    condition is one every rank of an SPMD program sees alike (the padding mask is agreed on in
    burst_attention_mask)."""
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation={name!r} got {query.shape[2]} queries against {key.shape[2]} keys: burst attends a "
            "shard's queries to the same shard's keys. Cached decoding needs burst's sharded KV cache: "
            "model.generate(ids, past_key_values=bt.ShardedCache(model)) (import burst.integrations.transformers as "
            "bt); a model that adds keys of its own (compressed or memory tokens) is not supported")
    if attention_mask is not None:
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
    world = _world(group)
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
    return None


class _DocumentCache:
    """cu_seqlens of the last position_ids tensor seen: every layer of one forward passes the same
    tensor, so the gather runs once per forward (on every rank alike, as all ranks run the same model)."""

    def __init__(self):
        self.ref, self.version, self.value = None, None, None

    def get(self, position_ids):
        if self.ref is not None and self.ref() is position_ids and self.version == position_ids._version:
            return True, self.value
        return False, None

    def put(self, position_ids, value):
        self.ref, self.version, self.value = weakref.ref(position_ids), position_ids._version, value


_document_cache = _DocumentCache()


def _documents(position_ids, batch: int, local_len: int, backend: Backend):
    """burst's cu_seqlens from transformers' packing convention, on the global positions, or None.

    position_ids: (batch or 1, seq_local) at global positions in the layout's order (shard_batch).
    """
    if position_ids is None:
        raise ValueError("burst's transformers backend needs position_ids at global positions: "
                         "shard the batch with burst.integrations.transformers.shard_batch")
    hit, value = _document_cache.get(position_ids)
    if hit:
        return value
    world = dist.get_world_size(backend.group) if dist.is_initialized() else 1
    local = position_ids.expand(batch, local_len).to(torch.long)
    if backend.layout in layout_mod.DOCUMENT_LAYOUTS:
        value = _documents_cut_per_document(local, world, backend)
    else:
        full = layout_mod.unshard(local.contiguous(), group=backend.group, layout=backend.layout, dim=1)
        value = documents_from_positions(full, world, backend.layout)
    _document_cache.put(position_ids, value)
    return value


def _documents_cut_per_document(local: torch.Tensor, world: int, backend: Backend) -> list[int]:
    """Global cu_seqlens when each document is cut on its own (doc_contiguous / doc_zigzag).

    Rank 0 holds the first part of every document, so its positions restart at 0 once per document,
    and it holds 1/G of each: document d has G times the tokens rank 0 holds of it. Every rank's
    positions are then checked against that layout (the model's own 0..n-1 would not pass).
    """
    gathered = layout_mod.unshard(local.contiguous(), group=backend.group, layout="contiguous", dim=1)
    n = local.shape[1]
    first = gathered[0, :n]
    starts = (first == 0).nonzero().flatten().tolist()
    cu = [0]
    for start, stop in zip(starts, starts[1:] + [n]):
        cu.append(cu[-1] + (stop - start) * world)
    split = backend.layout.removeprefix("doc_")
    expected = None
    if starts[:1] == [0] and cu[-1] == n * world:
        try:
            doc_layout = layout_mod.DocumentLayout(tuple(cu), split)
            doc_layout.check(world, cu[-1])
            expected = _positions_in_documents(doc_layout, world, n)
        except ValueError:
            expected = None
    if expected is None or not bool((gathered == expected).all()):
        raise ValueError(
            f"position_ids are not global positions in layout={backend.layout!r} order: each document's positions "
            "must restart at 0 and rise by 1, cut per document. Shard the batch with "
            f"burst.integrations.transformers.shard_batch(batch, layout={backend.layout!r})")
    return cu


def _positions_in_documents(doc_layout, world: int, n: int) -> torch.Tensor:
    """(world * n,) every rank's tokens' positions inside their documents, rank after rank."""
    starts = torch.tensor(doc_layout.cu_seqlens[:-1])
    out = []
    for r in range(world):
        g = torch.cat([seg.positions() for seg in layout_mod.segments(doc_layout, r, world, n)])
        out.append(g - starts[torch.bucketize(g, starts, right=True) - 1])
    return torch.cat(out)


def documents_from_positions(positions: torch.Tensor, world: int, layout: str) -> list[int] | None:
    """cu_seqlens over the global sequence from position ids (batch, seq_len) in global order:
    a document starts where the position restarts at 0. None for one plain sequence per row.

    Raises ValueError for positions that are not global positions (the model's default arange of a
    local shard, or a batch sharded in another layout) and for rows packed differently.
    """
    batch, seq_len = positions.shape
    starts_row = positions[:, 1:] != positions[:, :-1] + 1
    # Each rank's own 0..n-1 (what the model makes when no position_ids are passed) would read as
    # world documents under the contiguous layout: refuse it rather than cut the sequence silently.
    own_aranges = world > 1 and bool((positions == _rank_local_aranges(world, layout, seq_len)).all())
    if own_aranges or bool((positions[:, 0] != 0).any()) or bool((positions[:, 1:][starts_row] != 0).any()):
        hint = " (they are each rank's own 0..n-1: the model made them because none were passed)" if own_aranges else ""
        raise ValueError(
            f"position_ids are not global positions in layout={layout!r} order{hint}: every run must start "
            "at 0 (a new document) and rise by 1. Shard the batch with "
            f"burst.integrations.transformers.shard_batch(batch, layout={layout!r})")
    if not bool((starts_row == starts_row[:1]).all()):
        raise ValueError("packed rows must share their document boundaries (burst's cu_seqlens applies to "
                         "every row); pack into batch 1, or make the rows' documents line up")
    starts = (torch.nonzero(starts_row[0]).flatten() + 1).tolist()
    if not starts:
        return None
    return [0, *starts, seq_len]


def _rank_local_aranges(world: int, layout: str, seq_len: int) -> torch.Tensor:
    """The global-order positions seen when every rank passes arange(seq_len // world)."""
    local = seq_len // world
    full = torch.empty(seq_len, dtype=torch.long)
    for r in range(world):
        full[layout_mod.shard_indices(layout, r, world, seq_len)] = torch.arange(local)
    return full


def check_model(model: torch.nn.Module) -> None:
    """Raise ValueError for a model burst cannot run exactly: its attention implementation is not one
    registered with burst, or transformers marks its class as not running on custom attention
    backends (Mamba, RWKV and the hybrids mix tokens outside attention; some families compute
    attention in their own code). Those never call burst's attention function, so this is the check
    that sees them: shard_batch(..., model=model), reduce_gradients, fully_shard and ShardedCache run
    it (once per model)."""
    name, backend = backend_of(model)
    if name in _checked_models.get(model, ()):
        return
    check_backend_compatible(name, model)
    check_config(name, model.config, _world(backend.group))
    _checked_models.setdefault(model, set()).add(name)


_checked_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> backend names it passed


_MODEL_NOT_GIVEN = object()


def shard_batch(batch: dict, group=None, layout: str = "contiguous", ignore_index: int = -100,
                model: torch.nn.Module = _MODEL_NOT_GIVEN) -> dict:
    """This rank's shard of a batch of full sequences, ready for `model(**shard)`.

    batch: `input_ids` (batch, seq_len), optional `labels` (same shape), `position_ids` (made as
    0..seq_len-1 when absent; give them restarting at 0 per document for packed rows) and
    `attention_mask` (all ones only). Returns input_ids and position_ids sharded along the sequence
    by `layout` (position ids keep their global values; "doc_zigzag" / "doc_contiguous" cut each
    packed document on its own, its length a multiple of 2G / G); with labels, `labels`/`shift_labels` are the
    labels shifted on the *global* sequence (each token's next token; shifting a shard would pair
    tokens across shard boundaries) and `num_items_in_batch` is the global count of labelled
    tokens, so the model's loss is this rank's share of the global mean (see reduce_loss). Other
    entries are passed through unchanged.

    model (required): the model the batch is for. Its recurrent and convolutional layers are made to
    pass their state across the ranks and its rotary embedding to see the whole length (shard_mixers),
    then it is checked (check_model). This is the only place burst sees a model that never calls
    attention (Mamba, RWKV) or runs attention of its own (GPT-1, XLM...): sharded without it, such a
    model runs each shard alone and answers wrongly without an error, so there is no way around it.
    """
    model = _the_model(model)
    shard_mixers(model, group, layout)
    check_model(model)
    if layout not in layout_mod.DOCUMENT_LAYOUTS:
        layout_mod.check_layout(layout)
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
    check_same_batch(batch, group)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError("attention_mask has padding (zeros); burst runs whole sequences: pack documents "
                         "into one row (position_ids restarting at 0 per document) or pad at the end with labels "
                         f"{ignore_index} and drop the attention_mask")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if layout in layout_mod.DOCUMENT_LAYOUTS:  # each packed document cut on its own
        cu = documents_from_positions(positions.expand_as(ids), 1, "contiguous") or [0, ids.shape[1]]
        layout = layout_mod.DocumentLayout(tuple(cu), layout.removeprefix("doc_"))
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids", "attention_mask")}
    out["input_ids"] = layout_mod.shard(ids, group=group, layout=layout, dim=1)
    out["position_ids"] = layout_mod.shard(positions.expand_as(ids), group=group, layout=layout, dim=1)
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.full_like(labels, ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        local = layout_mod.shard(shifted, group=group, layout=layout, dim=1)
        out["labels"] = local  # makes the model compute its loss; shift_labels tells it not to shift again
        out["shift_labels"] = local
        out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    return out


def _the_model(model) -> torch.nn.Module:
    """shard_batch's model, out of a DDP wrapper; TypeError when none was given."""
    if model is _MODEL_NOT_GIVEN or model is None:
        raise TypeError(
            "shard_batch(batch, ..., model=model) needs the model the batch is for: burst checks and prepares it "
            "there (a model that never calls attention, such as Mamba or RWKV, or that runs its own, such as GPT-1 "
            "or XLM, would otherwise run each rank's shard alone and give wrong logits without an error)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def check_same_batch(batch: dict, group=None) -> None:
    """ValueError on every rank of `group` unless every rank holds the same input_ids, labels and
    position_ids (a digest of their bytes, agreed in one small collective). A sequence-parallel group
    splits *one* batch: a sampler that hands each rank of the group its own sequences (a
    DistributedSampler over the whole world) would have burst join shards of unrelated sequences."""
    world = _world(group)
    if world == 1:
        return
    facts = {key: _content_digest(batch[key]) for key in ("input_ids", "labels", "position_ids")
             if isinstance(batch.get(key), torch.Tensor)}
    hint = ("; the ranks of a sequence-parallel group must hold the same batch (each shards it): sample over "
            "the data-parallel replicas only, e.g. DistributedSampler(num_replicas=world // G, rank=rank // G)")
    agree("burst.shard_batch", facts, None, group, world, hints={key: hint for key in facts})


def _content_digest(t: torch.Tensor) -> str:
    import hashlib

    data = t.detach().to("cpu").contiguous()
    return f"{tuple(t.shape)} {hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()}"


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The global mean loss on every rank from each rank's share (the model's loss on a shard_batch
    shard, which divides by the global token count). Detached: backward runs on each rank's own loss."""
    total = loss.detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def reduce_gradients(model: torch.nn.Module, group=None) -> None:
    """Make every parameter gradient the single-process one, once per step after backward.

    Each rank's gradient holds its tokens' share of the global mean loss, so the shares are summed
    over the sequence-parallel `group`. Parameters managed by FSDP2 (`fully_shard`, ours below or
    torch's) were already reduce-scattered over FSDP's mesh during backward; FSDP *averages* there
    by default, which left alone makes every gradient 1/G of the true one. Their shards are scaled
    to the sum over the group (a mean over the mesh's other, data-parallel ranks) and, when FSDP's
    mesh does not contain the group, summed over the group as well.
    """
    check_model(model)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    all_reduce_in_place((g for g in grads if not _is_dtensor(g)), group=group)
    sharded: dict[tuple, list] = {}
    for unit, g in _grads_by_unit(model):
        key = (_mesh_ranks(g.device_mesh), _divide_factor(unit, g.device_mesh))
        sharded.setdefault(key, []).append(g.to_local())
    for (fsdp_ranks, factor), local in sharded.items():
        scale, sum_over_group = fsdp_reduction(fsdp_ranks, _group_ranks(group), factor)
        if scale != 1:
            torch._foreach_mul_(local, scale)
        if sum_over_group:
            all_reduce_in_place(local, group=group)


def fully_shard(model: torch.nn.Module, mesh=None, group=None, **fsdp_kwargs) -> torch.nn.Module:
    """FSDP2 for a model on burst's backend: each decoder layer (the model's `_no_split_modules`)
    and the root, over `mesh` (default: a 1-D mesh over the world), with the gradient divide factor
    that makes FSDP's reduce-scatter give the single-process gradients (summed over the sequence-
    parallel `group`, averaged over data-parallel ranks); sum-only collectives, as gloo needs.
    `reduce_gradients(model)` after backward then does only what FSDP's reduction cannot (nothing
    when the mesh contains the group). fsdp_kwargs go to torch's fully_shard (mp_policy, ...).
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    check_model(model)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise NotImplementedError(f"fully_shard takes a 1-D mesh (got {mesh.ndim}-D): pass mesh['dp'] or a "
                                  "flattened mesh; hybrid sharding is not supported by the backend yet")
    scale, _ = fsdp_reduction(_mesh_ranks(mesh), _group_ranks(group), 1.0)
    factor = 1.0 / scale  # the factor for which reduce_gradients' scale is 1
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in layer_names] + [model]
    for unit in units:
        torch_fully_shard(unit, mesh=mesh, **fsdp_kwargs)
        unit.set_gradient_divide_factor(factor)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch >= 2.7; gloo has no PREMUL_SUM
            unit.set_force_sum_reduction_for_comms(True)
        unit._burst_divide_factor = factor
    return model


def fsdp_reduction(fsdp_ranks: tuple[int, ...], group_ranks: tuple[int, ...], factor: float) -> tuple[float, bool]:
    """(scale, sum_over_group) that turn FSDP's reduce-scatter over `fsdp_ranks` (the sum divided by
    `factor`) into the single-process gradient: summed over the sequence-parallel `group_ranks`,
    averaged over the data-parallel replicas. One rule for fully_shard and reduce_gradients.

    The group inside the mesh: the mesh holds |mesh| / |group| replicas, so scale = factor |group| /
    |mesh|. The group across the mesh (FSDP over data-parallel ranks only): scale = factor / |mesh|,
    then a sum over the group.
    """
    mesh, sp = set(fsdp_ranks), set(group_ranks)
    if sp <= mesh:
        return factor * len(sp) / len(mesh), False
    if len(mesh & sp) == 1:
        return factor / len(mesh), True
    raise NotImplementedError(f"FSDP's mesh (ranks {sorted(mesh)}) and burst's sequence-parallel group (ranks "
                              f"{sorted(sp)}) overlap in part: shard over the group's ranks, every rank, or "
                              "one rank of each group (data parallel)")


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _fsdp_units(model):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _grads_by_unit(model) -> list[tuple]:
    """(unit, gradient) for each FSDP-managed gradient: the innermost unit holding the parameter
    manages it (model.modules() lists a unit before the units nested in it)."""
    owner = {}
    for unit in _fsdp_units(model):
        for p in unit.parameters():
            owner[id(p)] = (unit, p)
    return [(unit, p.grad) for unit, p in owner.values() if p.grad is not None and _is_dtensor(p.grad)]


def _mesh_ranks(mesh) -> tuple[int, ...]:
    if mesh.ndim != 1:
        raise NotImplementedError("reduce_gradients takes FSDP over a 1-D mesh; hybrid sharding is not supported")
    return tuple(dist.get_process_group_ranks(mesh.get_group()))


def _group_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _divide_factor(unit, mesh) -> float:
    """The factor FSDP divided this unit's gradients by: ours (fully_shard above), one set by hand
    (read where this PyTorch keeps it), else FSDP's default, the mesh size."""
    ours = getattr(unit, "_burst_divide_factor", None)
    if ours is not None:
        return ours
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    for param_group in groups:
        factor = getattr(param_group, "gradient_divide_factor", None)
        if factor is not None:
            return float(factor)
    return float(mesh.size())


def __getattr__(attr: str):
    # ShardedCache and SequenceParallelTrainer subclass transformers' classes: imported on first use.
    if attr == "ShardedCache":
        from .transformers_generate import ShardedCache

        return ShardedCache
    if attr == "SequenceParallelTrainer":  # imports transformers' Trainer (and accelerate)
        from .transformers_trainer import SequenceParallelTrainer

        return SequenceParallelTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
