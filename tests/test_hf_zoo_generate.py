"""The generation zoo (burst/bench/hf_zoo_generate.py; the table: benchmarks/hf_zoo_generate.md, `python
benchmarks/hf_zoo_generate.py`): for every causal-LM family transformers ships, generate() on burst's sharded KV
cache at 2 ranks against the same model's eager attention generating in one process (a 2-rank world, about
20 s). Each is exact (the same tokens, logits within 1e-4) or refused with a clear error, never silently
different, never a traceback or a hang; the families whose decoding went wrong before are named below.
"""

from __future__ import annotations

import functools

from requires import transformers_or_skip

transformers_or_skip()

EXACT = (
    "llama",  # the plain case
    "deepseek_v3",  # MLA: the cached latent expanded by the layer's own expand_kv
    "minicpm3",
    "gpt_oss",  # sinks, a window
    "phi3",
    "gpt2",  # the LM head hands the decoder its input_ids by position
    "gpt_neox",
    "codegen",
    "mllama",  # get_decoder() returns the causal LM itself: the decoder is its `model`
    "modernbert-decoder",  # get_decoder() returns the LM head
    "cohere_compass_text",  # its positions hook must see the shard: burst's decoder hook runs first
    "hrm_text",  # its cycles store under slots of their own: the update's slot is attended
    "gemma3n_text",  # KV sharing: a layer attends the slot of the layer whose new K, V it hands
    "diffllama",  # its values split into two halves of heads after the cache, each attended: heads picked
    "gemma2",  # softcap, capped on each rank before the merge
    "llama4_text",  # chunked attention: a new token reads its own chunk's entries
    "gemma3",  # a multimodal wrapper's mask dict, dropped once its own inputs are seen to be plain text
    "gemma4",  # and its per-layer inputs cut to the shard with the embeddings
    "gemma4_unified",
    "deepseek_v32",  # DeepSeek sparse attention: the indexer's keys kept whole, the chosen entries attended
    "glm_moe_dsa",
    "deepseek_v4",  # compressed attention: each layer's compressor state whole on every rank, entries shared out
    "minimax_m3_vl_text",  # key blocks chosen per KV head: each KV head attends its own entries
    "doge",  # a bias per cached key from its value, folded into the keys
    "qwen3_5_text",  # hybrids: the prompt's recurrent states kept whole on every rank, each new token run whole
    "kimi_linear",
    "jamba",
    "nemotron_h",  # Mamba2 steps clamped above 0: the padding's decay undone
    "lfm2",
    "minimax",  # lightning attention: its state after the prompt in the family's own cache class
    "zaya",  # CCA: the prompt's last q/k projections and delayed value kept
    "recurrent_gemma",  # RG-LRU and its convolution: their states on the modules
)
REFUSED = {
    "rwkv": "mixes tokens outside attention",  # its LM head passes no cache down: refused before it is touched
    "bert": "needs causal attention",  # an encoder without is_decoder: transformers re-runs every step
}


@functools.lru_cache(maxsize=None)
def _zoo():
    from burst.bench.hf_zoo_generate import run_zoo

    return run_zoo(nproc=2, log=lambda *_: None)


def test_generate_on_the_sharded_cache_is_exact_or_refused_for_each_family():
    rows = _zoo()
    wrong = {f: (o.outcome, o.detail) for f, o in rows.items() if o.outcome in ("silent", "crash")}
    assert not wrong, wrong
    for family in EXACT:
        assert rows[family].outcome == "exact", (family, rows[family].detail)
    assert sum(o.outcome == "exact" for o in rows.values()) >= 140  # benchmarks/hf_zoo_generate.md's count
    for family, words in REFUSED.items():
        assert rows[family].outcome == "refused" and words in rows[family].detail, (family, rows[family].detail)


def test_a_change_of_keys_after_the_cache_is_followed_only_where_it_is_seen_exactly():
    """decoding.attend_rule: the entries as stored, heads picked (DiffLlama), or MLA's expansion, each
    taken only once it turns the new token's stored K, V into what the layer hands; anything else
    (values scaled, heads that cannot be told apart) has no rule, and decoding refuses."""
    import torch
    from burst.integrations.transformers.decoding import attend_rule

    layer = torch.nn.Linear(1, 1)  # no expand_kv
    k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    stored_k, stored_v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 4, 8)  # burst's (batch, entries, heads, dim)
    same = attend_rule(layer, (k, v), (k, v))
    assert all(torch.equal(a, b) for a, b in zip(same(stored_k, stored_v), (stored_k, stored_v)))
    halves = attend_rule(layer, (k, v), (k, v[:, [2, 3, 2, 3]]))  # DiffLlama's second call: heads 2, 3 twice
    got_k, got_v = halves(stored_k, stored_v)
    assert torch.equal(got_k, stored_k) and torch.equal(got_v, stored_v[:, :, [2, 3, 2, 3]])
    assert attend_rule(layer, (k, v), (k, 2 * v)) is None
    twins = torch.cat([v[:, :1], v[:, :1], v[:, 2:]], dim=1)  # two equal heads: which one is handed is unknown
    assert attend_rule(layer, (k, twins), (k, twins[:, [0, 2]])) is None
