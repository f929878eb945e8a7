"""What generate() on a ShardedCache (generate.py) reads of a model: its decoder's arguments by name,
whether it can decode on a split cache at all, where its own generate() runs the whole sequence again
(LongRoPE's switch), how a layer's cached entries become what it attends (attend_rule), and which masks
it may drop (a plain text prompt's causal ones: drop_causal_mask).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import typing
import weakref

import torch

from .backend.batches import carries_non_text, marks_non_text
from .backend.registry import backend_of, split_across_ranks, world_size
from .keywords import ATTENTION_LAYER_KINDS, CACHE_KEYWORDS, layer_kinds
from .layers import mixers, rope
from .layers.configs import decoder_of, text_config


def rope_switch(model) -> int | None:
    """The length at which the model's generate() drops its cache and runs the whole sequence again, or
    None. Phi-3's LongRoPE (Phi-3, PhiMoE, Phi-4-multimodal) switches from its short factors to its long
    ones past original_max_position_embeddings; once the sequence crosses it, their
    prepare_inputs_for_generation drops the cache so that every key is recomputed with the long factors.
    A ShardedCache does the same there (ShardedCache._begin)."""
    text = text_config(model.config)
    switch = getattr(text, "original_max_position_embeddings", None)
    if switch is None or "longrope" not in rope.rope_types(text):
        return None
    try:
        source = inspect.getsource(type(model).prepare_inputs_for_generation)
    except (OSError, TypeError):
        return None
    return int(switch) if "original_max_position_embeddings" in source else None


def attend_rule(module, updated: tuple, handed: tuple):
    """How a layer's cached entries become what it attends, or None when no rule burst knows fits: a
    function (k, v) -> (k, v) of this rank's entries, (batch, entries, kv_heads, dim) each.

    updated: the new token's (K, V) as the layer stored them (update); handed: as it handed them to
    attention, (batch, kv_heads, 1, dim) each. A rule is taken only once it turns `updated` into `handed`
    exactly (the same answer on every rank, each holding the same new token):
    - equal: the entries as stored;
    - heads picked or repeated (DiffLlama splits its values into two halves of heads, each repeated, and
      attends twice): the same heads of every entry;
    - MLA layers (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, Mistral 4...) cache their latent and rotary
      key and expand them after the cache with their own `expand_kv`, as their forward does on every
      step: so does this, on this rank's entries.
    """
    if same(updated, handed):
        return lambda k, v: (k, v)
    heads = [_head_map(a, b) for a, b in zip(updated, handed)]
    if None not in heads:
        return lambda k, v: (k[:, :, heads[0]], v[:, :, heads[1]])
    expand = getattr(type(module), "expand_kv", None)  # the family's own (burst's training path takes it over)
    if expand is not None and same(expand(module, *updated), handed):
        return lambda k, v: tuple(t.transpose(1, 2) for t in expand(module, k.transpose(1, 2), v.transpose(1, 2)))
    return None


def _head_map(updated: torch.Tensor, handed: torch.Tensor) -> list[int] | None:
    """For each head of `handed` (batch, heads, 1, dim), the one head of `updated` equal to it, or None
    where a head has no equal or more than one (then the heads cannot be told apart)."""
    if updated.shape[0] != handed.shape[0] or updated.shape[2:] != handed.shape[2:]:
        return None
    picks = []
    for j in range(handed.shape[1]):
        equal = [i for i in range(updated.shape[1]) if torch.equal(updated[:, i], handed[:, j])]
        if len(equal) != 1:
            return None
        picks.append(equal[0])
    return picks


def same(a: tuple, b: tuple) -> bool:
    """Whether two tuples of tensors are equal, shapes and values."""
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def refuse_recurrent_layers(model) -> None:
    """ValueError for a model with layers that mix tokens outside attention whose states a ShardedCache
    cannot carry (RWKV, xLSTM, families burst does not split): the hybrids of mixers.GENERATE decode
    (recurrent_states.py)."""
    text = text_config(model.config)
    model_type = getattr(text, "model_type", None)
    others = sorted(layer_kinds(text) - ATTENTION_LAYER_KINDS)
    if mixers.generates(model_type) or mixers.generates(getattr(model.config, "model_type", None)):
        return
    if others or mixers.supported(model_type) or mixers.supported(getattr(model.config, "model_type", None)):
        kinds = ", ".join(others) or "recurrent layers"
        raise ValueError(
            f"ShardedCache: model_type {model_type!r} mixes tokens outside attention ({kinds}) with a state "
            "burst's ShardedCache does not carry: generate() on a sharded cache is refused for it (its training "
            f"and forward split exactly: docs/hybrid.md; the families that decode: {', '.join(mixers.GENERATE)})"
        )


def own_cache_class(model) -> type | None:
    """The Cache subclass of its own a family's decoder insists on (MiniMax's raises for any cache that is
    not a MiniMaxCache), read off the annotation of its forward's cache argument; None for any Cache."""
    from transformers.cache_utils import Cache  # not at import: burst.integrations.transformers imports without it

    decoder = decoder_of(model)
    parameters = inspect.signature(inspect.unwrap(type(decoder).forward)).parameters
    for name in CACHE_KEYWORDS:
        if name in parameters:
            annotation = parameters[name].annotation
            for kind in typing.get_args(annotation) or (annotation,):
                if isinstance(kind, type) and issubclass(kind, Cache) and kind.__module__ == type(decoder).__module__:
                    return kind
            return None
    return None


