"""Shared test data: full-sequence inputs made identically on every rank, and error measures."""

from __future__ import annotations

import torch

import burst
from burst.kernels.reference import attention as reference_attention

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def full_inputs(seed, batch, seqlen, heads, kv_heads, dim, dtype):
    """q, k, v, dout on the full sequence, the same on every rank (float64 master copies)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen, heads, dim), (batch, seqlen, kv_heads, dim), (batch, seqlen, kv_heads, dim),
              (batch, seqlen, heads, dim)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).double() for s in shapes]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (an all-zero reference compares absolutely)."""
    scale = ref.abs().max().item()
    return (x.double() - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def reference_grads(q, k, v, dout, causal, mask=None):
    """float64 out, lse and q/k/v grads of attention on the full sequence."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(q, k, v, causal=causal, mask=mask)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def strategy_kwargs(name: str) -> dict:
    """burst.attention's strategy arguments for a case name: "burst:5" is burst with chunk_rows=5
    (its backward's queries served in chunks of 5 rows, so short test shards use several chunks)."""
    strategy, _, rows = name.partition(":")
    return dict(strategy=strategy, chunk_rows=int(rows)) if rows else dict(strategy=strategy)


def sharded_errors(full, ref, dtype, layout="contiguous", **kwargs):
    """Run burst.attention on this rank's shard of `full`; relative errors of out, lse, dq, dk, dv."""
    q, k, v, dout = (burst.shard(t, layout=layout) for t in full)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = burst.attention(q, k, v, layout=layout, return_lse=True, **kwargs)
    out.backward(dout.to(dtype))
    r_out, r_lse, r_dq, r_dk, r_dv = (burst.shard(t, layout=layout, dim=2 if t.dim() == 3 else 1) for t in ref)
    finite = torch.isfinite(r_lse)
    lse_err = (lse.double()[finite] - r_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_err = max(lse_err, 0.0 if torch.equal(torch.isfinite(lse), finite) else float("inf"))
    return {
        "out": rel_err(out, r_out), "lse": lse_err, "dq": rel_err(q.grad, r_dq),
        "dk": rel_err(k.grad, r_dk), "dv": rel_err(v.grad, r_dv),
        "nan": any(bool(torch.isnan(t).any()) for t in (out, q.grad, k.grad, v.grad)),
    }


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


def over_tolerance(cases_by_rank, dtype_of) -> list[str]:
    """The cases whose errors (from sharded_errors) exceed their dtype's bound, as messages.

    cases_by_rank: per rank, a list of (key, errs); dtype_of(key) -> the dtype's name ("torch.float32").
    """
    failures = []
    for rank, cases in enumerate(cases_by_rank):
        for key, errs in cases:
            tol = TOL[getattr(torch, dtype_of(key).split(".")[1])]
            worst = max(errs[n] for n in ("out", "dq", "dk", "dv"))
            if errs["nan"] or worst > tol or errs["lse"] > max(tol, 1e-5):
                failures.append(f"rank {rank} {key}: {errs}")
    return failures
