"""Generation on a sharded KV cache equals single-process greedy generation token for token.

The reference recomputes the whole sequence with the plain model at every step (no cache, one
process); the sharded run prefills through burst and decodes on the cache. One world per size
(2 and 3: an even and an odd size, 3 the more-than-two path); prompts of lengths that are not
multiples of the world, a batch of two.
"""

from __future__ import annotations

import pytest
import torch
from burst.engine.model import PRESETS, Transformer
from burst.inference.generate import generate

from world import results_by_world, value_error_text

NEW = 6


def _reference(model, prompt, new_tokens):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            t = torch.tensor(seq)[None]
            hidden = model(t, torch.arange(len(seq))[None])
            seq.append(int(model.lm_head(hidden[0, -1]).argmax()))
    return seq[len(prompt) :]


def _prompts(world):
    g = torch.Generator().manual_seed(world)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5 * world + 3, 2 * world + 1)]


def _run(rank, world):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    out = {}
    for layout in ("contiguous", "zigzag", "striped"):
        result = generate(model, _prompts(world), NEW, layout=layout)
        out[layout] = (result.tokens, result.cache_bytes_per_rank)
    out["bad"] = value_error_text(lambda: generate(model, _prompts(world), 0))
    return out, None


_results = results_by_world(_run, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_greedy_generation_equals_single_process(world):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    expected = [_reference(model, p, NEW) for p in _prompts(world)]
    full_cache = (
        2 * 2 * sum(len(p) + NEW - 1 for p in _prompts(world)) * 2 * 16 * 4
    )  # layers, K+V, entries, kv, dim, fp32
    for rank, (out, _) in enumerate(_results(world)):
        for layout in ("contiguous", "zigzag", "striped"):
            tokens, cache_bytes = out[layout]
            assert tokens == expected, (rank, layout, tokens, expected)
            # Each rank holds its share (padding of the shorter prompt and turns aside).
            assert cache_bytes <= 1.6 * full_cache / world, (rank, layout, cache_bytes, full_cache)
        assert out["bad"] is not None and "new tokens" in out["bad"]


def test_generate_from_a_burst_train_checkpoint(tmp_path):
    """`burst train` writes a checkpoint; `burst generate --checkpoint-dir` on 2 ranks emits what the
    no-cache reference emits with those weights loaded in one plain process (and not what the
    untrained weights would)."""
    import json
    import os
    import subprocess
    import sys

    from burst.engine.resume import load_model_weights

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    burst_cmd = [sys.executable, "-m", "burst"]
    train = subprocess.run(
        [
            *burst_cmd,
            "train",
            "--seq-len",
            "64",
            "--steps",
            "3",
            "--lr",
            "0.05",
            "--nproc",
            "2",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"sharded caches keep long contexts")
    gen = subprocess.run(
        [
            *burst_cmd,
            "generate",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--prompt-file",
            str(prompt),
            "--new-tokens",
            "5",
            "--nproc",
            "2",
            "--json",
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    tokens = json.loads((tmp_path / "out.json").read_text())["tokens"]

    torch.manual_seed(0)
    untrained = Transformer(PRESETS["tiny"]).eval()
    trained = Transformer(PRESETS["tiny"]).eval()
    assert load_model_weights(str(tmp_path / "ckpt"), None, trained) == 3
    expected = _reference(trained, list(prompt.read_bytes()), 5)
    assert tokens == [expected]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(trained.parameters(), untrained.parameters()))

    # Refused before any process starts (the CLI's entry, in this process).
    from burst.cli import main

    with pytest.raises(SystemExit, match="exceeds the model's"):
        main(["generate", "--prompt-len", "100", "--new-tokens", str(1 << 20), "--nproc", "2"])
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        main(["generate", "--checkpoint-dir", str(tmp_path / "nowhere"), "--nproc", "2"])