@functools.lru_cache(maxsize=None)
def sharded_as(cls: type, own: type) -> type:
    """`cls` (ShardedCache) that is also an `own` (the family's Cache subclass its decoder checks for):
    cls's methods come first, own's __init__ never runs (so own's length would read state it lacks)."""
    from transformers.cache_utils import Cache

    return type(f"{cls.__name__}As{own.__name__}", (cls, own), {"__len__": Cache.__len__})


def token_facts(tokens: torch.Tensor, what: str = "prompt") -> dict:
    """What every rank's `what` (its prompt, a new token) must agree on (burst.agreement): its shape and dtype,
    and a digest of its token ids (hashed whole) or, for inputs_embeds (too large to hash on the host), their
    sum and sum of squares."""
    facts = {f"{what} shape": tuple(tokens.shape), f"{what} dtype": str(tokens.dtype)}
    if tokens.is_floating_point():
        wide = tokens.double()
        facts[f"{what} sums"] = (float(wide.sum()), float(wide.square().sum()))
    else:
        facts[f"{what} ids"] = hashlib.blake2b(tokens.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    return facts


def by_name(module, args: tuple, kwargs: dict) -> dict:
    """The decoder's arguments by name: GPT-2's LM head (and others') passes input_ids by position."""
    if not args:
        return kwargs
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs
    named = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL and named.get(parameter.name):
            return kwargs  # arguments with no name: left as they came
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            named.pop(parameter.name, None)
    return named


def beyond_a_text_prompt(named: dict) -> str:
    """What in the inputs of generate()'s model, by name, makes its masks more than causal ones: padding,
    images, audio or video (Gemma 3's and 4's images attend both ways within themselves); '' for a plain
    text prompt. A multimodal wrapper turns these into one mask per layer kind (a dict) before its decoder,
    where they can no longer be told apart (ShardedCache drops that dict only when this is '')."""
    mask = named.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.bool().all())):
        return "an attention_mask with padding (zeros), or not 2-D"
    for name, value in named.items():
        if _empty(value):
            continue
        if carries_non_text(name):
            return f"{name} (images, audio or video in the prompt)"
        if marks_non_text(name, value):
            return f"{name} marking tokens that are not text"
    return ""


