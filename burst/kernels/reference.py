"""Reference attention on explicit score matrices: a fallback backend, and everything a check needs.

Two parts, one truth. The kernel (forward, backward, attention) materializes the (seqlen_q,
seqlen_k) scores, so it serves small blocks and float64 on a GPU, not long sequences. The
verification part below is the one place that says what "right" means, for `burst.check`
(burst/check.py), `burst bench`'s error column (bench/harness.py) and the tests (tests/cases.py):

    DTYPES         dtype names -> torch dtypes ("float32": torch.float32, ...)
    BOUNDS         the largest error each dtype may show
    full_inputs    q, k, v, dout on the full sequence, the same on every rank
    full_reference float64 out, lse, dq, dk, dv on the full sequence (autograd through `attention`,
                   so it does not share the hand-written backward any backend uses)
    relative_error, lse_error, absolute_error, errors_against (all five quantities), within_bounds
"""

from __future__ import annotations

import math

import torch

from .masking import dense_mask
from .spec import FLOATS, KernelSpec

MAX_ROWS = 1024  # rows per call at most: the dense float64 score matrix is rows x rows per head
SPEC = KernelSpec("reference", None, FLOATS)  # explicit scores: float64, softcap on the CPU, the last resort


def _scores(q, k, scale, causal, mask, softcap: float = 0.0):
    """Scores (b, h, sq, sk) with -inf where a key is not attended, and the group size (GQA).
    softcap c > 0: every score s becomes c * tanh(s / c) first (Gemma 2's logit softcapping)."""
    group = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    if mask is not None:  # a dense mask planned on the CPU, or band arguments (masks.Bands)
        allowed = allowed & dense_mask(mask, q.device)
    return s.masked_fill(~allowed, float("-inf")), group


SOFTCAP = True  # forward and backward take softcap= (kernels without it are swapped for this one)


def forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None, softcap: float = 0.0):
    """out (b, sq, h, d), lse (b, h, sq); rows with nothing to attend give out 0, lse -inf. Scores and
    sums in float32 for half-precision inputs, as the fused kernels keep them."""
    dtype = q.dtype
    q, k, v = _widened(q, k, v)
    s, group = _scores(q, k, scale, causal, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    vv = v.repeat_interleave(group, dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out.to(dtype), lse.to(q.dtype)


def _widened(*tensors):
    """Half-precision tensors as float32 (float32 and float64 as they are)."""
    return [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]


def backward(
    dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | None = None, softcap: float = 0.0
):
    dtypes = q.dtype, k.dtype, v.dtype
    dout, q, k, v, out = _widened(dout, q, k, v, out)
    s, group = _scores(q, k, scale, causal, mask, softcap)
    p = torch.exp(s - lse.to(s.dtype).unsqueeze(-1))  # lse may be +inf for empty rows -> p = 0
    vv = v.repeat_interleave(group, dim=2)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    delta = (dout.to(s.dtype) * out.to(s.dtype)).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp - delta) * scale
    if softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2; where p is 0 (masked: s = -inf) the product stays 0
        ds = ds * (1 - (s.masked_fill(p == 0, 0.0) / softcap) ** 2)
    kk = k.repeat_interleave(group, dim=2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    b, sk, hk, d = k.shape
    dk = dk.reshape(b, sk, hk, group, d).sum(3)
    dv = dv.reshape(b, sk, hk, group, d).sum(3)
    return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])


def attention(
    q,
    k,
    v,
    scale: float | None = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
):
    """Differentiable attention on the full sequence in `dtype` (float64 by default): the oracle.

    q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen, nheads_k, headdim).
    mask: optional bool (seqlen_q, seqlen_k), True = attend; combined with `causal` if both are given.
    sinks: optional (nheads,) attention sinks, taken as gpt-oss's eager attention takes them (one more
    score column per head, softmax over all, that column dropped), not as burst/sinks.py folds them.
    softcap: c > 0 makes every score c * tanh(score / c) (the sinks' logits are not capped).
    Returns out (batch, seqlen, nheads, headdim) and lse (batch, nheads, seqlen), both in `dtype`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sinks is None:
        return forward(q.to(dtype), k.to(dtype), v.to(dtype), scale, causal, mask, softcap)
    s, group = _scores(q.to(dtype), k.to(dtype), scale, causal, mask, softcap)
    sink_column = sinks.to(dtype)[None, :, None, None].expand(*s.shape[:3], 1)
    scores = torch.cat([s, sink_column], dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(dtype).repeat_interleave(group, dim=2))
    return out, torch.logsumexp(scores, dim=-1)


# --- verification: inputs, the float64 reference on the full sequence, errors and bounds ----------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# Largest error allowed, relative to the reference's largest magnitude (lse: absolute). float64's is
# far above its rounding (~1e-15) and far below any real defect; bfloat16's is over single-device
# SDPA's own error in bf16 (~1e-2).
BOUNDS = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}

REFERENCE_CHUNK_ELEMENTS = 1 << 22  # scores per query chunk of full_reference (32 MiB in float64)


def dtype_name(dtype: torch.dtype | str) -> str:
    """ "float32" for torch.float32 (or for "float32" / "torch.float32")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return name


