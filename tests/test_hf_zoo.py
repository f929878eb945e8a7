"""The zoo: every causal-LM family transformers ships, built tiny from its own config class, on
burst's backend at 1 rank and at 2 ranks (contiguous and zigzag) against the same model's eager
attention in one process (burst/bench/hf_zoo.py): logits, loss and, where the family's own loss runs on
token ids, one backward (every parameter's gradient, hf_zoo.GRADIENT_TOLERANCE); the suite runs
zigzag at 2 ranks (the layout with two chunks per rank), the table both. Each family is exact or
refused with a clear error, never silently different and never a traceback; benchmarks/hf_zoo.md
is the table (`python benchmarks/hf_zoo.py`). One 2-rank world runs every family (about a minute).
"""

from __future__ import annotations

import functools

from requires import transformers_or_skip
from world import run_world

transformers_or_skip()

SINK_FAMILIES = ("gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash")
# issue 53's and 54's flagships: softcap, chunked attention, per-layer head dims, DeepSeek sparse attention
# (index_topk 16 of 128 tokens in the zoo's configs: the selection prunes) and DeepSeek-V4's compressed attention
FLAGSHIPS = (
    "gemma2",
    "vaultgemma",
    "llama4",
    "llama4_text",
    "gemma4",
    "gemma4_text",
    "gemma4_unified",
    "gemma4_unified_text",
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    "axk2",
    "deepseek_v4",
)
# issue 53 item 3: every family is built tiny but where transformers itself cannot run it eagerly on token
# ids (a timm vision tower without timm, an assistant that needs its backbone's KV)
MAX_SKIPPED = 10
# issue 60 item 5: attention modules handed no position_ids, which shard_batch(model=) keeps for them from the
# nearest module above that takes them (GPTBigCode's, CTRL's, Dory's, Cohere Compass's model: refused before)
POSITIONS_KEPT_FROM_THE_MODEL = ("gpt_bigcode", "ctrl", "dory", "cohere_compass_text")
# issue 60 item 5: a sliding window in the config that neither the attention call nor the mask applies
WINDOW_NOT_IN_MASK = ("moshi",)
# issue 60 item 5: Doge's dynamic mask, a bias per key folded into the keys (tests/test_hf_flagships.py:
# A drawn, a window); issue 68: past keep_window_size (64 of 128 tokens here), each row's keys per KV
# head as indices= (test_hf_selection.py: the published keep_window_size of 2048)
DYNAMIC_MASK = ("doge",)
# issue 68: a sliding window the model's mask applies and the attention does not pass, read from the config
WINDOW_FROM_CONFIG = ("phimoe",)
# issue 68: MiniMax-M3's block indexer shown the whole sequence, its key blocks per KV head handed as burst.BlockIndices
BLOCK_SELECTION = ("minimax_m3_vl_text",)
# hybrids burst refuses: Inkling's attention adds a query-conditioned relative position bias (position_bias=)
UNSPLIT_HYBRIDS = ("inkling_text", "inkling2_text", "inkling2_loop_text")


@functools.lru_cache(maxsize=None)
def _zoo():
    from burst.bench.hf_zoo import zoo_world

    return run_world(2, zoo_world, None, ("zigzag",), timeout=900)  # contiguous too: benchmarks/hf_zoo.py


def test_no_family_is_silently_wrong_or_crashes():
    rows = _zoo()[0]
    bad = [
        f"{family} ({setting}): {o.outcome}: {o.detail}"
        for family, by in rows.items()
        for setting, o in by.items()
        if o.outcome in ("silent", "crash")
    ]
    assert not bad, "\n".join(bad)
    refused_without_reason = [
        f for f, by in rows.items() for o in by.values() if o.outcome == "refused" and not o.detail
    ]
    assert not refused_without_reason


def test_every_family_is_built_but_those_transformers_cannot_run_on_token_ids():
    rows = _zoo()[0]
    skipped = {family: by["1 rank"].detail for family, by in rows.items() if by["1 rank"].outcome == "skip"}
    print("\n".join(f"skipped {family}: {reason}" for family, reason in skipped.items()))
    assert len(skipped) <= MAX_SKIPPED, skipped
    assert all(skipped.values()), skipped  # each with its reason


def test_every_rank_sees_the_same_outcomes():
    first, second = _zoo()
    assert {f: {s: o.outcome for s, o in by.items()} for f, by in first.items()} == {
        f: {s: o.outcome for s, o in by.items()} for f, by in second.items()
    }


