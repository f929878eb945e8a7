"""DeepSeek sparse attention (DeepSeek-V3.2 and the families that reuse its indexer) and DeepSeek-V4's
compressed attention across ranks.

Tiny configs with index_topk 8 over 128 tokens, so the selection prunes (each query attends at most
8 of up to 128 keys); DeepSeek-V4 with a CSA layer (entries of 4 tokens, index_topk 4 of up to 32
entries) and an HCA layer (entries of 8 tokens) beside a 32-token sliding window and sinks. Every family
at 2 and 4 ranks in zigzag; contiguous at 2 ranks for V3.2 (whose indexer the other DSA families reuse) and
V4; at 2 ranks in both layouts V4 also at 120 tokens, so that windows cross chunk boundaries, and at
64 tokens with HCA's published 128-token windows, none of which ends; against the same model with
eager attention in one process: logits, loss, every parameter gradient, and the indexers' selections
themselves, row by row (the keys or entries each query chose, among those it may see). Planted:
every other rank's indexer keys replaced by zeros (a V3.2 rank choosing from what it holds), and
every other rank's compressed entries zeroed (a V4 rank compressing only its own windows), each of
which must be caught (at 2 ranks).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

SEQ = 128
TOPK = {"deepseek_v32": 8, "glm_moe_dsa": 8, "hy_v4": 8, "axk2": 8, "deepseek_v4": 4}
FAMILIES = tuple(TOPK)
CONTIGUOUS = ("deepseek_v32", "deepseek_v4")  # the indexer the DSA families share, and V4's compressor
# tiny float32 models, one process against the world: the bounds of tests/test_hf_rope.py and test_hf_hybrid.py
BOUND = {"logits": 2e-5, "loss": 2e-6, "gradients": 1e-4}


def _config(family):
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config(family)
    config.index_topk = TOPK[family]
    return config


def _selections(model):
    """A list that fills with each indexer's output, (batch, rows, topk), in call order (V3.2's and
    V4's: key positions or entry numbers)."""
    seen = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer") and hasattr(module, "index_topk"):
            module.register_forward_hook(lambda mod, args, kwargs, out: seen.append(out), with_kwargs=True)
    return seen


def _chosen_sets(indices: torch.Tensor) -> list:
    """For each (batch, row): the set of chosen keys it may see (key <= row: the others are masked;
    V4's entries numbers, -1 where none)."""
    return [[{j for j in row.tolist() if 0 <= j <= i} for i, row in enumerate(b)] for b in indices]


def _errors(family, name, layout, group=None, seq=SEQ, config=None) -> dict:
    from burst import layout as layout_mod
    from burst.bench.hf_steps import step_errors, twin_models
    from burst.bench.hf_zoo import VOCAB

    eager, model = twin_models(family, name, config or _config(family))
    expected_sel, got_sel = _selections(eager), _selections(model)
    ids = torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))
    errors = step_errors(eager, model, ids, layout, group)
    whole = [layout_mod.unshard(s.contiguous(), group=group, layout=layout, dim=1) for s in got_sel]
    errors["same selections"] = len(whole) == len(expected_sel) > 0 and all(
        _chosen_sets(a) == _chosen_sets(b) for a, b in zip(whole, expected_sel)
    )
    errors["layers"] = len(whole)
    rate = getattr(model.config, "compress_rates", {}).get("compressed_sparse_attention")
    errors["pruned rows"] = _pruned_share(whole[0], rate) if whole else 0.0
    return errors