def full_inputs(
    seed: int, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
) -> list[torch.Tensor]:
    """q, dout: (batch, seq_len, heads, head_dim); k, v: (batch, seq_len, kv_heads, head_dim).

    Seeded on the CPU, so identical on every rank; values of `dtype` held in float64, so the reference
    sees exactly the inputs a strategy sees once they are cast to `dtype`. Order: q, k, v, dout.
    """
    g = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, seq_len, heads, head_dim),
        (batch, seq_len, kv_heads, head_dim),
        (batch, seq_len, kv_heads, head_dim),
        (batch, seq_len, heads, head_dim),
    ]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(device, torch.float64) for s in shapes]


def full_reference(
    q,
    k,
    v,
    dout,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
):
    """float64 out (b, n, h, d), lse (b, h, n), dq, dk, dv of attention on the full sequence, and with
    `sinks` (h,) (attention's sinks) their gradient dsinks (h,) as a sixth value.

    q, dout: (batch, seq_len, heads, head_dim); k, v: (batch, seq_len_k, kv_heads, head_dim); mask:
    optional bool (seq_len, seq_len_k), True = attend, combined with `causal`; scale: default
    head_dim ** -0.5; softcap: as `attention`'s. Query rows go a chunk at
    a time against all keys, so no more than REFERENCE_CHUNK_ELEMENTS scores are held at once; the
    gradients come from autograd through `attention`, each chunk adding its share to dk and dv.
    """
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    if sinks is not None:
        sinks = sinks.detach().to(q.device, torch.float64).requires_grad_()
    dout = dout.to(torch.float64)
    b, n, h, _ = q.shape
    rows = max(1, min(n, REFERENCE_CHUNK_ELEMENTS // max(1, b * h * k.shape[1])))
    positions = torch.arange(n, device=q.device)
    outs, lses = [], []
    for start in range(0, n, rows):
        chunk = slice(start, min(n, start + rows))
        allowed = positions[chunk, None] >= positions[None, :] if causal else None
        if mask is not None:
            allowed = mask[chunk].to(q.device) if allowed is None else allowed & mask[chunk].to(q.device)
        out, lse = attention(q[:, chunk], k, v, scale=scale, mask=allowed, sinks=sinks, softcap=softcap)
        out.backward(dout[:, chunk])
        outs.append(out.detach())
        lses.append(lse.detach())
    result = (torch.cat(outs, 1), torch.cat(lses, 2), q.grad, k.grad, v.grad)
    return result if sinks is None else (*result, sinks.grad)


def absolute_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref|, in float64 (x on any device; ref's device)."""
    return (x.detach().to(ref.device, torch.float64) - ref).abs().max().item()


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (an all-zero reference compares absolutely)."""
    scale = ref.abs().max().item()
    return absolute_error(x, ref) / (scale if scale > 0 else 1.0)


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """max |lse - ref| over the rows that attend something; inf when a row attends nothing in one
    and something in the other (-inf in one place only)."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse).to(ref.device), finite):
        return float("inf")
    if not finite.any():
        return 0.0
    return (lse.detach().to(ref.device, torch.float64)[finite] - ref[finite]).abs().max().item()


QUANTITIES = ("out", "lse", "dq", "dk", "dv")  # what a check compares, in this order


def errors_against(mine, ref) -> dict:
    """{quantity: error} of (out, lse, dq, dk, dv) against the float64 reference of the same rows:
    lse_error for lse, relative_error for the others. A quantity None on either side is left out
    (SDPA returns no lse)."""
    return {
        name: lse_error(x, r) if name == "lse" else relative_error(x, r)
        for name, x, r in zip(QUANTITIES, mine, ref)
        if x is not None and r is not None
    }


def within_bounds(errors: dict, dtype: torch.dtype | str) -> bool:
    """Every error (relative_error's, lse_error's) at most the dtype's bound, and none NaN."""
    bound = BOUNDS[dtype_name(dtype)]
    return all(not math.isnan(e) and e <= bound for e in errors.values())
