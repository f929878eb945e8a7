"""Every rope type transformers ships, exact across ranks through shard_batch(model=).

Dynamic NTK scaling and LongRoPE compute their frequencies from the longest position the rotary
embedding sees; a rank sees its shard's (burst/integrations/transformers/layers/rope.py shows it the whole length).
A tiny Llama with each rope type at 2 ranks, 112 tokens past a 64-token original context (on 2 and 4 ranks
some shards end below 64, where dynamic and longrope pick other frequencies), both layouts; the types whose
frequencies depend on the length (dynamic, longrope) also at 256 tokens and at 4 ranks (the others take the
global position ids alike at any world size and length): logits, loss and every gradient against the same
model in one process with eager attention. Planted: the all-reduce of the longest position skipped, which
must be caught.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

VOCAB = 100
ORIGINAL = 64
LENGTHS = (112, 256)
LAYOUTS = ("contiguous", "zigzag")
LENGTH_DEPENDENT = ("dynamic", "longrope")  # the types whose frequencies follow the longest position seen


def cases(world: int) -> list:
    """(rope type, length) run in each layout: every type at 2 ranks and 112 tokens; the length-dependent
    ones at every length and world."""
    return [
        (kind, length)
        for kind in rope_parameters()
        for length in LENGTHS
        if kind in LENGTH_DEPENDENT or (world == 2 and length == LENGTHS[0])
    ]


def rope_parameters(head_dim: int = 16) -> dict:
    """One rope_parameters dict per rope type transformers' ROPE_INIT_FUNCTIONS holds, plus default."""
    half, base = head_dim // 2, {"rope_theta": 10000.0}
    return {
        "default": {"rope_type": "default", **base},
        "linear": {"rope_type": "linear", "factor": 4.0, **base},
        "dynamic": {"rope_type": "dynamic", "factor": 2.0, **base},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **base},
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.3 * i for i in range(half)],
            "original_max_position_embeddings": ORIGINAL,
            **base,
        },
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            **base,
        },
        "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5, **base},
    }


def _twins(rope: dict, name: str):
    from burst.bench.hf_steps import twin_models
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ORIGINAL,
        rope_parameters=rope,
    )
    return twin_models("llama", name, config)


def _errors(eager, model, ids, layout) -> dict:
    from burst.bench.hf_steps import step_errors

    return step_errors(eager, model, ids, layout)


def _rope_world(rank, world):
    import burst.integrations.transformers as bt
    import transformers
    from burst import layout as layout_mod
    from burst.integrations.transformers.layers import rope as rope_layer

    transformers.logging.set_verbosity_error()
    out = {"errors": {}}
    for layout in LAYOUTS:
        name = bt.register(f"rope_{layout}", layout=layout)
        for kind, length in cases(world):
            ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
            out["errors"][(layout, kind, length)] = _errors(*_twins(rope_parameters()[kind], name), ids, layout)
    ids = torch.randint(0, VOCAB, (1, 112), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(rope_layer.dist, "all_reduce", lambda *args, **kwargs: None):  # each rank its own length
        out["planted"] = _errors(*_twins(rope_parameters()["dynamic"], "rope_contiguous"), ids, "contiguous")
    # sharded by hand, the model never prepared: the attention function refuses the length-dependent types
    _, fresh = _twins(rope_parameters()["longrope"], "rope_contiguous")
    try:
        fresh(
            input_ids=layout_mod.shard(ids, layout="contiguous", dim=1),
            position_ids=layout_mod.shard(torch.arange(112)[None], layout="contiguous", dim=1),
        )
        out["unprepared"] = None
    except ValueError as err:
        out["unprepared"] = str(err)
    out["pickled"] = {kind: _pickled_runs_alike(kind, ids) for kind in LENGTH_DEPENDENT}
    return out


def _pickled_runs_alike(kind: str, ids) -> float:
    """A model whose length-dependent rope burst wrapped, pickled whole (torch.save) after a step and loaded: its
    logits against the original's (the wrapper had been a closure: torch.save failed)."""
    import io

    import burst.integrations.transformers as bt

    _, model = _twins(rope_parameters()[kind], "rope_zigzag")
    batch = bt.shard_batch({"input_ids": ids}, model=model)
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    again = bt.shard_batch({"input_ids": ids}, model=loaded)  # a new model: prepared as any other
    with torch.no_grad():
        return (loaded(**again).logits - model(**batch).logits).abs().max().item()


_results = results_by_world(_rope_world)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rope_type_is_exact_in_both_layouts(world):
    errors = _results(world)[0]["errors"]
    assert len(errors) == len(LAYOUTS) * len(cases(world))
    assert {kind for _, kind, _ in errors} == (set(rope_parameters()) if world == 2 else set(LENGTH_DEPENDENT))
    bad = {case: e for case, e in errors.items() if e["logits"] > 2e-5 or e["loss"] > 2e-6 or e["gradients"] > 1e-4}
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_seeing_its_own_length_is_caught(world):
    assert _results(world)[0]["planted"]["logits"] > 1e-3  # the error the test above would have seen


def test_a_model_with_wrapped_rope_pickles_whole():
    assert _results(2)[0]["pickled"] == dict.fromkeys(LENGTH_DEPENDENT, 0.0), _results(2)[0]["pickled"]


def test_an_unprepared_model_with_length_dependent_rope_is_refused():
    text = _results(2)[0]["unprepared"]
    assert text is not None and "longrope" in text and "model=model" in text
