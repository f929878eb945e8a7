"""burst.attention on real local gloo worlds against float64 attention on the full sequence.

One world per size; every strategy x causal x (MHA, GQA, MQA) x dtype runs inside it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cases import TOL, full_inputs, reference_grads, sharded_errors
from world import run_world

STRATEGIES = ("burst", "ring", "allgather", "auto")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADS = 4


def _all_cases(rank, world):
    results = []
    seqlen = 6 * world
    for causal in (False, True):
        for kv_heads in (4, 2, 1):
            for dtype in DTYPES:
                full = full_inputs(1000 + kv_heads, 2, seqlen, HEADS, kv_heads, 8, dtype)
                ref = reference_grads(*full, causal=causal)
                for strategy in STRATEGIES:
                    if strategy == "auto" and dtype != torch.float32:
                        continue
                    errs = sharded_errors(full, ref, dtype, strategy=strategy, causal=causal)
                    results.append(((strategy, causal, kv_heads, str(dtype)), errs))
    return results


@functools.lru_cache(maxsize=None)
def _results(world):
    return run_world(world, _all_cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_float64_reference(world):
    failures = []
    count = 0
    for rank, cases in enumerate(_results(world)):
        for (strategy, causal, kv_heads, dtype), errs in cases:
            count += 1
            tol = TOL[getattr(torch, dtype.split(".")[1])]
            worst = max(errs[name] for name in ("out", "dq", "dk", "dv"))
            if errs["nan"] or worst > tol or errs["lse"] > max(tol, 1e-5):
                failures.append(f"rank {rank} {strategy} causal={causal} kv_heads={kv_heads} {dtype}: {errs}")
    assert count == world * 2 * 3 * (3 * 4 + 1)
    assert not failures, "\n".join(failures)
