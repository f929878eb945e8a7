"""The model-feature registry (burst/integrations/transformers/backend/features.py): a family's feature is
one entry of FEATURES, and every door reads it. A planted entry on Llama's attention is prepared once per
(group, layout) by shard_batch and SequenceParallel (the Trainer's preparation), its check, take and hand
run once per layer call in that order, only on the layers it detects, and what its hand gives burst
reaches the output.
"""

from __future__ import annotations

from requires import transformers_or_skip
from world import run_world

transformers_or_skip()


def _planted(rank, world):
    from unittest import mock

    import burst.integrations.transformers as bt
    import torch
    from burst.bench.hf_steps import twin_models
    from burst.integrations.transformers.backend import features

    seen = {"prepare": 0, "hooks": []}

    def prepare(model, group, layout):
        seen["prepare"] += 1

    def hook(name):
        def step(call):
            seen["hooks"].append(name)
            if name == "hand":  # every query zero: uniform attention over the causal keys
                call.query = torch.zeros_like(call.query)

        return step

    planted = features.Feature(
        "planted",
        detect=lambda m: type(m).__name__ == "LlamaAttention",
        prepare=prepare,
        check=hook("check"),
        take=hook("take"),
        hand=hook("hand"),
    )
    name = bt.register("features_planted")
    eager, model = twin_models("llama", name)
    layers = sum(type(m).__name__ == "LlamaAttention" for m in model.modules())
    ids = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = eager(ids).logits
    with mock.patch.object(features, "FEATURES", (*features.FEATURES, planted)):
        batch = bt.shard_batch({"input_ids": ids}, model=model)
        bt.shard_batch({"input_ids": ids}, model=model)  # the same group and layout: prepared already
        prepared_by_shard_batch = seen["prepare"]
        bt.SequenceParallel(model, layout="zigzag", attn_name=name)  # another layout: prepared again
        prepared_by_both = seen["prepare"]
        with torch.no_grad():
            planted_out = model(**batch).logits
    return {
        "by shard_batch": prepared_by_shard_batch,
        "by both": prepared_by_both,
        "layers": layers,
        "hooks": seen["hooks"],
        "output changed": not torch.allclose(plain, planted_out),
    }


def test_a_planted_feature_is_read_by_every_door():
    out = run_world(1, _planted)[0]
    assert (out["by shard_batch"], out["by both"]) == (1, 2), out
    assert out["hooks"] == ["check", "take", "hand"] * out["layers"], out
    assert out["output changed"], out
