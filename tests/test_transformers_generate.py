"""transformers' model.generate() on burst (bt.ShardedCache) against one-process generate() on SDPA.

Models are built from configs with random weights (no download). One world per size (2 and 3: an
even and an odd size, 3 the more-than-two path), the cases looped inside it: greedy tokens and every
step's logits for each layout, prompt lengths that are not multiples of the world (and shorter than
it), a batch of two; seeded top-p sampling; the cache's bytes per rank; a sliding-window Mistral, a
Qwen2, DeepSeek-V3's latent attention, DeepSeek-V3.2's indexer, DeepSeek-V4's compressed attention,
Gemma 2's softcap, Llama 4's chunks, a dynamic-NTK Llama and Phi-3's LongRoPE across its switch;
bfloat16; inputs_embeds; what is refused.
One more test runs examples/transformers_generate.py under torchrun at 1 and 2 ranks.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from cases import rel_err as _rel
from cases import tiny_decoder_config
from requires import transformers_or_skip
from world import results_by_world, value_errors

transformers_or_skip()

from burst.integrations.transformers.keywords import generate_cache_keyword  # noqa: E402 - after the skip

VOCAB, NEW = 64, 6
LAYOUTS = ("contiguous", "zigzag", "striped")


def _config(class_name: str, **extra):
    """cases.TINY_DECODER's sizes (key-value heads as each family's function says), pad id 0."""
    return tiny_decoder_config(class_name, VOCAB, **{"pad_token_id": 0, **extra})


def _llama(**extra):
    return _config("LlamaConfig", **extra)


def _mistral(sliding_window=4):
    return _config("MistralConfig", num_key_value_heads=1, sliding_window=sliding_window)


def _qwen2():
    return _config("Qwen2Config")


def _deepseek_v3():
    """MLA: the layers cache their latent and rotary key, expanded after the cache."""
    return _config(
        "DeepseekV3Config",
        moe_intermediate_size=16,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )


def _phi3_longrope(switch):
    """Phi-3's LongRoPE: short factors up to `switch` tokens, long ones past it (generate runs the whole
    sequence again there). Weights drawn large enough that the factors show in the logits."""
    half = 32 // 4 // 2  # head_dim / 2 factors
    return _config(
        "Phi3Config",
        original_max_position_embeddings=switch,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * half,
            "long_factor": [1.0 + 2 * i for i in range(half)],
        },
        initializer_range=0.3,
    )


def _gemma2(softcap):
    """Gemma 2 with its logits capped low (1.0) and weights large enough that the cap bites."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("gemma2")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.attn_logit_softcapping, config.initializer_range = softcap, 0.3
    return config


def _llama4(chunk):
    """Llama 4's chunked attention (a token attends inside its chunk of `chunk` tokens), weights drawn
    large enough that the chunk shows."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("llama4_text")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.attention_chunk_size, config.initializer_range = chunk, 0.3
    return config


def _gemma3_wrapper():
    """Gemma 3's multimodal wrapper (Gemma3ForConditionalGeneration), which builds one mask per layer kind
    (a dict) before its decoder; a window of 4, so the sliding layers differ from the full ones."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("gemma3")
    config.text_config.sliding_window = 4
    return config


def _deepseek_v32(topk):
    """DeepSeek sparse attention: each query attends the `topk` keys its indexer scores highest (4, fewer
    than the prompt: the choice shows)."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("deepseek_v32")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.index_topk, config.initializer_range = topk, 0.3
    return config


def _deepseek_v4(topk):
    """DeepSeek-V4's compressed attention: a CSA layer (entries of 4 tokens, of which the indexer keeps `topk`)
    and an HCA layer (entries of 8 tokens, burst/bench/hf_zoo_overrides.py) beside a window of 8 and sinks."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("deepseek_v4")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.index_topk, config.sliding_window, config.initializer_range = topk, 8, 0.3
    return config


