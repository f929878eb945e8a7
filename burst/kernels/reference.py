"""Reference attention on explicit score matrices: the test oracle, and a fallback backend.

Used in float64 by the tests as the independent reference on the full sequence. It materializes the
(seqlen_q, seqlen_k) scores, so it is for checking and for small blocks, not for long sequences.
"""

from __future__ import annotations

import torch

MAX_ROWS = 1024  # rows per call at most: the dense float64 score matrix is rows x rows per head


def _scores(q, k, scale, causal, mask):
    """Scores (b, h, sq, sk) with -inf where a key is not attended."""
    group = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    sq, sk = q.shape[1], k.shape[1]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    if mask is not None:  # tiles plan their masks on the CPU; float64 on a GPU runs here
        allowed = allowed & mask.to(q.device)
    return s.masked_fill(~allowed, float("-inf")), group


def forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """out (b, sq, h, d), lse (b, h, sq); rows with nothing to attend give out 0, lse -inf."""
    s, group = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    vv = v.repeat_interleave(group, dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(stat_dtype)


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | None = None):
    s, group = _scores(q, k, scale, causal, mask)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))  # lse may be +inf for empty rows -> p = 0
    vv = v.repeat_interleave(group, dim=2)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    delta = (dout.to(s.dtype) * out.to(s.dtype)).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    kk = k.repeat_interleave(group, dim=2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    b, sk, hk, d = k.shape
    dk = dk.reshape(b, sk, hk, group, d).sum(3)
    dv = dv.reshape(b, sk, hk, group, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention(q, k, v, scale: float | None = None, causal: bool = False, mask: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float64):
    """Differentiable attention on the full sequence in `dtype` (float64 by default): the oracle.

    q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen, nheads_k, headdim).
    mask: optional bool (seqlen_q, seqlen_k), True = attend; combined with `causal` if both are given.
    Returns out (batch, seqlen, nheads, headdim) and lse (batch, nheads, seqlen), both in `dtype`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return forward(q.to(dtype), k.to(dtype), v.to(dtype), scale, causal, mask)
