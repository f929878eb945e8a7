"""`fused_loss=True` (burst/integrations/transformers/fused_loss.py): a transformers causal LM's training loss
from its final hidden states and LM head a tile at a time, never the logits. Against the plain Trainer in one
process (each step's loss and every gradient), on a shard of 2 ranks against the model's own loss, and the
families whose logits are not their head's refused before any backward."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from cases import rel_err as _rel
from world import run_world  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "trainer_train.py")


def _trainer_run(out, *options):
    done = subprocess.run(
        [sys.executable, EXAMPLE, "--optim", "sgd", "--lr", "1.0", "--steps", "2", "--seq-len", "64", "--out", out]
        + list(options),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(os.path.join(out, "result.pt"), weights_only=False)


def test_trainer_with_fused_loss_trains_like_the_plain_trainer(tmp_path):
    """One rank (SequenceParallelTrainer outside torchrun), gradient accumulation and clipping: every step's
    loss and gradient equal the plain Trainer's with eager attention and the logits built."""
    ref = _trainer_run(str(tmp_path / "ref"), "--reference")
    got = _trainer_run(str(tmp_path / "fused"), "--fused-loss")
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], ref["losses"])
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert g.keys() == r.keys()
        worst = max(_rel(g[n], r[n]) for n in r)
        assert worst < 1e-4, (step, worst)
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"])


def _tiny(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _shard_of_two(rank, world):
    """SequenceParallel.loss with and without fused_loss on 2 ranks (zigzag): the same loss and gradients."""
    from burst.integrations.transformers import SequenceParallel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, 64), generator=g)
    labels = ids.clone()
    labels[0, 50:] = -100
    results = {}
    for fused in (False, True):
        model = _tiny("llama")
        sp = SequenceParallel(model, layout="zigzag", fused_loss=fused)
        loss = sp.loss(model, {"input_ids": ids, "labels": labels})
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad)
            grads[n] = grad / world  # as DDP averages them
        results[fused] = (sp.mean_loss(loss), grads)
    return results


def test_fused_loss_on_a_shard_equals_the_models_own_loss():
    for rank, results in enumerate(run_world(2, _shard_of_two)):
        (plain, plain_grads), (fused, fused_grads) = results[False], results[True]
        assert abs(fused.item() - plain.item()) <= 1e-5 * abs(plain.item()), (rank, fused, plain)
        worst = max(_rel(fused_grads[n], plain_grads[n]) for n in plain_grads)
        assert worst < 1e-4, (rank, worst)


def test_families_whose_logits_are_not_their_heads_are_refused():
    """Gemma 2 softcaps its final logits (refused by its config field), Cohere scales them (refused by the check
    of the call's last row of logits, before any backward); a head with a bias is refused."""
    from burst.integrations.transformers.fused_loss import check_fusable, fused_causal_lm_loss

    ids = torch.randint(0, 96, (1, 16))
    with pytest.raises(ValueError, match="softcaps"):
        fused_causal_lm_loss(_tiny("gemma2"), {"input_ids": ids, "labels": ids})
    scaled = _tiny("cohere")
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="not its LM head"):
        fused_causal_lm_loss(scaled, {"input_ids": ids, "labels": ids})
    model = _tiny("llama")
    check_fusable(model)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
    with pytest.raises(ValueError, match="bias"):
        check_fusable(model)