def _empty(value) -> bool:
    """None, or a dict, list or tuple of nothing but empties (generate() hands on an mm_encoder_outputs of {})."""
    if isinstance(value, dict):
        return all(_empty(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_empty(v) for v in value)
    return value is None


def drop_causal_mask(kwargs: dict, name: str, model_inputs: str | None) -> None:
    """Drop the decoder's attention_mask where it holds nothing but causal masks; refuse any other.

    model_inputs: what the model's own forward took beyond a plain text prompt (decoding.beyond_a_text_prompt),
    None where that forward was not seen (the decoder called alone)."""
    mask = kwargs.pop("attention_mask", None)
    if mask is None:
        return
    if isinstance(mask, dict):  # Gemma 3's and 4's multimodal wrappers build one mask per layer kind
        if model_inputs == "":
            return  # made from a text prompt without padding: causal (and sliding) masks, burst's own
        raise ValueError(
            f"attn_implementation={name!r}: generate() with a ShardedCache runs text prompts without padding, and "
            f"this model got {model_inputs or 'a mask per layer kind (a dict) from outside its forward'}: "
            "generate with text prompts of one length per batch, or without burst"
        )
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.bool().all()):
        raise ValueError(
            f"attn_implementation={name!r}: generate() with a ShardedCache runs unpadded prompts; "
            "the attention_mask has padding (zeros) or is not 2-D. Generate each length's prompts "
            "as their own batch"
        )


def chosen_positions(kwargs: dict, block_size: int | None, length: int) -> torch.Tensor | None:
    """What a decode step's new token attends by its layer's indexer, as bool over the `length` global
    positions so far: (batch, length) for one choice (DeepSeek sparse attention's `indices`, (batch, 1,
    picks) positions), (batch, kv_heads, length) for one per KV head (MiniMax-M3's `block_indices`, (batch,
    kv_heads, 1, picks) blocks of `block_size` keys, -1 for none); None without an indexer's choice."""
    indices, blocks = kwargs.get("indices"), kwargs.get("block_indices")
    if indices is not None:
        if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.shape[1] != 1:
            raise ValueError(f"decoding takes one new token's indices (batch, 1, picks), got {_shape_of(indices)}")
        picked = indices[:, 0].long()
        picked = picked.masked_fill((picked < 0) | (picked >= length), length)  # -1 (none): the spare column
        chosen = torch.zeros(indices.shape[0], length + 1, dtype=torch.bool, device=indices.device)
        return chosen.scatter_(1, picked, True)[:, :length]
    if blocks is not None:
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 4 or blocks.shape[2] != 1 or not block_size:
            raise ValueError(
                f"decoding takes one new token's block_indices (batch, kv_heads, 1, picks), got {_shape_of(blocks)}"
            )
        of_position = torch.arange(length, device=blocks.device) // block_size  # each position's block
        return (of_position[None, None, :, None] == blocks[:, :, 0, None, :]).any(-1)  # -1 matches no block
    return None


def _shape_of(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


class _OneTokenPerStep(list):
    """The generation modes a model declares to transformers (`_supported_generation_modes`, which generate()
    checks before it runs anything: every rank alike, no forward, no collective, the model untouched) while it
    runs on a burst backend across ranks, where generate() needs a ShardedCache: greedy search and sampling.
    On any other attention (switched back to sdpa, a world of one) the model's own modes. Its repr is what
    transformers' refusal prints."""

    def __init__(self, model, modes, own):
        super().__init__(modes)
        self._model, self._own = weakref.ref(model), own

    def __contains__(self, mode) -> bool:
        model = self._model()
        if model is not None and split_across_ranks(model):
            return list.__contains__(self, mode)
        return self._own is None or mode in self._own

    def __reduce__(self):  # pickled (torch.save of a whole model): the model's own modes, with no weakref
        return (_own_modes, (self._own,))

    def __repr__(self) -> str:
        return (
            "greedy search and sampling on burst's ShardedCache (one token per step, the same on every rank: not "
            "beam search, assisted or speculative decoding, assistant_early_exit, DoLa or contrastive search)"
        )


def _own_modes(own):
    return own


def declare_generation_modes(model) -> None:
    """Make `model.generate()` refuse, up front, the modes a ShardedCache cannot run (beam search would reorder
    it, assisted decoding crop it; early exit would leave the model with fewer layers after the refusal)."""
    from transformers.generation import GenerationMode

    own = getattr(type(model), "_supported_generation_modes", None)
    modes = [m for m in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE) if own is None or m in own]
    model._supported_generation_modes = _OneTokenPerStep(model, modes, own)


