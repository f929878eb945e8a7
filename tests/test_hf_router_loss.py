"""A mixture-of-experts model's router load-balancing loss across ranks (layers/router_loss.py), through the
README's plain loop (shard_batch, reduce_gradients, reduce_loss): with output_router_logits on, the loss, the
logits and every parameter's gradient against the same model in one process (hf_steps.step_errors, the zoo's
rule). Each rank used to add its own shard's aux loss whole: the sum counted it G times and a product of shard
means is not the whole's (Mixtral's router gradient 1.06 off at 2 ranks, Qwen3-MoE's 3.6 at 4). Families:
Mixtral (transformers' load_balancing_loss_func), JetMoE (its coefficient named aux_loss_coef), GPT-OSS,
Qwen3-Next (a hybrid: its gated delta rule split beside the experts), and Mixtral under torch.compile. A family
whose aux_loss is another formula (planted: twice transformers') is refused on every rank. The Trainer's path,
with right-padded rows and the fused loss: tests/test_training_stacks.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

FAMILIES = ("mixtral", "jetmoe", "gpt_oss", "qwen3_next")
BOUND = {"logits": 2e-5, "loss": 2e-6, "gradients": 1e-4}


def _config(family):
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config(family)
    config.output_router_logits = True
    for name in ("router_aux_loss_coef", "aux_loss_coef"):
        if getattr(config, name, None) is not None:
            setattr(config, name, 0.5)  # large enough that the router's gradient is mostly the aux loss's
    return config


def _router_losses(rank, world):
    import sys

    import burst.integrations.transformers as bt
    import transformers
    from burst.bench.hf_steps import step_errors, twin_models
    from burst.bench.hf_zoo import VOCAB, families

    transformers.logging.set_verbosity_error()
    name = bt.register("router_loss", layout="zigzag")
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    out = {}
    for family in FAMILIES:
        if family in families():
            out[family] = step_errors(*twin_models(family, name, _config(family)), ids, "zigzag")
    eager, model = twin_models("mixtral", name, _config("mixtral"))  # compiled: the hook runs eagerly inside
    out["mixtral compiled"] = step_errors(eager, torch.compile(model, backend="aot_eager"), ids, "zigzag")
    eager, model = twin_models("mixtral", name, _config("mixtral"))
    family = sys.modules[type(model).__module__]
    real = family.load_balancing_loss_func
    with mock.patch.object(family, "load_balancing_loss_func", lambda *a, **k: 2 * real(*a, **k)):
        try:
            step_errors(eager, model, ids, "zigzag")
            out["another formula"] = None
        except ValueError as err:
            out["another formula"] = str(err)
    return out


_results = results_by_world(_router_losses)


def test_router_loss_of_the_whole_sequence_at_two_ranks():
    for rank, results in enumerate(_results(2)):
        assert set(FAMILIES) & set(results), results
        for family in (*FAMILIES, "mixtral compiled"):
            if family in results:
                errors = results[family]
                assert all(errors[k] <= BOUND[k] for k in BOUND), (rank, family, errors)


def test_another_router_loss_is_refused_on_every_rank():
    for results in _results(2):
        message = results["another formula"]
        assert message is not None and "is not the load-balancing loss burst makes whole" in message, message


@pytest.mark.parametrize("family", ["mixtral"])
def test_one_rank_is_left_as_transformers_makes_it(family):
    """No process group: nothing hooked, the model's own loss (the whole sequence is the rank's)."""
    import burst.integrations.transformers as bt
    from burst.bench.hf_steps import twin_models

    _, model = twin_models(family, bt.register("router_alone"), _config(family))
    batch = bt.shard_batch(
        {"input_ids": torch.randint(3, 100, (1, 16)), "labels": torch.randint(3, 100, (1, 16))}, model=model
    )
    assert getattr(model, "_burst_router_loss_hook", None) is None
    assert model(**batch, use_cache=False).aux_loss is not None
