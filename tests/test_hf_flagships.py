"""The flagships long-context users bring, exact across ranks with their features biting.

- Gemma 2 (and VaultGemma's same attention): logit softcapping, set low (attn_logit_softcapping=1)
  so that capping changes the answer, with its alternating sliding-window layers.
- Llama 4: chunked attention on its RoPE layers (chunks of 16 in 128 tokens: cut inside every shard)
  and its NoPE layer's attention temperature tuning with floor_scale 8 (attn_scale 0.5), so the query scale changes
  along the sequence (transformers computes it from the forward's own 0..n-1: burst re-applies it at
  the rows' global indices).
- Doge: its dynamic mask's bias per key (the decay A drawn, so that it differs from key to key), folded
  into the keys by burst, and the sliding window of 32 its model's mask applies to every layer without
  its attention passing it; and past keep_window_size keys (keep_window_size 16 in its window of 32), where each row
  keeps its largest biases per KV head, handed to burst as indices= per KV head (tests/test_hf_selection.py
  runs it with a published config's sizes past its keep_window_size of 2048).

Each at 2 ranks, contiguous and zigzag, and at 4 ranks, zigzag: logits, loss and every parameter gradient against the
same model with eager attention in one process (burst.bench.hf_steps.gradient_error). Planted (at 2 ranks): the
global temperature left out, and the features switched off in the reference, must each be caught.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from requires import transformers_or_skip
from world import results_by_world

transformers_or_skip()

SEQ = 128
# tiny float32 models, one process against the world: the bounds of tests/test_hf_rope.py and test_hf_hybrid.py
BOUND = {"logits": 2e-5, "loss": 2e-6, "gradients": 1e-4}


def gemma2_config():
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("gemma2")
    config.attn_logit_softcapping = 1.0
    config.initializer_range = 0.3  # scores of several units, well into the cap (0.02 leaves them near 0)
    return config


def llama4_config():
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("llama4_text")
    config.attention_chunk_size, config.floor_scale, config.attn_scale = 16, 8, 0.5
    return config


def doge_config():
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("doge")
    config.sliding_window = 32  # its model's mask applies it to every layer; its attention does not pass it
    return config


def short_keep_config():
    config = doge_config()
    config.keep_window_size = 16  # rows whose window (32) holds more than 16 keys keep 16, chosen per KV head
    return config


CONFIGS = {"gemma2": gemma2_config, "llama4_text": llama4_config, "doge": doge_config}


def _doge_decays(eager):
    """Doge's dynamic-mask decay A is initialised to 0, which makes its bias per key exp(0) = 1 for every
    key: one constant, which the softmax cancels. Drawn instead, so that the bias differs from key to key."""
    with torch.no_grad():
        for name, parameter in eager.named_parameters():
            if name.endswith("self_attn.A"):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))


def _errors(family, config, name, layout, reference_config=None) -> dict:
    """One forward + backward split over the world against eager attention in one process."""
    from burst.bench.hf_steps import step_errors, twin_models
    from burst.bench.hf_zoo import VOCAB

    eager, model = twin_models(family, name, config, reference_config)
    if family == "doge":
        _doge_decays(eager)
        model.load_state_dict(eager.state_dict())
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return step_errors(eager, model, ids, layout)


def _flagships(rank, world):
    import burst.integrations.transformers as bt
    import transformers
    from burst.integrations.transformers.backend import features
    from burst.integrations.transformers.layers import dynamic_mask

    transformers.logging.set_verbosity_error()
    out = {}
    for layout in ("contiguous", "zigzag") if world == 2 else ("zigzag",):  # 4 ranks: the layout with 2 chunks each
        name = bt.register(f"flagship_{layout}", layout=layout)
        for family, make in CONFIGS.items():
            out[(family, layout)] = _errors(family, make(), name, layout)
    if world > 2:  # the planted faults and the short keep window walk no other path at 4 ranks: run at 2
        return out
    name = bt.register("flagship_planted", layout="zigzag")
    with mock.patch.object(features, "global_temperature", lambda name, module, query, backend: query):
        out["planted: local temperature"] = _errors("llama4_text", llama4_config(), name, "zigzag")
    unchunked = llama4_config()
    unchunked.layer_types = ["full_attention"] * len(unchunked.layer_types)
    out["planted: no chunks in the reference"] = _errors(
        "llama4_text", llama4_config(), name, "zigzag", reference_config=unchunked
    )
    uncapped = gemma2_config()
    uncapped.attn_logit_softcapping = None
    out["planted: no cap in the reference"] = _errors(
        "gemma2", gemma2_config(), name, "zigzag", reference_config=uncapped
    )
    unwindowed = doge_config()
    unwindowed.sliding_window = None
    out["planted: no window in the reference"] = _errors(
        "doge", doge_config(), name, "zigzag", reference_config=unwindowed
    )
    fold = dynamic_mask.fold  # the bias zeroed (still in the graph: every parameter keeps a gradient)
    with mock.patch.object(dynamic_mask, "fold", lambda query, key, bias, scaling: fold(query, key, 0 * bias, scaling)):
        out["planted: no dynamic bias"] = _errors("doge", doge_config(), name, "zigzag")
    out[("doge keeping part of each row", "zigzag")] = _errors("doge", short_keep_config(), name, "zigzag")
    with mock.patch.object(dynamic_mask, "kept_keys", lambda *args: None):
        out["planted: every key kept"] = _errors("doge", short_keep_config(), name, "zigzag")
    return out


_results = results_by_world(_flagships)


@pytest.mark.parametrize("world", [2, 4])
def test_gemma2_softcap_and_llama4_chunks_exact(world):
    failures = [
        (rank, case, errors)
        for rank, rank_results in enumerate(_results(world))
        for case, errors in rank_results.items()
        if not isinstance(case, str) and not all(errors[k] <= BOUND[k] for k in BOUND)
    ]
    assert not failures, failures


def test_each_feature_is_seen_by_the_comparison():
    """What the exactness above would miss if burst ignored a feature: each planted case fails the bounds
    (at 2 ranks: the same comparison at 4 ranks only splits the sequence further)."""
    results = _results(2)[0]
    for case in (
        "planted: local temperature",
        "planted: no chunks in the reference",
        "planted: no cap in the reference",
        "planted: no window in the reference",
        "planted: no dynamic bias",
        "planted: every key kept",
    ):
        assert results[case]["logits"] > 5 * BOUND["logits"] or results[case]["gradients"] > 5 * BOUND["gradients"], (
            case,
            results[case],
        )


def test_doge_keeping_part_of_each_row_is_exact():
    """Past keep_window_size keys Doge keeps each row's largest biases per KV head: exact (the bounds above), and
    not by chance: every key kept (the selection dropped) is caught by test_each_feature_is_seen_by_the_comparison."""
    for rank_results in _results(2):
        errors = rank_results[("doge keeping part of each row", "zigzag")]
        assert all(errors[k] <= BOUND[k] for k in BOUND), errors
