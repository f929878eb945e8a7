"""Inputs of any strides, as real callers hand them: transposed (batch, heads, seq, dim) views from a
transformers model, slices of a larger tensor, a strided dout. Every strategy, forward and backward,
against float64 attention on the full sequence. One world per size.
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import full_inputs, reference_grads, rel_err, strategy_kwargs, within_bounds
from world import results_by_world

B, H, KV, D = 2, 4, 2, 8
STRATEGIES = (
    ("burst", "zigzag"),
    ("burst:chunk_rows=1", "striped"),
    ("ring", "striped"),
    ("allgather", "contiguous"),
    ("distflash", "contiguous"),
)  # burst:1: its queries served as 1-row chunks of strided views


def _as_heads_first_view(x: torch.Tensor) -> torch.Tensor:
    """The same values as x (batch, seq, heads, dim), as the transpose of a (batch, heads, seq, dim)
    tensor: what `states.transpose(1, 2)` gives a transformers attention function."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _as_slice(x: torch.Tensor) -> torch.Tensor:
    """The same values as x, as a slice of a wider tensor (every other head-dim column)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def _cases(rank, world):
    results = []
    full = full_inputs(11, B, 4 * world, H, KV, D, torch.float64)
    for causal in (False, True):
        ref = reference_grads(*full, causal=causal)
        for strategy, layout in STRATEGIES:
            if strategy == "distflash" and not causal:
                continue
            for view in (_as_heads_first_view, _as_slice):
                for dtype in (torch.float32, torch.bfloat16):
                    q, k, v, dout = (burst.shard(t, layout=layout).to(dtype) for t in full)
                    q, k, v = (view(t).requires_grad_() for t in (q, k, v))
                    assert not q.is_contiguous() and not k.is_contiguous()
                    out = burst.attention(q, k, v, layout=layout, causal=causal, **strategy_kwargs(strategy))
                    out.backward(view(dout))
                    r_out, r_dq, r_dk, r_dv = (burst.shard(t, layout=layout) for t in (ref[0], *ref[2:]))
                    errs = {
                        "out": rel_err(out, r_out),
                        "dq": rel_err(q.grad, r_dq),
                        "dk": rel_err(k.grad, r_dk),
                        "dv": rel_err(v.grad, r_dv),
                    }
                    results.append(((strategy, layout, causal, view.__name__, str(dtype)), errs))
    return results


_results = results_by_world(_cases, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_strided_inputs_every_strategy(world):
    failures, count = [], 0
    for rank, cases in enumerate(_results(world)):
        for key, errs in cases:
            count += 1
            if not within_bounds(errs, key[-1]):
                failures.append(f"rank {rank} {key}: {errs}")
    assert count == world * (2 * (len(STRATEGIES) - 1) + 1) * 2 * 2  # distflash: causal only
    assert not failures, "\n".join(failures)