def prepare_generate(model) -> None:
    """What generate() on a ShardedCache needs of `model` itself: its modes (declare_generation_modes) and
    stopping rules that decide alike on every rank (agree_on_stopping)."""
    declare_generation_modes(model)
    agree_on_stopping(model)


def agree_on_stopping(model) -> None:
    """Make generate()'s stopping rules stop a sequence on every rank where any rank's stop it, while `model` runs
    split across ranks: `max_time` reads each rank's own clock (and a rule of the caller's may read anything), and
    the ranks that went on waited in the next token's agreement for one that had stopped, until it timed out. One
    all-reduce of a flag per sequence a step."""
    if not isinstance(vars(model).get("_get_stopping_criteria"), _AgreedStoppingCriteria):
        model._get_stopping_criteria = _AgreedStoppingCriteria(model)


class _AgreedStoppingCriteria:
    """The model's own _get_stopping_criteria, its list agreed on across the ranks (`_agreed_list`)."""

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __call__(self, *args, **kwargs):
        model = self._model()
        criteria = type(model)._get_stopping_criteria(model, *args, **kwargs)
        if not split_across_ranks(model):
            return criteria
        agree_on_settings(model, kwargs.get("generation_config", args[0] if args else None))
        agreed = _agreed_list()(criteria)
        agreed.model = self._model  # a weakref: deep copies keep it, a process group would not copy
        return agreed

    def __reduce__(self):  # pickled with its model (torch.save of a whole model)
        return (_AgreedStoppingCriteria, (self._model(),))


# what only shapes the result this rank returns (the tokens and the steps are the same): may differ across ranks
_THIS_RANKS_OUTPUT = frozenset(
    {"output_attentions", "output_hidden_states", "output_logits", "output_scores", "return_dict_in_generate"}
)


def agree_on_settings(model, generation_config) -> None:
    """ValueError on every rank of `model`'s group unless generate() runs with the same settings on each (all of
    `generation_config` but what only shapes this rank's result). The ranks stop together where any rank's rules
    stop (_agreed_list): a rank that asked for more new tokens, or another eos_token_id, was cut short silently."""
    from burst.agreement import agree

    settings = generation_config.to_dict() if generation_config is not None else {}
    # private fields are generate()'s own working copies (_eos_token_tensor...: a tensor on this rank's device)
    facts = {f"generate()'s {k}": v for k, v in sorted(settings.items()) if k not in _THIS_RANKS_OUTPUT and k[0] != "_"}
    group = backend_of(model)[1].group
    agree("generate()", facts, None, group, world_size(group))
    if settings.get("use_cache") is False or settings.get("prefill_chunk_size"):  # before the prompt runs
        raise ValueError(
            "generate() across ranks runs on a ShardedCache, the whole prompt and then one token per step: "
            "use_cache=False (which reruns the whole sequence at each step) and prefill_chunk_size (which runs the "
            "prompt in pieces) are not supported there; keep use_cache on and leave prefill_chunk_size unset"
        )


@functools.cache
def _agreed_list():
    import torch.distributed as dist
    from transformers import StoppingCriteriaList

    class AgreedStoppingCriteriaList(StoppingCriteriaList):
        """A sequence is done where any rank's rules say so (MAX of the flags over the model's group)."""

        def __call__(self, input_ids, scores, **kwargs):
            done = super().__call__(input_ids, scores, **kwargs).to(torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=backend_of(self.model())[1].group)
            return done.bool()

    return AgreedStoppingCriteriaList