def _minimax_m3(topk_blocks):
    """MiniMax-M3's block-sparse layer: per KV head (2), `topk_blocks` blocks of 2 keys, one of them the
    query's own (2 of the prompt's blocks: the choice, different for each KV head, shows)."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("minimax_m3_vl_text")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.index_block_size, config.index_topk_blocks, config.index_local_blocks = 2, topk_blocks, 1
    config.initializer_range = 0.3
    return config


def _doge(name, keep):
    """Doge's dynamic mask: a bias per key and KV head from the cached values, past `keep` keys only the
    `keep` of largest bias attended (4, fewer than the prompt), a window of 8; the decay A drawn (it starts
    at 0, a bias of 1 on every key, which the softmax cancels)."""
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("doge")
    config.vocab_size, config.pad_token_id = VOCAB, 0
    config.keep_window_size, config.sliding_window, config.initializer_range = keep, 8, 0.3
    reference, model = _models(config, name, reference="eager")
    with torch.no_grad():
        for parameter_name, parameter in reference.named_parameters():
            if parameter_name.endswith("self_attn.A"):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    model.load_state_dict(reference.state_dict())
    return reference, model


def _models(config, name, dtype=torch.float32, reference="sdpa"):
    """(one-process model on `reference` attention (SDPA; eager where a family takes no SDPA), the same
    weights on burst's backend `name`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # each model gets its own copy of the config: from_config records the attention there
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference).to(dtype).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name).to(dtype).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _prompt(batch, length, seed):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache=None, seed=None, **options):
    """(tokens, logits of each step (steps, batch, vocab)) of model.generate."""
    if seed is not None:
        torch.manual_seed(seed)  # the same seed on every rank
    extra = {generate_cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(
        ids,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        return_dict_in_generate=True,
        output_logits=True,
        **extra,
        **options,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


def _compare(reference, model, ids, seed=None, **options):
    """Tokens and logits of generate() on burst vs one process, and the cache's bytes vs a DynamicCache's."""
    import burst.integrations.transformers as bt
    from transformers import DynamicCache

    cache = bt.ShardedCache(model)
    tokens, logits = _generate(model, ids, cache, seed, **options)
    whole = DynamicCache(config=reference.config)
    ref_tokens, ref_logits = _generate(reference, ids, whole, seed, **options)
    layers = [layer for layer in whole.layers if layer.keys is not None]  # Phi-3 may drop it and start anew
    whole_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in layers)
    return {
        "tokens": tokens,
        "same tokens": torch.equal(tokens, ref_tokens),
        "logits": logits,
        "logits error": _rel(logits, ref_logits),
        "bytes": cache.bytes(),
        "whole bytes": whole_bytes,
        "entries": cache.kv.length,
    }


def _greedy(rank, world):
    """Every layout on a batch of 2 whose length is not a multiple of G (contiguous with the all-ones
    attention_mask a tokenizer returns, which is accepted and dropped); a prompt shorter than G."""
    import burst.integrations.transformers as bt

    name = bt.register("burst-generate")
    reference, model = _models(_llama(), name)
    results = {}
    for layout in LAYOUTS:
        bt.register("burst-generate", layout=layout)  # the model's backend name, now with this layout
        ids = _prompt(2, 3 * world + 1, seed=1)
        mask = {"attention_mask": torch.ones_like(ids)} if layout == "contiguous" else {}
        results[layout] = _compare(reference, model, ids, do_sample=False, **mask)
    bt.register("burst-generate", layout="zigzag")
    results["short prompt"] = _compare(reference, model, _prompt(1, 2, seed=2), do_sample=False)  # padded to 2G
    results["sampling"] = _compare(
        reference, model, _prompt(2, 4 * world - 1, seed=4), seed=1234, do_sample=True, top_p=0.9, temperature=1.3
    )
    return results


def _other_models(rank, world):
    """A Mistral whose window (4) is shorter than prompt + new tokens, a Qwen2, and bfloat16."""
    import burst.integrations.transformers as bt

    results = {}
    name = bt.register("burst-generate-striped", layout="striped")
    ids = _prompt(1, 2 * world + 3, seed=11)
    reference, model = _models(_mistral(), name)
    results["mistral window"] = _compare(reference, model, ids, do_sample=False)
    unwindowed, _ = _models(_mistral(sliding_window=None), name)
    results["window effect"] = _rel(_generate(unwindowed, ids, do_sample=False)[1], results["mistral window"]["logits"])
    results["qwen2"] = _compare(*_models(_qwen2(), name), ids, do_sample=False)
    results["mla"] = _compare(*_models(_deepseek_v3(), name), ids, do_sample=False)
    results["softcap"] = _compare(*_models(_gemma2(1.0), name, reference="eager"), ids, do_sample=False)
    uncapped, _ = _models(_gemma2(None), name, reference="eager")
    results["softcap effect"] = _rel(_generate(uncapped, ids, do_sample=False)[1], results["softcap"]["logits"])
    results["dsa"] = _compare(*_models(_deepseek_v32(4), name, reference="eager"), ids, do_sample=False)
    unselected, _ = _models(_deepseek_v32(4096), name, reference="eager")  # every key chosen
    results["dsa effect"] = _rel(_generate(unselected, ids, do_sample=False)[1], results["dsa"]["logits"])
    # a padded prompt of two rows, whose indexer scores tie at exact zeros: topk breaks them as one process only on
    # rows of the same length (before: 1.3 off)
    results["dsa padded"] = _compare(
        *_models(_deepseek_v32(4), name, reference="eager"), _prompt(2, 5, 16), do_sample=False
    )
    results["blocks per kv head"] = _compare(*_models(_minimax_m3(2), name, reference="eager"), ids, do_sample=False)
    every_block, _ = _models(_minimax_m3(64), name, reference="eager")
    results["blocks effect"] = _rel(
        _generate(every_block, ids, do_sample=False)[1], results["blocks per kv head"]["logits"]
    )
    results["dynamic mask"] = _compare(*_doge(name, 4), ids, do_sample=False)
    results["dynamic mask effect"] = _rel(
        _generate(_doge(name, 4096)[0], ids, do_sample=False)[1], results["dynamic mask"]["logits"]
    )
    results["gemma3 wrapper"] = _compare(*_models(_gemma3_wrapper(), name, reference="eager"), ids, do_sample=False)
    chunk = 2 * world + 4  # the prompt (2G + 3 tokens) ends inside the first chunk; decoding crosses into the second
    results["chunks"] = _compare(*_models(_llama4(chunk), name, reference="eager"), ids, do_sample=False)
    unchunked, _ = _models(_llama4(4096), name, reference="eager")  # one chunk holds the whole sequence
    results["chunk effect"] = _rel(_generate(unchunked, ids, do_sample=False)[1], results["chunks"]["logits"])
    name = bt.register("burst-generate-zigzag", layout="zigzag")
    # a length-dependent rope (dynamic NTK past 8 tokens): each rank's rotary module sees the whole length
    results["dynamic rope"] = _compare(
        *_models(_llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=8), name),
        _prompt(1, 2 * world + 5, seed=13),
        do_sample=False,
    )
    # DeepSeek-V4 (zigzag: its compressors need runs of positions): 33 tokens padded to 36, windows ending in the prompt
    # and in decoding, the CSA indexer keeping 2 of up to 9 entries
    v4_ids = _prompt(2, 30, seed=16)
    results["compressed"] = _compare(*_models(_deepseek_v4(3), name, reference="eager"), v4_ids, do_sample=False)
    every_entry, _ = _models(_deepseek_v4(4096), name, reference="eager")
    results["compressed effect"] = _rel(
        _generate(every_entry, v4_ids, do_sample=False)[1], results["compressed"]["logits"]
    )
    switch = 2 * world + 6  # crossed on the third new token
    reference, model = _models(_phi3_longrope(switch), name)
    results["longrope switch"] = _compare(reference, model, _prompt(1, switch - 2, seed=14), do_sample=False)
    results["longrope past the switch"] = _compare(reference, model, _prompt(1, switch + 3, seed=14), do_sample=False)
    kept = bt.ShardedCache(model)
    kept.rope_switch = None  # the keys before the switch kept with the short factors: what transformers does not do
    results["switch effect"] = _rel(
        _generate(model, _prompt(1, switch - 2, seed=14), kept, do_sample=False)[1],
        results["longrope switch"]["logits"],
    )
    results["bfloat16"] = _compare(
        *_models(_llama(), name, torch.bfloat16), _prompt(2, 3 * world, seed=12), do_sample=False
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):  # RoPE's q, k in float32 beside bf16 values, decoding too
        results["autocast"] = _compare(*_models(_llama(), name), _prompt(2, 3 * world, seed=12), do_sample=False)
    with torch.inference_mode():  # a serving idiom: its tensors keep no version counter
        results["inference mode"] = _compare(*_models(_llama(), name), _prompt(1, 3 * world, seed=15), do_sample=False)
    return results


