"""A batch of full sequences to this rank's shard (shard_batch), and the loss back (reduce_loss).

shard_batch is also where burst sees the model a batch is for: it prepares the layers each model
feature takes over (features.prepare_features: recurrent mixers, rotary embeddings, MLA's latent...)
and checks it (checks.check_model), the one door that a model which never calls attention (Mamba,
RWKV) passes through.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from burst import layout as layout_mod
from burst.agreement import WEIGHTS, WEIGHTS_HINT, agree, checks_off, collective_device, weights_digest
from burst.comm.membership import group_ranks

from ..keywords import ATTENTION_LAYER_KINDS, layer_kinds
from ..layers.configs import decoder_of, text_config
from .checks import check_model
from .documents import documents_from_positions, masks_read_positions
from .features import prepare_features
from .gradients import averaging_group, ddp_step_problem
from .kept_logits import kept_logits_refusal, keeps_some_logits
from .registry import BACKENDS, registered_group, registered_layout, unwrap_model, world_size

_MODEL_NOT_GIVEN = object()


def shard_batch(
    batch: dict,
    group=None,
    layout: str | None = None,
    ignore_index: int = -100,
    model: torch.nn.Module = _MODEL_NOT_GIVEN,
) -> dict:
    """This rank's shard of a batch of full sequences, ready for `model(**shard)`.

    group: default, the group the model's attention was registered with (another is refused).
    layout: default, the layout the model's attention was registered with ("contiguous" for a model that runs
    no attention of burst's).
    batch: `input_ids` (batch, seq_len), optional `labels` (same shape), `position_ids` (made as
    0..seq_len-1 when absent; give them restarting at 0 per document for packed rows) and
    `attention_mask` (all ones only). Returns input_ids and position_ids sharded along the sequence
    by `layout` (position ids keep their global values; "doc_zigzag" / "doc_contiguous" cut each
    packed document on its own, its length a multiple of 2G / G); with labels, `labels`/`shift_labels` are the
    labels shifted on the *global* sequence (each token's next token; shifting a shard would pair
    tokens across shard boundaries) and `num_items_in_batch` is the global count of labelled
    tokens (where DDP or FSDP averages data-parallel replicas, the mean of the replicas' counts), so the model's
    loss is this rank's share of the global mean (see reduce_loss); labels equal to
    `ignore_index` are handed to the model as -100 (the value its loss ignores); a batch's own
    `shift_labels` (whole sequence, already shifted) and `num_items_in_batch` are kept. Other
    entries of shape (batch, seq_len, ...) (token_type_ids...) are cut as the tokens are; the rest
    are passed through unchanged. Causal LMs only where targets are given (check_head: a sequence
    classifier is refused, and a token classifier's or QA head's targets).

    model (required): the model the batch is for. Each model feature prepares the layers it takes over
    (features.prepare_features: recurrent layers pass their state across the ranks, rotary embeddings
    see the whole length...), then it is checked (check_model). This is the only place burst sees a
    model that never calls attention (Mamba, RWKV) or runs attention of its own (GPT-1, XLM...):
    sharded without it, such a model runs each shard alone and answers wrongly without an error, so
    there is no way around it. A DDP-wrapped model is seen through (torch.compile's too); given the wrapper,
    a step taken without reduce_gradients is refused at the next batch (gradients.ddp_step_problem).
    """
    model, ddp = unwrap_model(_the_model(model))
    group = registered_group(model, group, "shard_batch")
    layout = registered_layout(model, layout)
    if layout not in layout_mod.DOCUMENT_LAYOUTS:
        layout_mod.check_layout(layout)
    ids = batch.get("input_ids")
    if ids is None:
        given = "inputs_embeds" if "inputs_embeds" in batch else f"keys {sorted(batch)}"
        raise ValueError(
            f"shard_batch needs the batch's input_ids (batch, seq_len), got {given}: the token ids are what it cuts, "
            "checks across ranks and shifts the labels on; pass input_ids and let the model embed them"
        )
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
    check_head(model, batch)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    elif positions.dim() > 2:
        raise ValueError(
            f"position_ids of shape {tuple(positions.shape)}: shard_batch takes (batch, seq_len) or (1, seq_len); "
            "multi-dimensional rotary positions (Qwen2-VL's mrope) are not supported across ranks"
        )
    try:
        cu = documents_from_positions(positions.expand_as(ids), 1, "contiguous", before_sharding=True)
    except ValueError as err:  # raised on every rank (a peer's positions may be right)
        check_same_batch(batch, group, model, err)
    if layout in layout_mod.DOCUMENT_LAYOUTS:  # each packed document cut on its own: the features see the cut
        layout = layout_mod.DocumentLayout(tuple(cu or [0, ids.shape[1]]), layout.removeprefix("doc_"))
    prepare_features(model, group, layout)
    check_model(model)
    check_same_batch(batch, group, model, ddp_step_problem(ddp, group) if ddp is not None else None)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError(
            "attention_mask has padding (zeros); burst runs whole sequences: pack documents "
            "into one row (position_ids restarting at 0 per document) or pad at the end with labels "
            f"{ignore_index} and drop the attention_mask"
        )
    _warn_if_packed_rows_differ(batch, positions, model)
    out = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids", "attention_mask")}
    for key, value in out.items():  # per-token entries (token_type_ids...): cut as the tokens are
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == ids.shape:
            out[key] = layout_mod.shard(value, group=group, layout=layout, dim=1)
    out["input_ids"] = layout_mod.shard(ids, group=group, layout=layout, dim=1)
    out["position_ids"] = layout_mod.shard(positions.expand_as(ids), group=group, layout=layout, dim=1)
    labels = batch.get("labels")
    if labels is not None:
        shifted = batch.get("shift_labels")  # the user's own next-token targets, on the whole sequence
        if shifted is None:
            shifted = torch.full_like(labels, ignore_index)
            shifted[:, :-1] = labels[:, 1:]
        if ignore_index != -100:  # the model's loss ignores -100 only: it had counted these in its sum, not its count
            shifted = shifted.masked_fill(shifted == ignore_index, -100)
        local = layout_mod.shard(shifted, group=group, layout=layout, dim=1)
        out["labels"] = local  # makes the model compute its loss; shift_labels tells it not to shift again
        out["shift_labels"] = local
        if batch.get("num_items_in_batch") is None:  # the user's own count (over an accumulated batch) stays
            labelled = int((shifted != -100).sum())
            out["num_items_in_batch"] = _count_for_replicas(labelled, model, ddp, group)
    return out


def _count_for_replicas(labelled: int, model, ddp, group) -> float | int:
    """The count a rank's loss divides by. Without data-parallel replicas, its group's labelled tokens. Where DDP
    or FSDP averages the gradients over replicas (a dp x sp mesh), the mean of the replicas' counts: each replica's
    loss is then its tokens' sum over that mean, and the replicas' average is the mean over every labelled token
    of the global batch, as one process on it (each replica's own count gave the mean of the replicas' means: up to
    1.9x off with 14 and 4 labelled tokens, NaN with none). One all-reduce over the averaging group, in training
    only (evaluation may run on some replicas alone)."""
    averaging = averaging_group(model, ddp, group) if model.training and torch.is_grad_enabled() else None
    if averaging is None:
        return labelled
    total = torch.tensor([float(labelled)], dtype=torch.float64, device=collective_device(averaging))
    dist.all_reduce(total, group=averaging)  # every rank of a replica holds its count: the mean over ranks is theirs
    return total.item() / dist.get_world_size(averaging)


# The loss types of the heads whose labels shard_batch takes: a causal LM's next-token targets (a multimodal
# wrapper's too; None where the model names none: GPT-2's LM head...)
CAUSAL_LOSSES = (None, "ForCausalLM", "ForConditionalGeneration")


# Inputs of a multimodal model's forward that put images, audio or video in (pixel_values, image_grid_thw,
# input_features, mm_encoder_outputs...), matched by part of the name across families: shard_batch's and
# generate()'s (decoding.beyond_a_text_prompt) rule
NON_TEXT_INPUTS = ("pixel", "image", "video", "audio", "input_features", "mm_encoder")


def carries_non_text(name: str) -> bool:
    """Whether an input named `name` carries images, audio or video (by a part of its name)."""
    return any(part in name for part in NON_TEXT_INPUTS)


def marks_non_text(name: str, value) -> bool:
    """Whether `value` is token types (`*token_type_ids`) marking some token as not text."""
    return name.endswith("token_type_ids") and isinstance(value, torch.Tensor) and bool(value.any())


def _has_image_tokens(model) -> bool:
    config = getattr(model, "config", None)
    return any(getattr(config, key, None) is not None for key in ("image_token_id", "image_token_index"))


def check_head(model: torch.nn.Module, batch: dict) -> None:
    """ValueError for what shard_batch would cut silently wrong: a head that pools one token of each row
    (sequence classification: each rank would pool its own shard's), targets that are not a causal LM's
    (labels shard_batch shifts as next tokens; a token classifier's or a span's are not, and their losses
    take no global token count), logits_to_keep (each shard's last tokens, not the sequence's), PEFT's
    prompt learning (virtual tokens before each shard), and inputs beyond text (images' features go to their
    tokens, which the ranks split, and their tokens attend both ways)."""
    name, kind = type(model).__name__, getattr(model, "loss_type", None)
    peft = getattr(model, "active_peft_config", None)
    if getattr(peft, "is_prompt_learning", False):
        raise ValueError(
            f"{name}: PEFT's {getattr(peft, 'peft_type', 'prompt learning')} puts virtual tokens before every rank's "
            "shard (prompt, prefix and p-tuning): not supported across ranks; adapters on the weights (LoRA...) are"
        )
    if kind == "ForSequenceClassification" or name.endswith("ForSequenceClassification"):
        raise ValueError(
            f"{name} pools one token of each row (its last non-padding one), which on a shard would be each rank's "
            "own: sequence classification is not supported across ranks; run the base model and pool the token of "
            "bt.unshard-ed last_hidden_state yourself"
        )
    targets = [key for key in ("labels", "start_positions", "end_positions") if batch.get(key) is not None]
    if targets and kind not in CAUSAL_LOSSES:
        raise ValueError(
            f"shard_batch takes labels as a causal LM's next-token targets, and {name}'s loss is {kind} (given "
            f"{', '.join(targets)}): not supported across ranks. Pass no targets: its per-token logits are exact "
            "(gather them with burst.unshard and take the loss over the whole sequence yourself)"
        )
    non_text = [k for k, v in batch.items() if v is not None and carries_non_text(k)]
    if not non_text and _has_image_tokens(model):  # Gemma 3's token types mark image tokens: a two-way block
        non_text = [k for k, v in batch.items() if marks_non_text(k, v)]
    if non_text:
        raise ValueError(
            f"shard_batch got {', '.join(non_text)}: images, audio or video, whose features go to their tokens (which "
            f"the ranks split) and whose tokens attend each other both ways (a mask burst does not build); {name} "
            "trains across ranks on text only"
        )
    if keeps_some_logits(batch.get("logits_to_keep")):
        raise kept_logits_refusal(batch["logits_to_keep"])


@functools.lru_cache(maxsize=None)
def _packed_with_a_cache_warning() -> None:
    warnings.warn(
        "shard_batch: packed documents (position_ids restarting at 0): burst attends within each one, as "
        "transformers' attention does without a cache; with a cache (use_cache, on by default) its eager and "
        "sdpa paths attend across them, so the same model in one process differs unless it runs with "
        "use_cache=False (in the batch or the model's config, which silences this)",
        stacklevel=4,
    )


@functools.lru_cache(maxsize=None)
def _packed_across_documents_warning(decoder: str) -> None:
    warnings.warn(
        f"shard_batch: packed documents (position_ids restarting at 0): burst's attention keeps them apart, as "
        f"transformers' flash-attention path does, but {decoder} builds its masks without position_ids, so its "
        "eager and sdpa attention in one process attend across the documents of a row, cache or not: the two "
        "differ. Pass one document per row to compare",
        stacklevel=4,
    )


@functools.lru_cache(maxsize=None)
def _packed_through_recurrent_layers_warning(name: str) -> None:
    warnings.warn(
        f"shard_batch: packed documents (position_ids restarting at 0): burst's attention keeps them apart, but "
        f"{name}'s recurrent and convolutional layers carry their state from one document into the next, as "
        "transformers' own code does given no cu_seqlens (one process gives the same numbers). Pass one document "
        "per row to train the documents apart",
        stacklevel=4,
    )


def _has_attention_layers(model) -> bool:
    """Whether the model mixes tokens through attention in any layer: its config lists no layer kinds, or
    lists an attention kind (not MLP or MoE layers alone, nor recurrent ones)."""
    kinds = layer_kinds(text_config(model.config))
    return not kinds or bool(kinds & (ATTENTION_LAYER_KINDS - {"mlp", "moe"}))


def _warn_if_packed_rows_differ(batch: dict, positions: torch.Tensor, model) -> None:
    """Once a process: packed rows where burst and the same model's eager / sdpa attention in one process
    differ: a decoder whose masks ignore position_ids, or a cache on (see the two warnings)."""
    if positions.shape[-1] < 2 or not bool((positions[..., 1:] == 0).any()):
        return
    hooked = getattr(model, "_burst_mixers", None)
    if hooked is not None and hooked[2] > 0:  # shard_mixers hooked recurrent or convolutional layers
        _packed_through_recurrent_layers_warning(type(model).__name__)
    if not masks_read_positions(model):
        if _has_attention_layers(model):  # a model of recurrent layers alone runs documents together in both
            _packed_across_documents_warning(type(decoder_of(model)).__name__)
        return
    use_cache = batch.get("use_cache", getattr(text_config(model.config), "use_cache", False))
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # its name from 5.24 on
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if model.training and checkpointing:
        use_cache = False  # transformers turns the cache off there itself
    if use_cache:
        _packed_with_a_cache_warning()


def _the_model(model) -> torch.nn.Module:
    """TypeError when shard_batch was given no model."""
    if model is _MODEL_NOT_GIVEN or model is None:
        raise TypeError(
            "shard_batch(batch, ..., model=model) needs the model the batch is for: burst checks and prepares it "
            "there (a model that never calls attention, such as Mamba or RWKV, or that runs its own, such as GPT-1 "
            "or XLM, would otherwise run each rank's shard alone and give wrong logits without an error)"
        )
    return model


def check_same_batch(
    batch: dict, group=None, model: torch.nn.Module | None = None, problem: Exception | None = None
) -> None:
    """ValueError on every rank of `group` unless every rank holds the same input_ids, labels and
    position_ids (a digest of their bytes, agreed in one small collective), and the same weights of `model`
    (agreement.weights_digest, in the same collective). A sequence-parallel group splits *one* batch: a sampler
    that hands each rank of the group its own sequences (a DistributedSampler over the whole world) would have
    burst join shards of unrelated sequences. Weights that differ: a model built on each rank without a common
    seed, or a step taken on each rank's own share of the gradients (reduce_gradients not called). problem: this
    rank's own refusal (gradients.ddp_step_problem), raised on every rank through the same collective."""
    world = world_size(group)
    if world == 1:
        if problem is not None:
            raise problem
        return
    facts = {
        key: _content_digest(batch[key])
        for key in ("input_ids", "labels", "position_ids")
        if isinstance(batch.get(key), torch.Tensor)
    }
    hint = (
        "; the ranks of a sequence-parallel group must hold the same batch (each shards it): sample over "
        "the data-parallel replicas only, e.g. DistributedSampler(num_replicas=world // G, rank=rank // G)"
    )
    hints = {key: hint for key in facts}
    if model is not None and not checks_off():  # a digest of every parameter: not made where nothing reads it
        facts[WEIGHTS], hints[WEIGHTS] = weights_digest(model, group), WEIGHTS_HINT + STEP_HINT
    agree("burst.shard_batch", facts, problem, group, world, hints=hints)


# why weights that were one model's at the start differ after training steps
STEP_HINT = (
    "; after a training step: each rank's optimizer stepped on its own share of the gradients. Call "
    "bt.reduce_gradients(model) after the backward, before optimizer.step() (burst's Trainer and SequenceParallel "
    "need none: DDP over the world makes the gradients one there)"
)


def _content_digest(t: torch.Tensor) -> str:
    import hashlib

    data = t.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()
    return f"{tuple(t.shape)} {digest}"


def reduce_loss(loss: torch.Tensor, group=None, *, model=None) -> torch.Tensor:
    """The global mean loss on every rank from each rank's share (the model's loss on a shard_batch
    shard, which divides by the global token count). Detached: backward runs on each rank's own loss.
    Summed over `group`, else over the group `model`'s attention was registered with; with neither, over
    the default group, refused (ValueError on every rank) when every attention registered with burst runs over
    a subgroup: a data x sequence mesh would add the replicas' losses too."""
    if model is not None:
        group = registered_group(unwrap_model(model)[0], group, "reduce_loss")
    elif group is None and dist.is_initialized():
        _refuse_a_registered_subgroup()
    total = loss.detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def _refuse_a_registered_subgroup() -> None:
    """ValueError when every attention registered with burst runs over a subgroup (a data x sequence mesh)."""
    world = group_ranks(None)
    held = {name: group_ranks(backend.group) for name, backend in BACKENDS.items()}
    if held and world not in held.values():
        name, ranks = next(iter(held.items()))
        raise ValueError(
            f"reduce_loss: attention {name!r} was registered with ranks {list(ranks)}, not the whole world "
            f"{list(world)}: summed over the world the loss would count each replica's again; pass model=model "
            "(its registered group) or group=..."
        )
