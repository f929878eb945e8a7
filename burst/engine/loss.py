"""Sequence-level fusion of the LM head and the loss (burstengine.md §3.3, Alg. 3).

`fused_linear_cross_entropy(hidden, weight, targets)` equals
`F.cross_entropy(hidden @ weight.T, targets)` in value and in the gradients of hidden and weight,
without ever building the N x V logits: rows are taken a chunk at a time and the vocabulary a chunk
at a time; a first pass over the vocabulary gives each row's log-sum-exp (online, float32), a
second recomputes each tile's logits and turns them straight into gradient contributions
(softmax - onehot) @ W and (softmax - onehot)^T @ h. The gradients are made in the forward and
scaled by the incoming gradient in the backward, so nothing of size N x V is kept either.

On a sequence shard, pass `group`: the mean is taken over the non-ignored targets of the whole
group (one all-reduce of a count), so the ranks' losses add up to the global mean, and so do
their gradients (sum them over the group, as for any sequence-parallel parameter gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from burst.agreement import agree
from burst.kernels import accumulator_dtype

ROWS, VOCAB = 1024, 8192  # tile of the logits computed at once: rows x vocabulary entries


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, count: float):
        loss, grad_hidden, grad_weight = _loss_and_grads(hidden, weight, targets, ignore_index, count)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            grad_weight * grad_loss.to(grad_weight.dtype),
            None,
            None,
            None,
        )


def _loss_and_grads(hidden, weight, targets, ignore_index: int, count: float):
    """Sum over rows of the cross-entropy / count, and its gradients; hidden (N, H), weight (V, H)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    for r0 in range(0, n, ROWS):
        rows = slice(r0, min(n, r0 + ROWS))
        h, t = hidden[rows], targets[rows]
        keep = t != ignore_index
        if not bool(keep.any()):
            continue
        lse = torch.full((h.shape[0],), float("-inf"), dtype=acc, device=h.device)
        target_logit = torch.zeros(h.shape[0], dtype=acc, device=h.device)
        for c0 in range(0, v, VOCAB):  # pass 1: log-sum-exp over the vocabulary, online
            cols = slice(c0, min(v, c0 + VOCAB))
            logits = (h @ weight[cols].T).to(acc)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            inside = keep & (t >= c0) & (t < cols.stop)
            target_logit[inside] = logits[inside, t[inside] - c0]
        loss += ((lse - target_logit) * keep).sum() / count
        for c0 in range(0, v, VOCAB):  # pass 2: each tile's logits -> gradients, then dropped
            cols = slice(c0, min(v, c0 + VOCAB))
            probs = torch.exp((h @ weight[cols].T).to(acc) - lse[:, None])
            inside = keep & (t >= c0) & (t < cols.stop)
            probs[inside, t[inside] - c0] -= 1.0
            probs *= (keep.to(acc) / count)[:, None]
            grad_hidden[rows] += probs @ weight[cols].to(acc)
            grad_weight[cols] += probs.T @ h.to(acc)
    return loss, grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, group=None
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, never building the logits.

    hidden: (..., hidden_size); weight: (vocab, hidden_size); targets: (...) ints, `ignore_index`
    for positions without a label. With `group`, the mean is over the non-ignored targets of every
    rank of the group (this rank's share of the global mean). Returns a 0-dim tensor, float32
    (float64 for float64 input).
    """
    problem = _input_problem(hidden, weight, targets, ignore_index)
    if group is not None:  # raised on every rank, before the label count's all-reduce, or on none
        facts = {"weight": tuple(weight.shape), "dtype": str(hidden.dtype), "ignore_index": ignore_index}
        agree("fused_linear_cross_entropy", None if problem else facts, problem, group, dist.get_world_size(group))
    elif problem is not None:
        raise problem
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    return _FusedLinearCrossEntropy.apply(
        flat_h, weight, flat_t, ignore_index, _label_count(flat_t, ignore_index, group)
    )


def _input_problem(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """The ValueError these inputs call for, or None: shapes that do not match, or a target outside the
    vocabulary that is not ignore_index (-1 padding with the default ignore_index=-100, say), which
    F.cross_entropy refuses and the vocabulary tiles would silently count as a logit of 0."""
    if hidden.shape[:-1] != targets.shape:
        return ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share the leading dimensions"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        return ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        return ValueError(f"targets must be integer class ids, got {targets.dtype}")
    outside = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
    if bool(outside.any()):
        return ValueError(
            f"targets hold {targets[outside].flatten()[0].item()}, outside the vocabulary 0..{weight.shape[0] - 1} "
            f"and not ignore_index={ignore_index}"
        )
    return None


def unfused_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, group=None
) -> torch.Tensor:
    """The same loss from materialized logits (..., vocab): the baseline the fusion is measured
    against (benchmarks/engine.md)."""
    flat_t = targets.reshape(-1)
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(accumulator_dtype(logits.dtype)),  # float64 stays float64
        flat_t,
        ignore_index=ignore_index,
        reduction="sum",
    )
    return total / _label_count(flat_t, ignore_index, group)


def _label_count(flat_targets: torch.Tensor, ignore_index: int, group) -> float:
    """Non-ignored targets on every rank of `group` (one all-reduce), at least 1."""
    count = (flat_targets != ignore_index).sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return max(float(count), 1.0)