def _pruned_share(indices: torch.Tensor, rate: int | None) -> float:
    """The share of rows (past the first quarter) that chose fewer keys than they may see (row i: i + 1
    keys, or (i + 1) // rate of V4's entries): the selection prunes (a top-k covering every key would
    prove nothing)."""
    chosen = torch.tensor([[len(s) for s in rows] for rows in _chosen_sets(indices)])
    visible = torch.arange(indices.shape[1]) + 1
    if rate is not None:
        visible = visible // rate
    late = slice(indices.shape[1] // 4, None)
    return float((chosen[:, late] < visible[None, late]).float().mean())


def _dsa(rank, world):
    import burst.integrations.transformers as bt
    import transformers
    from burst.bench.hf_zoo import families
    from burst.integrations.transformers.layers import compressed, indexer

    transformers.logging.set_verbosity_error()
    out = {}
    for layout in ("contiguous", "zigzag") if world == 2 else ("zigzag",):
        name = bt.register(f"dsa_{layout}", layout=layout)
        for family in FAMILIES if layout == "zigzag" else CONTIGUOUS:
            if family in families():
                out[(family, layout)] = _errors(family, name, layout)
        if (
            "deepseek_v4" in families() and world == 2
        ):  # 120 tokens: windows of 4 and 8 tokens cross the shards' chunk boundaries
            out[("deepseek_v4", layout, "120 tokens")] = _errors("deepseek_v4", name, layout, seq=120)
            published = _config("deepseek_v4")  # HCA's published 128-token windows: none ends in 64 tokens
            published.compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            out[("deepseek_v4", layout, "64 tokens, HCA of 128")] = _errors(
                "deepseek_v4", name, layout, seq=64, config=published
            )
    if world > 2:  # the planted faults: at 2 ranks
        return out
    gather = indexer._GatheredKeys.update_indexer

    def own_keys_only(self, keys, layer_idx):  # the planted fault: every other rank's keys lost (zeros)
        from burst import layout as layout_mod

        whole = gather(self, keys, layer_idx)
        mine = layout_mod.shard_indices(self.layout, rank, world, whole.shape[1])
        kept = torch.zeros_like(whole)
        kept[:, mine] = whole[:, mine]
        return kept

    with mock.patch.object(indexer._GatheredKeys, "update_indexer", own_keys_only):
        out["planted"] = _errors("deepseek_v32", bt.register("dsa_planted", layout="zigzag"), "zigzag")
    gather_entries = compressed._gathered_in_order

    def own_entries_only(made, every, rate, group, phase):  # the planted fault: every other rank's entries lost
        whole = gather_entries(made, every, rate, group, phase)
        own = torch.zeros(whole.shape[1], dtype=whole.dtype)
        for seg in every[rank]:
            own[seg.first // rate : (seg.first + seg.length) // rate] = 1
        return whole * own[None, :, None]

    with mock.patch.object(compressed, "_gathered_in_order", own_entries_only):
        out["planted v4"] = _errors("deepseek_v4", bt.register("v4_planted", layout="zigzag"), "zigzag")
    return out


_results = results_by_world(_dsa)


@pytest.mark.parametrize("world", [2, 4])
def test_dsa_families_exact_with_pruning_selections(world):
    results = _results(world)[0]
    assert ("deepseek_v32", "zigzag") in results
    if world == 2:
        assert {("deepseek_v32", "contiguous"), ("deepseek_v4", "contiguous")} <= set(results), sorted(results)
    for case, errors in results.items():
        if isinstance(case, str):  # the planted faults
            continue
        assert errors["same selections"] and errors["layers"] >= (1 if case[0] == "deepseek_v4" else 2), (case, errors)
        assert errors["pruned rows"] > 0.5, (case, errors)
    failures = [
        (case, errors)
        for case, errors in results.items()
        if not isinstance(case, str) and not all(errors[k] <= BOUND[k] for k in BOUND)
    ]
    assert not failures, failures


@pytest.mark.parametrize("planted", ["planted", "planted v4"])
def test_an_indexer_or_compressor_seeing_only_its_shard_is_caught(planted):
    planted = _results(2)[0][planted]
    assert not planted["same selections"]
    assert planted["logits"] > BOUND["logits"] or planted["gradients"] > BOUND["gradients"], planted


def test_a_prepared_v4_refuses_another_attention_backend():
    """Prepared compressors return entries without transformers' block bias; on another backend every
    query would see every entry, so the compressor refuses it."""
    import burst.integrations.transformers as bt
    import transformers
    from burst.bench.hf_steps import twin_models
    from burst.bench.hf_zoo import VOCAB, families

    if "deepseek_v4" not in families():
        pytest.skip("this transformers release has no DeepSeek-V4")
    transformers.logging.set_verbosity_error()
    eager, model = twin_models("deepseek_v4", bt.register("v4_alone"), _config("deepseek_v4"))
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    batch = bt.shard_batch({"input_ids": ids, "labels": ids}, model=model)
    expected = eager(input_ids=ids, use_cache=False).logits
    assert (model(**batch, use_cache=False).logits - expected).abs().max() < BOUND["logits"]
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="not a burst backend"):
        model(**batch, use_cache=False)


def test_v4_with_packed_documents_is_refused():
    """Packed rows (position ids restarting) would give entries spanning documents: refused, not silent."""
    import burst.integrations.transformers as bt
    import transformers
    from burst.bench.hf_steps import twin_models
    from burst.bench.hf_zoo import VOCAB, families

    if "deepseek_v4" not in families():
        pytest.skip("this transformers release has no DeepSeek-V4")
    transformers.logging.set_verbosity_error()
    _, model = twin_models("deepseek_v4", bt.register("v4_packed"), _config("deepseek_v4"))
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(40), torch.arange(24)])[None]
    batch = bt.shard_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, model=model)
    with pytest.raises(ValueError, match="compressed attention with packed documents"):
        model(**batch, use_cache=False)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_the_first_forward_on_a_cache_runs_and_decoding_on_it_is_refused(family):
    """transformers makes a cache unless use_cache=False (the README's line passes none): that forward
    runs exactly; a later one on the same cache would see only the new tokens, and raises."""
    import burst.integrations.transformers as bt
    import transformers
    from burst.bench.hf_steps import twin_models
    from burst.bench.hf_zoo import VOCAB, families
    from burst.integrations.transformers.keywords import generate_cache_keyword

    if family not in families():
        pytest.skip(f"this transformers release has no {family}")
    transformers.logging.set_verbosity_error()
    eager, model = twin_models(family, bt.register("dsa_cache"), _config(family))
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    out = model(**bt.shard_batch({"input_ids": ids}, model=model))  # use_cache left to the config: a cache
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert cache is not None
    assert (out.logits - eager(input_ids=ids, use_cache=False).logits).abs().max() < BOUND["logits"]
    with pytest.raises(ValueError, match="decoding on a cache"):
        model(input_ids=ids[:, -1:], **{generate_cache_keyword(): cache}, position_ids=torch.tensor([[64]]))