def _errors(rank, world):
    """generate() without a ShardedCache (with or without use_cache) raises on every rank, naming it;
    so do a padding mask and beam search with one. Then generate() still works, from input_ids or
    from inputs_embeds."""
    import burst.integrations.transformers as bt

    name = bt.register("burst-generate-errors")
    reference, model = _models(_llama(), name)
    ids = _prompt(1, 2 * world, seed=3)
    left_padded = torch.ones(2, ids.shape[1], dtype=torch.long)
    left_padded[1, 0] = 0
    cases = {
        "no cache": lambda: model.generate(ids, max_new_tokens=2),
        "use_cache=False": lambda: model.generate(ids, max_new_tokens=2, use_cache=False),
        "padding mask": lambda: model.generate(
            torch.cat([ids, ids]), attention_mask=left_padded, max_new_tokens=2, **bt.sharded_cache(model)
        ),
        "beam search": lambda: model.generate(ids, num_beams=2, max_new_tokens=2, **bt.sharded_cache(model)),
        # refused before any forward: early exit would otherwise leave the model one layer short after the refusal
        "early exit": lambda: model.generate(ids, assistant_early_exit=1, max_new_tokens=2, **bt.sharded_cache(model)),
        "prompt lookup": lambda: model.generate(
            ids, prompt_lookup_num_tokens=2, max_new_tokens=2, **bt.sharded_cache(model)
        ),
        # each rank a prompt of its own (a user's mistake): each would hold a shard of a different sequence
        "prompts differ": lambda: model.generate(ids + rank, max_new_tokens=2, **bt.sharded_cache(model)),
        "embeddings differ": lambda: model.generate(
            inputs_embeds=model.get_input_embeddings()(ids) * (1 + rank), max_new_tokens=2, **bt.sharded_cache(model)
        ),
        # sampling with a seed of each rank's own: the ranks' first new tokens differ (checked once per call)
        # each rank its own length or end token: every rank stopped at the first rank's stop, silently
        "max_new_tokens differ": lambda: model.generate(ids, max_new_tokens=2 + rank, **bt.sharded_cache(model)),
        "eos differs": lambda: model.generate(ids, max_new_tokens=2, eos_token_id=rank, **bt.sharded_cache(model)),
        "use_cache=False with a cache": lambda: model.generate(
            ids, max_new_tokens=2, use_cache=False, **bt.sharded_cache(model)
        ),
        "prefill_chunk_size": lambda: model.generate(
            ids, max_new_tokens=2, prefill_chunk_size=2, **bt.sharded_cache(model)
        ),
        "seeds differ": lambda: _generate(
            model, ids, bt.ShardedCache(model), seed=rank, do_sample=True, temperature=5.0
        ),
    }
    # the ranks' tokens part at the third new token (a rank's own logits processor, as sampling with a seed of each
    # rank's own may first differ late): every step's token is agreed on, not only the first's
    from transformers import LogitsProcessor, LogitsProcessorList

    class RanksOwnThirdToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == ids.shape[1] + 2:
                scores = scores.clone()
                scores[:, rank] = scores.max() + 1
            return scores

    # classifier-free guidance runs an unconditional forward without the cache: refused, naming it
    cases["guidance_scale"] = lambda: model.generate(
        ids, guidance_scale=1.5, max_new_tokens=2, **bt.sharded_cache(model)
    )
    cases["tokens part later"] = lambda: model.generate(
        ids,
        max_new_tokens=4,
        do_sample=False,
        logits_processor=LogitsProcessorList([RanksOwnThirdToken()]),
        **bt.sharded_cache(model),
    )
    # a model made on each rank without a common seed: each rank's shard and decode step would meet other weights
    _, skewed = _models(_llama(), name)
    with torch.no_grad():
        skewed.lm_head.weight.mul_(1 + rank)
    cases["weights differ"] = lambda: skewed.generate(ids, max_new_tokens=2, **bt.sharded_cache(skewed))
    # Gemma 3's wrapper turns its inputs into a mask dict before the decoder: they are read where it takes them
    _, gemma3 = _models(_gemma3_wrapper(), name, reference="eager")
    image_tokens = torch.zeros_like(ids)
    image_tokens[0, :2] = 1  # two tokens marked as an image's: they would attend both ways
    cases["gemma3 padding"] = lambda: gemma3.generate(
        torch.cat([ids, ids]), attention_mask=left_padded, max_new_tokens=2, **bt.sharded_cache(gemma3)
    )
    cases["gemma3 image tokens"] = lambda: gemma3.generate(
        ids, token_type_ids=image_tokens, max_new_tokens=2, **bt.sharded_cache(gemma3)
    )
    layers = model.config.num_hidden_layers
    results = value_errors(cases)
    results["layers kept"] = model.config.num_hidden_layers == layers
    tokens = _generate(model, ids, **bt.sharded_cache(model), do_sample=False)[0]
    results["works after"] = torch.equal(tokens, _generate(reference, ids, do_sample=False)[0])
    results["stop_strings"] = _stop_strings(reference, model, ids)
    results["a rule that stops one rank"] = _one_rank_stops(reference, model, ids, rank)
    # A prompt given as inputs_embeds (generate returns only the new tokens then) is sharded the same way.
    embeds = model.get_input_embeddings()(ids)
    out = model.generate(
        inputs_embeds=embeds, **bt.sharded_cache(model), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    results["inputs_embeds"] = torch.equal(out, tokens)
    # output_hidden_states: every layer's hidden states of the whole prompt (not this rank's shard), as one process's
    hidden = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    longer = _prompt(1, 2 * world + 3, seed=5)  # not a multiple of the layout's: the padding cut off too
    ours = model.generate(longer, **bt.sharded_cache(model), **hidden).hidden_states[0]
    theirs = reference.generate(longer, **hidden).hidden_states[0]
    results["hidden states"] = max(_rel(a, b) for a, b in zip(ours, theirs)) if len(ours) == len(theirs) else 1.0
    results["hidden shapes"] = [tuple(a.shape) == tuple(b.shape) for a, b in zip(ours, theirs)]
    # back on torch's own attention, the model's generation modes are its own again: beam search runs
    model.set_attn_implementation("sdpa")
    beams = dict(max_new_tokens=3, num_beams=2, do_sample=False)
    results["beams after"] = torch.equal(model.generate(ids, **beams), reference.generate(ids, **beams))
    return results


def _one_rank_stops(reference, model, ids, rank) -> bool:
    """A stopping rule that decides on one rank only (as max_time does, reading each rank's clock) stops every
    rank there: the others had waited in the next token's agreement until it timed out."""
    import burst.integrations.transformers as bt
    from burst.agreement import agreement_timeout, set_agreement_timeout
    from transformers import StoppingCriteria, StoppingCriteriaList

    class SecondTokenOnRankOne(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = rank == 1 and input_ids.shape[1] >= ids.shape[1] + 2
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool)

    options = dict(max_new_tokens=6, do_sample=False)
    before = set_agreement_timeout(30)  # a regression fails in 30 s, not the default 120
    try:
        rule = StoppingCriteriaList([SecondTokenOnRankOne()])
        ours = model.generate(ids, stopping_criteria=rule, **options, **bt.sharded_cache(model))
    finally:
        set_agreement_timeout(before)
    theirs = reference.generate(ids, max_new_tokens=2, do_sample=False)
    return torch.equal(ours, theirs) and agreement_timeout() == before


def _stop_strings(reference, model, ids) -> bool:
    """generate(stop_strings=, tokenizer=) stops where one process stops (transformers hands `tokenizer` down to the
    attention function too). A tokenizer of one character per token id, made here (nothing downloaded)."""
    import string

    import burst.integrations.transformers as bt
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (string.ascii_letters + string.digits + "+/")[:VOCAB]
    words = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Split(Regex("."), behavior="isolated"), decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token=chars[0], eos_token=chars[1])
    options = dict(max_new_tokens=8, do_sample=False, tokenizer=tokenizer)
    stop = chars[int(reference.generate(ids, **options)[0, ids.shape[1] + 2])]  # the third new token's
    theirs = reference.generate(ids, stop_strings=[stop], **options)
    ours = model.generate(ids, stop_strings=[stop], **options, **bt.sharded_cache(model))
    return theirs.shape[1] < ids.shape[1] + 8 and torch.equal(ours, theirs)


