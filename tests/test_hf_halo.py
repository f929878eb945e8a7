"""Halos wider than a chunk (state_passing.halo): DeepSeek-V4's compressed attention with its published
compress rates (HCA reads 128 tokens per entry, CSA 4 with the window before) and short convolutions,
at lengths where a zigzag chunk is shorter than what an entry or a kernel reads before it. The halo
comes from as many chunks before as it spans; every length one process runs is exact at any world
size. One training step against the same model's eager attention in one process (hf_steps.step_errors).
"""

from __future__ import annotations

import functools

import pytest
import torch

from requires import transformers_or_skip
from world import run_world

transformers_or_skip()

BOUND = {"logits": 2e-5, "loss": 2e-5, "gradients": 2e-5}
# (world, tokens): zigzag chunks of 8, 32 and 128 tokens (tokens / 2G) against HCA's 128-token entries
# 4 ranks: chunks of 64 against 128-token entries (each spanning chunks of two ranks), as 1024 tokens on 8 had
V4_CASES = ((2, 32), (2, 128), (2, 512), (4, 512))


def _v4_published():
    from burst.bench.hf_zoo import tiny_config

    config = tiny_config("deepseek_v4")
    config.index_topk = 4
    config.compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    return config


def _step(family, layout, tokens, config=None):
    import burst.integrations.transformers as bt
    from burst.bench.hf_steps import step_errors, twin_models
    from burst.bench.hf_zoo import VOCAB

    eager, model = twin_models(family, bt.register(f"halo_{layout}", layout=layout), config)
    ids = torch.randint(3, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(1))
    return step_errors(eager, model, ids, layout)


def _cases(rank, world, cases):
    import transformers

    transformers.logging.set_verbosity_error()
    out = {}
    for family, tokens in cases:
        try:
            out[(family, tokens)] = _step(
                family, "zigzag", tokens, _v4_published() if family == "deepseek_v4" else None
            )
        except Exception as err:  # noqa: BLE001 - reported by the case's test
            out[(family, tokens)] = f"{type(err).__name__}: {err}"[:400]
    return out


@functools.lru_cache(maxsize=None)
def _results(world):
    from burst.bench.hf_zoo import families

    cases = [("deepseek_v4", tokens) for w, tokens in V4_CASES if w == world and "deepseek_v4" in families()]
    # short convolutions (LFM2's kernel of 3, Mamba2's of 4 in zamba2 / bamba) with chunks of 2 tokens
    if world == 2:
        cases += [(family, 4 * world) for family in ("lfm2", "bamba") if family in families()]
    return run_world(world, _cases, cases, timeout=600)


@pytest.mark.parametrize("world", [2, 4])
def test_halos_wider_than_a_chunk_are_exact(world):
    results = _results(world)
    ran = set(results[0])
    assert {("deepseek_v4", tokens) for w, tokens in V4_CASES if w == world} <= ran, ran
    if world == 2:
        assert {("lfm2", 8), ("bamba", 8)} <= ran, ran
    for rank, out in enumerate(results):
        for case, errors in out.items():
            assert not isinstance(errors, str), (rank, case, errors)
            for what, bound in BOUND.items():
                assert errors[what] < bound, (rank, case, errors)
