"""transformers' `model.generate()` on burst: the prompt's prefill runs sequence-parallel and decoding
runs on a sharded KV cache (docs/transformers.md, generate()).

    name = bt.register(layout="zigzag")
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    out = model.generate(ids, **bt.sharded_cache(model), max_new_tokens=32)  # every rank, the same prompt

`ShardedCache` is a transformers `Cache` around burst's ShardedKVCache (and recurrent_states.py). Building
one hooks the model's decoder and the model (a multimodal wrapper's text prompt), once; the hooks act only
on a ShardedCache's forwards:
- Prefill: the prompt is padded at the end to a length the layout splits; each rank runs its shard at
  global position_ids, the layers run burst.attention as in training and `update` stores this rank's K, V
  (the padding invalid). last_hidden_state becomes the prompt's last real token's, the same on every rank.
- Decode: every rank runs the new token; its K, V are stored on one rank in turn, and attention is
  decode_attention over the ranks' shards: the same bits on every rank, so every rank picks the same token.
`get_seq_length()` is the tokens seen by the whole sequence, so positions are global. It relies on public
interface only: generate() hands its cache to the decoder as a keyword (CACHE_KEYWORDS), each attention
layer calls `Cache.update` once before its attention function, positions come from `position_ids` or
`get_seq_length()`; the hooks are torch's forward hooks, nothing in transformers is patched.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from burst.agreement import agree, agree_on_weights
from burst.api import autocast_inputs
from burst.comm.membership import group_size
from burst.inference import ShardedKVCache, decode_attention
from burst.inference.decode import agree_on_decoding, decode_exchange
from burst.inference.generate import last_hidden
from burst.layout import LAYOUTS, local_multiple, shard, unshard

from . import decoding
from .backend.checks import check_model
from .backend.features import prepare_features
from .backend.registry import backend_of, set_running_cache
from .keywords import CACHE_KEYWORDS, generate_cache_keyword
from .layers import compressed, dynamic_mask, rope
from .layers.configs import decoder_of
from .recurrent_states import RecurrentStates


class ShardedCache(RecurrentStates, Cache):
    """transformers' KV cache for `model.generate()` on burst: each rank keeps the K, V of its prompt
    shard (the registered layout) and of every G-th decoded token.

    model: a transformers model whose attn_implementation was registered with burst; the group and
    layout are that registration's. chunk: entries the storage grows by. Pass a new one to each
    generate() call: `model.generate(ids, **sharded_cache(model), ...)` (`cache=ShardedCache(model)` on
    transformers 5.24 and later, `past_key_values=` before).
    """

    def __new__(cls, model: torch.nn.Module, chunk: int = 256):
        own = decoding.own_cache_class(model)  # MiniMax's decoder takes its own cache class only
        return super().__new__(cls if own is None or issubclass(cls, own) else decoding.sharded_as(cls, own))

    def __init__(self, model: torch.nn.Module, chunk: int = 256):
        name, backend = backend_of(model)
        if backend.layout not in LAYOUTS:  # a DocumentLayout cuts packed documents: no prompt is one
            why = f"ShardedCache needs attn_implementation={name!r} with a layout of {LAYOUTS}, got {backend.layout!r}"
            raise ValueError(why)
        Cache.__init__(self, layers=[])  # storage is burst's ShardedKVCache (and a family's own class: not its)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.name, self.group, self.layout = name, backend.group, backend.layout
        self.world = group_size(self.group)
        decoding.refuse_recurrent_layers(model)  # before anything of the model is prepared
        decoding.prepare_generate(model)
        self._install_hooks(model)  # first: a positions hook of prepare_features must see the shard
        prepare_features(model, self.group, self.layout)  # then checked, as shard_batch does (rope's length...)
        check_model(model)
        agree_on_weights(model, self.group, self.world, "ShardedCache(model)")  # each rank's own weights: wrong tokens
        self.rope_switch = decoding.rope_switch(model)
        self._tokens = None  # the tokens so far, kept only where the rope switch may need them again
        self.kv = ShardedKVCache(layers, group=self.group, layout=self.layout, chunk=chunk)
        self.forget_states()
        self._agreed: dict[tuple, object] = {}  # decode signature every rank agreed on -> its decode_exchange
        self.seen = 0  # tokens of each row seen so far (prompt + decoded), on all ranks together
        self.prompt_length = 0
        self.phase: str | None = None  # "prefill" or "decode" while a forward runs
        self._batch = 0
        self._prefill_positions = None  # (batch, padded / G) global positions of this rank's prompt shard
        self._step = None  # decode: (batch,) global position of the token being run
        self._step_updates: dict[int, tuple] = {}  # decode: slot -> (key_states, value_states) of this step
        self._model_inputs: str | None = None  # this forward's model inputs: decoding.beyond_a_text_prompt
        self.indexer_keys: dict[int, torch.Tensor] = {}  # layer -> a DSA indexer's keys, whole (layers/indexer.py)

    # -- what transformers asks of a Cache -----------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this forward's K, V for layer `layer_idx` and hand them back unchanged.

        key_states, value_states: (batch, kv_heads, tokens, head_dim): this rank's prompt shard in the
        prefill (the attention runs on the shards, as in training), the one new token in decode (the
        attention reads the whole sharded cache, in decode_attention).
        """
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # burst's (batch, entries, kv_heads, d)
        if self.phase == "prefill":
            self.kv.store_prefill(layer_idx, k, v)
        elif self.phase == "decode":
            self.kv.append(layer_idx, k, v, self._step)
            self._step_updates.pop(layer_idx, None)  # the latest update last
            self._step_updates[layer_idx] = (key_states, value_states)
        else:
            raise ValueError(
                "this ShardedCache was built for another model: pass ShardedCache(model) of the model "
                "that runs (it hooks that model's decoder)"
            )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the whole sequence (not this rank's share): the next token's global position."""
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0  # burst builds no mask; sizes for transformers' bookkeeping only

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def bytes(self) -> int:
        """Bytes of K, V this rank holds."""
        return self.kv.bytes()

    def reset(self) -> None:
        self._forget_entries()
        self.seen = self.prompt_length = 0
        self._tokens = None

    def _forget_entries(self) -> None:
        """Every token's K, V, indexer keys and recurrent states dropped (the prompt runs again)."""
        self.kv = ShardedKVCache(self.kv.layers, group=self.group, layout=self.layout, chunk=self.kv.chunk)
        self.indexer_keys = {}
        self.forget_states()

    def reorder_cache(self, beam_idx):
        self._refuse("beam search (num_beams > 1)")

    def crop(self, tokens_to_remove: int):
        self._refuse("cropping (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int):
        self._refuse("expanding the batch (num_return_sequences > 1 with beams, contrastive search)")

    def batch_select_indices(self, indices):
        self._refuse("selecting batch rows")

    def _refuse(self, what: str):
        raise ValueError(
            f"ShardedCache does not support {what}: generate() on burst runs greedy search or "
            "sampling, one token per step"
        )

    # -- the decoder hooks ---------------------------------------------------------------------
    @staticmethod
    def _install_hooks(model: torch.nn.Module) -> None:
        decoder = decoder_of(model)
        if getattr(decoder, "_burst_sharded_cache_hooks", None) is None:  # before any other pre-hook
            decoder._burst_sharded_cache_hooks = (
                decoder.register_forward_pre_hook(_before_decoder, with_kwargs=True, prepend=True),
                decoder.register_forward_hook(_after_decoder, with_kwargs=True, always_call=True),
            )
        if decoder is not model and getattr(model, "_burst_sharded_cache_hooks", None) is None:
            model._burst_sharded_cache_hooks = (model.register_forward_pre_hook(_before_model, with_kwargs=True),)

    def _begin(self, kwargs: dict) -> None:
        """Rewrite the decoder's inputs for this rank (kwargs, in place) and enter prefill or decode."""
        key = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        tokens = kwargs[key]
        batch, length = tokens.shape[:2]
        decoding.drop_causal_mask(kwargs, self.name, self._model_inputs)
        positions = kwargs.get("position_ids")
        if self.seen == 0:
            expected = torch.arange(length, device=tokens.device)
            if positions is not None and not bool((positions == expected).all()):
                raise ValueError(
                    "generate() with a ShardedCache runs whole prompts at positions 0..n-1 "
                    "(packed prompts or custom position_ids are not supported)"
                )
            switches = self.rope_switch is not None and length <= self.rope_switch
            self._tokens = tokens if switches and key == "input_ids" else None
            self._prefill(kwargs, key, tokens)
            return
        if self.rope_switch is not None and self.prompt_length <= self.rope_switch and length == 1:
            self._run_again_at_the_switch(kwargs, key, tokens)
            if self.phase == "prefill":
                return
        if length != 1 or batch != self._batch:
            cause = (
                "use_cache=False reruns the whole sequence at each step. " if kwargs.get("use_cache") is False else ""
            )
            raise ValueError(
                f"a ShardedCache that has seen {self.seen} tokens got a forward of {batch} x {length} tokens; it "
                f"decodes one token per row of the prompt's batch ({self._batch}) per step. {cause}Keep use_cache on "
                "(the model's config and generate()'s), leave generate()'s prefill_chunk_size unset (it runs the "
                "prompt in pieces), and pass a new ShardedCache to each generate() call"
            )
        if positions is not None and not bool((positions == self.seen).all()):
            raise ValueError(f"position_ids {positions.flatten().tolist()} in decode: the next position is {self.seen}")
        # every new token (one small collective a step): ranks that sample apart may first differ at any step
        hint = {"new token ids": " (sampling needs the same torch.manual_seed on every rank)"}
        agree(
            "generate() on a ShardedCache",
            decoding.token_facts(tokens, "new token"),
            None,
            self.group,
            self.world,
            hint,
        )
        self._step = torch.full((batch,), self.seen, dtype=torch.long, device=tokens.device)
        kwargs["position_ids"] = self._step[:, None]
        self.phase = "decode"

    def _run_again_at_the_switch(self, kwargs: dict, key: str, tokens: torch.Tensor) -> None:
        """Keep the decoded tokens until the sequence reaches the rope switch (decoding.rope_switch); there, run
        the whole sequence again as a prompt, its keys with the long factors, as transformers does."""
        if self._tokens is not None and key == "input_ids":
            self._tokens = torch.cat([self._tokens, tokens], dim=1)
        if self.seen != self.rope_switch:
            return
        if self._tokens is None or key != "input_ids":
            raise ValueError(
                f"generate() with a ShardedCache: this model runs its whole sequence again once it passes "
                f"{self.rope_switch} tokens (LongRoPE's long factors), and a prompt given as inputs_embeds "
                "cannot be run again; pass input_ids, or a prompt longer than that"
            )
        self._forget_entries()
        self._prefill(kwargs, key, self._tokens)
        self._tokens = None

    def _prefill(self, kwargs: dict, key: str, tokens: torch.Tensor) -> None:
        """Run `tokens` (batch, length[, dim]), the whole sequence so far, as a prompt: padded at the end
        to the layout's multiple and cut to this rank's shard at its global positions. Every rank must pass the
        same prompt: checked (a digest of it, one small collective), else each rank's shard is of its own."""
        agree("generate() on a ShardedCache", decoding.token_facts(tokens), None, self.group, self.world)
        batch, length = tokens.shape[:2]
        multiple = self.world * local_multiple(self.layout)
        # at least 2 tokens a rank: a shard of one looks like a decode step to some layers (RecurrentGemma's)
        padded = -(-max(length, 2 * self.world) // multiple) * multiple
        self._prefill_positions = self.kv.prefill_positions([length] * batch, padded, device=tokens.device)
        for name in (key, *PER_TOKEN_INPUTS):
            value = tokens if name == key else kwargs.get(name)
            if value is None:
                continue
            if tuple(value.shape[:2]) != (batch, length):
                raise ValueError(f"the decoder's {name} has shape {tuple(value.shape)}, not ({batch}, {length}, ...)")
            full = torch.cat([value, value.new_zeros(batch, padded - length, *value.shape[2:])], dim=1)
            kwargs[name] = shard(full, group=self.group, layout=self.layout, dim=1)
        kwargs["position_ids"] = self._prefill_positions
        rope.set_longest_position(length - 1)  # not the padding's (a length-dependent rope reads it)
        self.prompt_length, self._batch, self.phase = length, batch, "prefill"

    def _end(self, output, phase: str):
        """After the decoder: the prompt's last hidden state on every rank (prefill), or close the step."""
        if phase == "decode":
            self._step_updates.clear()
            self.kv.advance()
            self.seen += 1
            return output
        hidden = output[0]  # last_hidden_state: (batch, padded / G, dim) of this rank's shard
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(self._prefill_positions.shape):
            raise ValueError(  # the same shapes on every rank: every rank raises, before the collective below
                f"ShardedCache hooked a module whose first output has shape {tuple(hidden.shape)}, not the "
                f"hidden states of this rank's {self._prefill_positions.shape[1]} prompt tokens (not the decoder)"
            )
        last = last_hidden(hidden, self._prefill_positions, [self.prompt_length] * self._batch, self.group)[:, None]
        self.seen = self.prompt_length
        if isinstance(output, tuple):
            return (last, *output[1:])
        output["last_hidden_state"] = last
        if output.get("hidden_states") is not None:  # output_hidden_states: every layer's, of the whole prompt
            output["hidden_states"] = tuple(self._whole_prompt(h) for h in output["hidden_states"])
        return output

    def _whole_prompt(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, padded / G, dim) of this rank's prompt shard -> (batch, prompt length, dim) on every rank."""
        whole = unshard(hidden.contiguous(), group=self.group, layout=self.layout, dim=1)
        return whole[:, : self.prompt_length]

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        call,
        sinks: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ):
        """Decode attention of the new token over the sharded cache: (batch, 1, heads, head_dim).

        module: the attention layer; query: (batch, heads, 1, head_dim), the same on every rank; key,
        value: (batch, kv_heads, 1, head_dim), the new token's K, V as the layer hands them to attention;
        call: the layer's call (backend/features.LayerCall: scaling, sliding_window, chunk_size, softcap, and
        DeepSeek-V4's compressed entries held apart);
        sinks: (heads,) or None; chosen: bool (batch, [kv_heads,] positions), what the layer's indexer chose
        (decoding.chosen_positions), or None. The entries read are those of this step's
        latest update whose new K, V become what the layer hands (decoding.attend_rule): the layer's own, just
        before (in its slot: HRM stores each of its cycles under a slot of its own), or the layer it shares its
        keys with (Gemma 3n).
        """
        since = None
        if call.sliding_window is not None:  # transformers: key j attends query i when j > i - sliding_window
            since = self._step - call.sliding_window + 1
        if call.chunk_size:  # Llama 4's chunked attention: the keys of the query's own chunk
            start = self._step - self._step % call.chunk_size
            since = start if since is None else torch.maximum(since, start)
        k, v, valid = self._entries(module, key, value, since, chosen)
        if "decoded entries" in call.held:  # DeepSeek-V4's compressed entries, whole on every rank: a share each
            k, v, valid = compressed.with_share_of_entries(call.held["decoded entries"], k, v, valid, self.group)
        q, k, v = autocast_inputs(query.transpose(1, 2), k, v)  # as SDPA under autocast: RoPE's q, k in float32
        scale = q.shape[-1] ** -0.5 if call.scaling is None else call.scaling
        if dynamic_mask.is_dynamic_mask_attention(module):  # Doge: a bias per cached key, one more key channel
            positions = self.kv.entry_positions(valid.shape[1])
            bias, valid = dynamic_mask.decoded_bias(module, v, valid, positions, self.seen + 1, self.group)
            q, k = dynamic_mask.fold(q, k, bias, scale)
        signature = (tuple(q.shape), q.dtype, k.shape[2], v.shape[-1], float(scale))
        if signature not in self._agreed:  # once per generation (and per shape): then one collective per layer
            agree_on_decoding(q.shape, q.dtype, k.shape[2], scale, self.group)
            self._agreed[signature] = decode_exchange(q.shape, q.dtype, q.device, self.group, v.shape[-1])
        exchange = self._agreed[signature]
        return decode_attention(
            q, k, v, valid, scale, self.group, agreed=True, exchange=exchange, sinks=sinks, softcap=call.softcap
        )

    def _entries(self, module, key: torch.Tensor, value: torch.Tensor, since, chosen) -> tuple:
        """(k, v, valid) this rank attends for the layer: see attend. The same choice on every rank."""
        for slot, updated in reversed(self._step_updates.items()):
            rule = decoding.attend_rule(module, updated, (key, value))
            if rule is not None:
                stored_k, stored_v, valid = self.kv.keys_values(slot, since=since, chosen=chosen)
                return (*rule(stored_k, stored_v), valid)
        raise ValueError(
            f"{type(module).__name__} attends keys or values in decode that no layer stored in this step, nor "
            "any change of them burst follows: decoding on a ShardedCache is refused for it"
        )


def sharded_cache(model: torch.nn.Module, chunk: int = 256) -> dict:
    """{keyword: ShardedCache(model, chunk)} for `model.generate(ids, **sharded_cache(model), ...)`, in the
    keyword the installed transformers' generate() takes (`cache`, or `past_key_values` before 5.24)."""
    return {generate_cache_keyword(model): ShardedCache(model, chunk)}


# The decoder's inputs with one entry per token beside input_ids or inputs_embeds, cut to the rank's shard
# with them in the prefill: Gemma 4's per-layer embeddings, which its multimodal wrapper makes.
PER_TOKEN_INPUTS = ("per_layer_inputs",)


def _sharded_cache_of(kwargs: dict) -> ShardedCache | None:
    """The ShardedCache a decoder forward was called with, under either name; None for any other cache."""
    for keyword in CACHE_KEYWORDS:
        if isinstance(kwargs.get(keyword), ShardedCache):
            return kwargs[keyword]
    return None


def _carries_a_sharded_cache(args: tuple, kwargs: dict) -> bool:
    """A cheap look first: the decoder's every other forward (training, a plain call) is left as it came."""
    return any(isinstance(value, ShardedCache) for value in (*args, *kwargs.values()))


def _before_model(module, args, kwargs):
    """The inputs of generate()'s model itself, which a multimodal wrapper turns into a mask dict before its
    decoder: whether they are a plain text prompt (decoding.beyond_a_text_prompt)."""
    if _carries_a_sharded_cache(args, kwargs):
        named = decoding.by_name(module, args, kwargs)
        cache = _sharded_cache_of(named)
        if cache is not None:
            cache._model_inputs = decoding.beyond_a_text_prompt(named)


def _before_decoder(module, args, kwargs):
    if not _carries_a_sharded_cache(args, kwargs):
        return None
    named = decoding.by_name(module, args, kwargs)
    cache = _sharded_cache_of(named)
    if cache is None:
        return None
    if named is kwargs and args:
        raise ValueError("with a ShardedCache, the decoder's inputs must be nameable (its forward takes *args)")
    named = dict(named)
    cache._begin(named)
    set_running_cache(cache)  # the attention function runs its decode steps (backend/attention.py)
    return (), named


def _after_decoder(module, args, kwargs, output):
    if not _carries_a_sharded_cache(args, kwargs):
        return None
    cache = _sharded_cache_of(decoding.by_name(module, args, kwargs))
    if cache is None:
        return None
    phase, cache.phase, cache._model_inputs = cache.phase, None, None
    set_running_cache(None)
    rope.set_longest_position(None)
    if output is None:  # the forward raised (this hook runs anyway, always_call): leave no forward active
        return None
    return cache._end(output, phase)