def _everything(rank, world):
    torch.set_num_threads(1)
    results = {"greedy": _greedy(rank, world)}
    if world in (2, 3):
        results["models"] = _other_models(rank, world)
    if world == 2:
        results["errors"] = _errors(rank, world)
    return results


_results = results_by_world(_everything, timeout=400)


def _same_on_every_rank(per_rank, key):
    for rank, run in enumerate(per_rank):
        assert torch.equal(run["tokens"], per_rank[0]["tokens"]), (rank, key)
        assert torch.equal(run["logits"], per_rank[0]["logits"]), (rank, key)  # bit-identical, not just close


@pytest.mark.parametrize("world", [2, 3])
def test_greedy_and_sampled_tokens_equal_one_process_generate(world):
    per_rank = [r["greedy"] for r in _results(world)]
    for key in per_rank[0]:
        runs = [r[key] for r in per_rank]
        _same_on_every_rank(runs, key)
        assert runs[0]["same tokens"] and runs[0]["logits error"] < 1e-4, (key, runs[0]["logits error"])


@pytest.mark.parametrize("world", [2, 3])
def test_cache_holds_its_share_of_the_tokens(world):
    """Each rank holds its prompt shard (padded to the layout's multiple) and every G-th decoded token."""
    from burst.layout import local_multiple

    per_rank = [r["greedy"] for r in _results(world)]
    for layout in LAYOUTS:
        key, length = layout, 3 * world + 1
        multiple = world * local_multiple(layout)
        padded = -(-length // multiple) * multiple
        decoded = NEW - 1  # the last token is sampled, never run
        whole = per_rank[0][key]["whole bytes"]
        per_entry = whole // (length + decoded)
        for rank, results in enumerate(per_rank):
            entries = padded // world + len(range(rank, decoded, world))
            assert results[key]["entries"] == entries, (key, rank, results[key]["entries"], entries)
            assert results[key]["bytes"] == entries * per_entry, (key, rank)
            assert results[key]["bytes"] <= whole / world + 2 * multiple * per_entry, (key, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_sliding_window_qwen2_and_bfloat16(world):
    per_rank = [r["models"] for r in _results(world)]
    for key in (
        "mistral window",
        "qwen2",
        "mla",
        "softcap",
        "gemma3 wrapper",
        "dsa",
        "dsa padded",
        "compressed",
        "blocks per kv head",
        "dynamic mask",
        "chunks",
        "dynamic rope",
        "longrope switch",
        "longrope past the switch",
        "inference mode",
        "bfloat16",
        "autocast",
    ):
        runs = [r[key] for r in per_rank]
        _same_on_every_rank(runs, key)
        bf16 = key in ("bfloat16", "autocast")
        bound = 3e-2 if bf16 else 1e-4
        assert runs[0]["logits error"] < bound, (key, runs[0]["logits error"])
        if not bf16:  # bfloat16 rounding may flip a near tie; the logits bound above still holds
            assert runs[0]["same tokens"], key
    assert per_rank[0]["window effect"] > 1e-3  # the window matters in these runs
    assert per_rank[0]["switch effect"] > 1e-3  # and so does running the sequence again at the rope switch
    assert per_rank[0]["softcap effect"] > 1e-3  # and the cap
    assert per_rank[0]["chunk effect"] > 1e-3  # and the chunks
    assert per_rank[0]["dsa effect"] > 1e-3  # and the indexer's choice of keys
    assert per_rank[0]["compressed effect"] > 1e-3  # and V4's of entries
    assert per_rank[0]["blocks effect"] > 1e-3  # and of blocks, per KV head
    assert per_rank[0]["dynamic mask effect"] > 1e-3  # and the keys kept by their bias


def test_generate_without_sharded_cache_raises_on_every_rank_and_inputs_embeds_work():
    expected = {
        "no cache": "ShardedCache",
        "use_cache=False": "ShardedCache",
        "padding mask": "padding",
        "beam search": "beam search",
        "early exit": "greedy search and sampling on burst's ShardedCache",
        "prompt lookup": "greedy search and sampling on burst's ShardedCache",
        "prompts differ": "prompt ids differs across ranks",
        "embeddings differ": "prompt sums differs across ranks",
        "max_new_tokens differ": "generate()'s max_new_tokens differs across ranks (rank 0: 2, rank 1: 3",
        "eos differs": "generate()'s eos_token_id differs across ranks",
        "use_cache=False with a cache": "use_cache=False (which reruns the whole sequence at each step)",
        "prefill_chunk_size": "prefill_chunk_size (which runs the prompt in pieces) are not supported",
        "seeds differ": "the same torch.manual_seed on every rank",
        "weights differ": "must run one model",
        "tokens part later": "new token ids differs across ranks",
        "guidance_scale": "guidance_scale's unconditional pass",
        "gemma3 padding": "padding",
        "gemma3 image tokens": "token_type_ids marking tokens that are not text",
    }
    for rank, results in enumerate(_results(2)):
        errors = results["errors"]
        for case, words in expected.items():
            assert errors[case] is not None and words in errors[case], (rank, case, errors[case])
        assert errors["works after"] and errors["inputs_embeds"] and errors["layers kept"], rank
        assert errors["stop_strings"] and errors["beams after"], rank
        assert errors["a rule that stops one rank"], rank
        assert all(errors["hidden shapes"]) and errors["hidden states"] < 1e-5, (rank, errors["hidden states"])


def _torchrun_tokens(nproc: int) -> list[str]:
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    done = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(root / "examples" / "transformers_generate.py"),
            "--new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        # the example as a user runs it, with no deprecated keyword (FutureWarning as an error)
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::FutureWarning"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("tokens")]


def test_torchrun_example_generates_like_one_process():
    """The README's generate() recipe as a user runs it: torchrun, 2 ranks vs 1."""
    one, two = _torchrun_tokens(1), _torchrun_tokens(2)
    assert len(one) == 2 and one == two, (one, two)


def test_a_prompt_is_plain_text_only_without_padding_images_or_non_text_token_types():
    """decoding.beyond_a_text_prompt: what lets a ShardedCache drop a multimodal wrapper's mask dict."""
    from burst.integrations.transformers.decoding import beyond_a_text_prompt

    ids = torch.ones(1, 5, dtype=torch.long)
    plain = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    assert beyond_a_text_prompt(plain) == ""
    assert beyond_a_text_prompt({**plain, "mm_encoder_outputs": {}, "pixel_values": None}) == ""  # as generate() passes
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    assert "padding" in beyond_a_text_prompt({**plain, "attention_mask": padded})
    assert "padding" in beyond_a_text_prompt({**plain, "attention_mask": {"full_attention": None}})
    assert "pixel_values" in beyond_a_text_prompt({**plain, "pixel_values": torch.zeros(1, 3, 8, 8)})
    assert "input_features" in beyond_a_text_prompt({**plain, "input_features": torch.zeros(1, 4, 8)})
    assert "mm_encoder_outputs" in beyond_a_text_prompt({**plain, "mm_encoder_outputs": {"image": torch.zeros(1)}})
    assert "mm_token_type_ids" in beyond_a_text_prompt({**plain, "mm_token_type_ids": torch.tensor([[0, 2, 0]])})


def test_an_indexers_choice_becomes_the_positions_a_decode_step_attends():
    """decoding.chosen_positions: DeepSeek's indices (-1: none, never position 0) and MiniMax-M3's blocks per
    KV head (-1: none) as bool over the positions so far."""
    from burst.integrations.transformers.decoding import chosen_positions

    got = chosen_positions({"indices": torch.tensor([[[2, -1, 3]]])}, None, 4)
    assert got.tolist() == [[False, False, True, True]]
    got = chosen_positions({"block_indices": torch.tensor([[[[1, -1]], [[0, -1]]]])}, 2, 5)
    assert got.tolist() == [[[False, False, True, True, False], [True, True, False, False, False]]]
    assert chosen_positions({}, None, 4) is None
    with pytest.raises(ValueError, match="one new token's indices"):
        chosen_positions({"indices": torch.zeros(1, 2, 3, dtype=torch.long)}, None, 4)


def test_the_agreed_generation_settings_leave_out_generate_s_own_tensors(monkeypatch):
    """generate() keeps working copies on its config (_eos_token_tensor, on each rank's own device: their reprs
    differ on a host of several GPUs, so every generate() there was refused; a diff review). Only the public
    settings are agreed on."""
    from types import SimpleNamespace

    import burst.agreement
    from burst.integrations.transformers import decoding
    from transformers import GenerationConfig

    agreed = {}
    monkeypatch.setattr(decoding, "backend_of", lambda model: ("burst", SimpleNamespace(group=None)))
    monkeypatch.setattr(decoding, "world_size", lambda group: 2)
    monkeypatch.setattr(burst.agreement, "agree", lambda entry, facts, *args, **kwargs: agreed.update(facts))
    config = GenerationConfig(max_new_tokens=3, eos_token_id=2)
    config._eos_token_tensor = torch.tensor([2])
    decoding.agree_on_settings(None, config)
    assert agreed["generate()'s max_new_tokens"] == 3 and agreed["generate()'s eos_token_id"] == 2
    assert not [name for name in agreed if "'s _" in name], sorted(agreed)
