"""burst.engine.fused_linear_cross_entropy against F.cross_entropy(hidden @ weight.T, targets):
values and gradients, ignore_index, tiles smaller than the problem, bf16, and sequence shards on a
local world (the ranks' losses and gradients add up to the full sequence's)."""

from __future__ import annotations

import burst.engine.loss as fused
import pytest
import torch
import torch.nn.functional as F
from burst.engine import fused_linear_cross_entropy

from world import run_world


def _problem(n=300, h=32, v=1000, ignore=0.2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, n // 2, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (2, n // 2), generator=g)
    targets[torch.rand(targets.shape, generator=g) < ignore] = -100
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    h, w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = F.cross_entropy((h @ w.T).reshape(-1, w.shape[0]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("rows,vocab", [(1024, 8192), (64, 96)])  # one tile, and many partial tiles
def test_matches_cross_entropy(monkeypatch, rows, vocab):
    monkeypatch.setattr(fused, "ROWS", rows)
    monkeypatch.setattr(fused, "VOCAB", vocab)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        hidden, weight, targets = _problem(dtype=dtype)
        ref_loss, ref_h, ref_w = _reference(hidden, weight, targets)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, targets)
        (loss * 3.0).backward()  # the incoming gradient scales both
        assert abs(loss.item() - ref_loss.item()) < tol * max(1.0, ref_loss.item())
        assert (h.grad.double() - 3 * ref_h).abs().max() < tol * 10
        assert (w.grad.double() - 3 * ref_w).abs().max() < tol * 10


def test_bf16_close_to_float64():
    hidden, weight, targets = _problem(dtype=torch.bfloat16)
    ref_loss, ref_h, ref_w = _reference(hidden, weight, targets)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_linear_cross_entropy(h, w, targets).backward()
    assert abs(fused_linear_cross_entropy(hidden, weight, targets).item() - ref_loss.item()) < 1e-3
    assert ((h.grad.double() - ref_h).abs().max() / ref_h.abs().max()) < 2e-2


def test_all_ignored_gives_zero_not_nan():
    hidden, weight, targets = _problem()
    loss = fused_linear_cross_entropy(hidden, weight, torch.full_like(targets, -100))
    assert loss.item() == 0.0


def _shard(rank, world):
    hidden, weight, targets = _problem(n=240, seed=3)
    rows = slice(rank * 120 // world, (rank + 1) * 120 // world)
    h, w = hidden[:, rows].clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, targets[:, rows], group=torch.distributed.group.WORLD)
    loss.backward()
    try:  # rank 1's targets one short: a ValueError on every rank, none left in the label count's all-reduce
        fused_linear_cross_entropy(h, w, targets[:, rows][:, : h.shape[1] - rank], group=torch.distributed.group.WORLD)
        refused = None
    except ValueError as err:
        refused = str(err)
    return loss.detach(), w.grad, refused


def test_sequence_shards_add_up_to_the_full_loss():
    hidden, weight, targets = _problem(n=240, seed=3)
    ref_loss, _, ref_w = _reference(hidden, weight, targets)
    parts = run_world(2, _shard)
    assert abs(sum(p[0].item() for p in parts) - ref_loss.item()) < 1e-12
    assert (sum(p[1] for p in parts) - ref_w).abs().max() < 1e-12
    assert "must share the leading dimensions" in parts[1][2]
    assert parts[0][2] is not None and "rank 1" in parts[0][2], parts[0][2]


def test_targets_outside_the_vocabulary_are_refused_as_cross_entropy_refuses_them():
    """-1 padding with the default ignore_index, or an id past the vocabulary: F.cross_entropy raises; the
    fused loss had counted the row's target logit as 0, a finite wrong loss and gradient."""
    import pytest

    hidden, weight, targets = _problem()
    vocab = weight.shape[0]
    for bad in (-1, vocab, vocab + 7):
        wrong = targets.clone()
        wrong.view(-1)[3] = bad
        with pytest.raises(IndexError):
            torch.nn.functional.cross_entropy((hidden @ weight.T).flatten(0, -2), wrong.flatten())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            fused_linear_cross_entropy(hidden, weight, wrong)
    ignored = targets.masked_fill(targets == -100, -1)
    ignored.view(-1)[3] = -1
    fused_linear_cross_entropy(hidden, weight, ignored, ignore_index=-1)  # -1 as the ignore_index: taken
