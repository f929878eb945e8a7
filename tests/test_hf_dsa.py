"""DeepSeek sparse attention (DeepSeek-V3.2 and the families that reuse its indexer) across ranks.

Tiny configs with index_topk 8 over 128 tokens, so the selection prunes (each query attends at most
8 of up to 128 keys). At 2 and 4 ranks, contiguous and zigzag, against the same model with eager
attention in one process: logits, loss, every parameter gradient, and the indexer's selections
themselves, row by row (the keys each query chose, among those it may see). Planted: every other
rank's indexer keys replaced by zeros (a rank choosing from what it holds), which must be caught.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

SEQ, TOPK = 128, 8
FAMILIES = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")
BOUND = {"logits": 2e-4, "loss": 2e-5, "gradients": 1e-3}


def _config(family):
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config(family)
    config.index_topk = TOPK
    return config


def _selections(model):
    """A list that fills with each indexer's output, (batch, rows, topk), in call order."""
    from burst.integrations.transformers.layers.indexer import is_indexer

    seen = []
    for module in model.modules():
        if is_indexer(module):
            module.register_forward_hook(lambda mod, args, kwargs, out: seen.append(out), with_kwargs=True)
    return seen


def _chosen_sets(indices: torch.Tensor) -> list:
    """For each (batch, row): the set of chosen keys it may see (key <= row: the others are masked)."""
    return [[{j for j in row.tolist() if j <= i} for i, row in enumerate(b)] for b in indices]


def _errors(family, name, layout, group=None) -> dict:
    from burst import layout as layout_mod
    from burst.bench.hf_zoo import VOCAB, step_errors, twin_models

    eager, model = twin_models(family, name, _config(family))
    expected_sel, got_sel = _selections(eager), _selections(model)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    errors = step_errors(eager, model, ids, layout, group)
    whole = [layout_mod.unshard(s.contiguous(), group=group, layout=layout, dim=1) for s in got_sel]
    errors["same selections"] = len(whole) == len(expected_sel) > 0 and all(
        _chosen_sets(a) == _chosen_sets(b) for a, b in zip(whole, expected_sel))
    errors["layers"] = len(whole)
    return errors


def _dsa(rank, world):
    import transformers

    import burst.integrations.transformers as bt
    from burst.bench.hf_zoo import families
    from burst.integrations.transformers.layers import indexer

    transformers.logging.set_verbosity_error()
    out = {}
    for layout in ("contiguous", "zigzag"):
        name = bt.register(f"dsa_{layout}", layout=layout)
        for family in FAMILIES:
            if family in families():
                out[(family, layout)] = _errors(family, name, layout)
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
    return out


_results = results_by_world(_dsa)


@pytest.mark.parametrize("world", [2, 4])
def test_dsa_families_exact_with_pruning_selections(world):
    results = _results(world)[0]
    assert ("deepseek_v32", "zigzag") in results
    for case, errors in results.items():
        if case == "planted":
            continue
        assert errors["same selections"] and errors["layers"] >= 2, (case, errors)
        assert all(errors[k] <= BOUND[k] for k in BOUND), (case, errors)


@pytest.mark.parametrize("world", [2, 4])
def test_an_indexer_choosing_from_its_shard_is_caught(world):
    planted = _results(world)[0]["planted"]
    assert not planted["same selections"]
    assert planted["logits"] > BOUND["logits"] or planted["gradients"] > BOUND["gradients"], planted
