"""The MLA families through the transformers backend at 4 ranks: each layer hands burst its latent
(layers/latent.py), which rides the ring while each rank expands it with the layer's kv_b_proj; one
training step's logits, loss and every parameter's gradient (kv_b_proj, kv_a_proj_with_mqa and the
norms included) against the same model's eager attention in one process (hf_steps.train_step_errors:
shard_batch(model=), reduce_gradients, as the README's lines run them). DeepSeek sparse attention's
families (deepseek_v32, glm_moe_dsa, hy_v4, axk2) pick their keys with the indexer on top.
"""

from __future__ import annotations

import functools

import pytest

from requires import transformers_or_skip
from world import run_world

transformers_or_skip()

MLA_FAMILIES = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_linear",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "minicpm3",
    "longcat_flash",
    "youtu",
    "bailing_hybrid",
    "dots3_note",
    "hy_v4",
    "axk1",
    "axk2",
)
BOTH_LAYOUTS = ("deepseek_v3", "longcat_flash")  # contiguous too (few, for time; deepseek_v32 and kimi_linear
# contiguous: tests/test_hf_dsa.py and tests/test_hf_hybrid.py); longcat_flash contiguous: experts some ranks
# route no token to (reduce_gradients sums one list on every rank)
BOUND = {"logits": 2e-5, "loss": 2e-5, "gradients": 2e-5}  # float32 tiny models, as the rope and hybrid tests


def _families(rank, world):
    import burst
    import burst.integrations.transformers as bt
    import torch
    from burst.bench.hf_steps import step_errors, twin_models
    from burst.integrations.transformers.layers.latent import is_latent_attention

    out = {}
    for layout in ("zigzag", "contiguous"):
        name = bt.register(f"burst_latent_{layout}", strategy="burst", layout=layout)
        for family in MLA_FAMILIES if layout == "zigzag" else BOTH_LAYOUTS:
            eager, model = twin_models(family, name)
            ids = torch.randint(3, 96, (2, 64), generator=torch.Generator().manual_seed(1))
            try:
                with burst.CommStats() as stats:
                    errors = step_errors(eager, model, ids, layout)
            except Exception as err:  # noqa: BLE001 - reported by the family's own test
                out[(family, layout)] = f"{type(err).__name__}: {err}"[:500]
                continue
            layers = [m for m in model.modules() if is_latent_attention(m)]
            widths = {m.kv_b_proj.in_features + m.qk_rope_head_dim for m in layers}
            out[(family, layout)] = (
                errors,
                stats.choices().get("keys=latent", 0),
                len(layers),
                stats.sent("forward"),
                max(widths),
            )
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_world(4, _families, timeout=900)


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_family_exact_at_four_ranks_with_the_latent_on_the_ring(family):
    for rank, out in enumerate(_results()):
        for layout in ("zigzag", "contiguous") if family in BOTH_LAYOUTS else ("zigzag",):
            assert not isinstance(out[(family, layout)], str), (family, layout, rank, out[(family, layout)])
            errors, handed, layers, sent, width = out[(family, layout)]
            assert layers > 0, family
            assert handed == layers, (family, layout, "layers that handed over their latent", handed, layers)
            for what, bound in BOUND.items():
                assert errors[what] < bound, (family, layout, rank, errors)
            # what travels forward: at most every other rank's latent rows, never expanded heads
            assert 0 < sent <= layers * 3 * 2 * 16 * width * 4, (family, layout, rank, sent)
