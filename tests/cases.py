"""Shared test data: what every test module compares against, and how it runs a case.

Inputs, the float64 reference on the full sequence, the error measures and the per-dtype bounds are
burst/kernels/reference.py's (the same `burst.check` and `burst bench` use); this file adds the
test-side pieces: running burst.attention on this rank's shard, and a mask built independently of
burst.masks.
"""

from __future__ import annotations

import burst
import torch
from burst.kernels.reference import BOUNDS, DTYPES, errors_against, full_inputs, within_bounds
from burst.kernels.reference import full_reference as reference_grads  # (q, k, v, dout, causal, mask=None)
from burst.kernels.reference import relative_error as rel_err

TOL = {DTYPES[name]: bound for name, bound in BOUNDS.items()}  # torch dtype -> reference.BOUNDS

__all__ = [
    "TOL",
    "full_inputs",
    "reference_grads",
    "rel_err",
    "within_bounds",
    "strategy_kwargs",
    "sharded_errors",
    "reference_mask",
    "assert_within_bounds",
]


# transformers' tiny decoder of the integration tests: 2 layers of 4 heads of 8, 2 KV heads (any family's config
# class takes these names)
TINY_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_decoder_config(class_name: str, vocab_size: int, **extra):
    """transformers' `class_name` config (LlamaConfig, Qwen2Config...) at TINY_DECODER's sizes."""
    import transformers

    return getattr(transformers, class_name)(**{**TINY_DECODER, "vocab_size": vocab_size, **extra})


def strategy_kwargs(name: str) -> dict:
    """burst.attention's strategy arguments for a case name: "burst:chunk_rows=5" is burst with
    chunk_rows=5 (its backward's queries served in chunks of 5 rows, so short test shards use several
    chunks); "burst:backward_side=keys" forces its key-side backward. The part after ":" is one option,
    an integer or a word, as "strategy:variant" spells variants elsewhere."""
    strategy, _, option = name.partition(":")
    if not option:
        return dict(strategy=strategy)
    key, value = option.split("=")
    return {"strategy": strategy, key: int(value) if value.lstrip("-").isdigit() else value}


def sharded_errors(full, ref, dtype, layout="contiguous", group=None, **kwargs):
    """Run burst.attention on this rank's shard of `full` (over `group`); relative errors of out, lse, dq,
    dk, dv."""
    q, k, v, dout = (burst.shard(t, layout=layout, group=group) for t in full)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, group=group, **kwargs)
    out.backward(dout.to(dtype))
    theirs = [burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1, group=group) for t in ref]
    errors = errors_against((out, lse, q.grad, k.grad, v.grad), theirs)
    errors["nan"] = any(bool(torch.isnan(t).any()) for t in (out, q.grad, k.grad, v.grad))
    return errors


def reference_mask(seqlen, causal=False, window=None, cu_seqlens=None, block_sparse=None):
    """The attended (query, key) pairs of the full sequence, built independently of burst.masks."""
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    allowed = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    if cu_seqlens is not None:
        doc = torch.zeros(seqlen, dtype=torch.long)
        for start in cu_seqlens[1:-1]:
            doc[start:] += 1
        allowed &= doc[:, None] == doc[None, :]
    if block_sparse is not None:
        bs = block_sparse.block_size
        dense = block_sparse.layout.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
        allowed &= dense[:seqlen, :seqlen]
    return allowed


def assert_within_bounds(cases_by_rank, dtype_of) -> None:
    """Fail, naming each, if any case's errors (from sharded_errors) exceed its dtype's bound
    (reference.BOUNDS) or are NaN.

    cases_by_rank: per rank, a list of (key, errs); dtype_of(key) -> the dtype's name ("torch.float32").
    """
    failures = []
    for rank, cases in enumerate(cases_by_rank):
        for key, errs in cases:
            measured = {n: errs[n] for n in ("out", "lse", "dq", "dk", "dv")}
            if errs["nan"] or not within_bounds(measured, dtype_of(key)):
                failures.append(f"rank {rank} {key}: {errs}")
    assert not failures, "\n".join(failures)