def test_sink_families_flagships_and_the_common_ones_are_exact_at_1_and_2_ranks():
    rows = _zoo()[0]
    for family in (
        SINK_FAMILIES
        + FLAGSHIPS
        + POSITIONS_KEPT_FROM_THE_MODEL
        + WINDOW_NOT_IN_MASK
        + DYNAMIC_MASK
        + BLOCK_SELECTION
        + WINDOW_FROM_CONFIG
        + ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gpt2", "olmo2")
    ):
        if family not in rows:  # a family this transformers release does not ship (the lowest tested)
            continue
        assert {o.outcome for o in rows[family].values()} == {"exact"}, (family, rows[family])
    settings = list(rows["llama"])
    assert settings == ["1 rank", "2 ranks zigzag"]
    exact_at_2 = sum(by["2 ranks zigzag"].outcome == "exact" for by in rows.values())
    assert exact_at_2 >= 80, exact_at_2  # most families run: refusing is not how the zoo passes


def test_hybrids_are_exact_across_ranks_or_refused():
    """The families whose recurrent / convolutional mixers burst splits (bt.FAMILIES) are exact at
    2 ranks; any other hybrid is refused."""
    from burst.integrations.transformers import FAMILIES

    rows = _zoo()[0]
    for family in (f for f in FAMILIES if f in rows):
        assert {o.outcome for o in rows[family].values()} == {"exact"}, (family, rows[family])
    for family in (f for f in UNSPLIT_HYBRIDS if f in rows):
        assert rows[family]["2 ranks zigzag"].outcome in ("refused", "skip"), (family, rows[family])


def test_families_that_pick_attention_classes_by_name_are_refused_by_burst():
    """falcon, gpt_neo and git look their attention class up by implementation name: transformers raises
    a bare KeyError for any registered backend. burst's own check (bt.check_backend_compatible, which the
    zoo calls before building, as a user can) says why instead."""
    rows = _zoo()[0]
    for family in ("falcon", "gpt_neo", "git"):
        if family not in rows:
            continue
        for setting, outcome in rows[family].items():
            assert outcome.outcome == "refused" and "ATTENTION_CLASSES by name" in outcome.detail, (
                family,
                setting,
                outcome,
            )


def test_a_window_no_mask_applies_is_left_out_but_refused_when_decoding(monkeypatch):
    """Moshi's config has a sliding window that its attention call and its model's mask (create_causal_mask) leave
    out: eager attends the whole sequence, and burst does (the zoo: exact with a window of 32 in 128 tokens), but
    transformers' cache applies it when decoding, which burst's sharded cache does not copy: refused there. A
    release whose modeling module builds a sliding-window mask is refused as any unpassed window is."""
    import sys

    import pytest
    from burst.bench.hf_zoo_configs import causal_lm, tiny_config
    from burst.integrations.transformers import check_model_features

    config = tiny_config("moshi")
    assert config.sliding_window
    attention = causal_lm("moshi", config).model.layers[0].self_attn
    assert check_model_features("burst", attention, None) is None
    with pytest.raises(ValueError, match="generate on one rank"):
        check_model_features("burst", attention, None, decoding=True)
    monkeypatch.setattr(
        sys.modules[type(attention).__module__], "create_sliding_window_causal_mask", None, raising=False
    )
    with pytest.raises(ValueError, match="does not pass as sliding_window="):
        check_model_features("burst", attention, None)


def test_a_silent_family_carries_its_control(monkeypatch):
    """A silent outcome says whose difference it is: the family's own sdpa on eager's weights is run against
    its eager. Planted: burst's output scaled (sdpa agrees: burst's), then sdpa's scaled too (the family's own
    paths disagree, as moshi's eager and sdpa did on transformers 5.17)."""
    import burst.integrations.transformers as bt
    from burst.bench.hf_zoo import run_family
    from burst.integrations.transformers.backend.attention import burst_attention_forward
    from transformers import AttentionInterface

    def scaled(attention):
        def forward(*args, **kwargs):
            out, weights = attention(*args, **kwargs)
            return out * 1.5, weights

        return forward

    name = bt.register("zoo_planted")
    monkeypatch.setitem(AttentionInterface._global_mapping, name, scaled(burst_attention_forward))
    outcome, _ = run_family("llama", name, "contiguous")
    assert outcome.outcome == "silent" and "its own sdpa agrees with its eager" in outcome.detail, outcome
    sdpa = AttentionInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", scaled(sdpa))
    outcome, _ = run_family("llama", name, "contiguous")
    assert outcome.outcome == "silent" and "transformers' paths disagree" in outcome.detail, outcome
