"""burst.attention(q, latent=burst.LatentKV(...)): multi-head latent attention with the latent on the
ring (burst/latent.py), against float64 attention over the expanded keys and values on the full
sequence: out, dq, and the gradients of the latent, the rotary key and the expansion's weight.

One world per size; in it every mask x layout x chunking. The bytes: only latents travel.
"""

from __future__ import annotations

import burst
import pytest
import torch

from cases import TOL, reference_mask, rel_err
from world import results_by_world

B, H, NOPE, ROPE, VD, R = 2, 4, 8, 4, 6, 10


def full(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return r(B, n, H, NOPE + ROPE), r(B, n, R), r(B, n, ROPE), r(H * (NOPE + VD), R) * 0.3, r(B, n, H, VD)


def expand(c, rope, w):
    b, n, _ = c.shape
    kv = (c @ w.t()).view(b, n, H, NOPE + VD)
    k = torch.cat([kv[..., :NOPE], rope[:, :, None].expand(b, n, H, ROPE)], -1)
    return k, kv[..., NOPE:]


def reference(q, c, rope, w, dout, mask, sinks=None, softcap=0.0):
    """float64 attention over the expanded heads, with sinks (one logit per head in every row's
    denominator) and softcap (s -> softcap * tanh(s / softcap)) when given; out and the gradients."""
    q, c, rope, w = (t.clone().requires_grad_() for t in (q, c, rope, w))
    sinks = sinks.clone().requires_grad_() if sinks is not None else None
    k, v = expand(c, rope, w)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (NOPE + ROPE) ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    p = s.softmax(-1)[..., : mask.shape[-1]]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    out.backward(dout)
    return out.detach(), q.grad, c.grad, rope.grad, w.grad, sinks.grad if sinks is not None else None


def job(rank, world):
    n = 12 * world
    res = []
    q, c, rope, w, dout = full(n)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for name, kw in (
        ("causal", dict(causal=True)),
        ("window", dict(causal=True, window=(5, 0))),
        ("full", {}),
        ("sinks and softcap", dict(causal=True, sinks=sinks, softcap=3.0)),
    ):
        mask = reference_mask(n, causal=kw.get("causal", False), window=kw.get("window"))
        ref = reference(q, c, rope, w, dout, mask, kw.get("sinks"), kw.get("softcap", 0.0))
        for layout in ("contiguous", "zigzag"):
            for rows in (None, 3, 0):
                qs, cs, rs, ds = (burst.shard(t, layout=layout) for t in (q, c, rope, dout))
                qs, cs, rs = (t.clone().requires_grad_() for t in (qs, cs, rs))
                ws = w.clone().requires_grad_()
                call_kw = dict(kw)
                if "sinks" in kw:
                    call_kw["sinks"] = kw["sinks"].clone().requires_grad_()
                with burst.CommStats() as st:
                    out = burst.attention(
                        qs, latent=burst.LatentKV(cs, rs, ws, NOPE, VD), layout=layout, chunk_rows=rows, **call_kw
                    )
                    out.backward(ds)
                dw = ws.grad.clone()
                if world > 1:
                    torch.distributed.all_reduce(dw)
                theirs = [burst.shard(t, layout=layout) for t in (ref[0], ref[1], ref[2], ref[3])]
                e = dict(
                    out=rel_err(out, theirs[0]),
                    dq=rel_err(qs.grad, theirs[1]),
                    dc=rel_err(cs.grad, theirs[2]),
                    drope=rel_err(rs.grad, theirs[3]),
                    dw=rel_err(dw, ref[4]),
                )
                if "sinks" in kw:  # each rank's share, summed
                    dsinks = call_kw["sinks"].grad.clone()
                    if world > 1:
                        torch.distributed.all_reduce(dsinks)
                    e["dsinks"] = rel_err(dsinks, ref[5])
                res.append((name, layout, rows, max(e.values()), e, st.sent("forward"), st.sent("backward")))
    return res


_results = results_by_world(job)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_latent_attention_matches_float64_reference(world):
    failures = [
        f"rank {rank} {case[:3]}: {case[4]}"
        for rank, cases in enumerate(_results(world))
        for case in cases
        if not case[3] <= TOL[torch.float64]
    ]
    assert not failures, "\n".join(failures[:10])
    assert len(_results(world)[0]) == 4 * 2 * 3


@pytest.mark.parametrize("world", [2, 4])
def test_only_the_latent_travels(world):
    """Forward: (latent, rope) rows of the other ranks, (R + ROPE) numbers a token, never the
    H x (NOPE + ROPE + VD) of expanded keys and values; backward the same rows and their gradients."""
    n_local = 12
    latent_row = (R + ROPE) * 8  # float64
    for rank, cases in enumerate(_results(world)):
        for name, layout, rows, _, _, fwd, bwd in cases:
            if name == "full":  # every rank needs every other's keys: (G - 1) blocks, each way
                assert fwd == (world - 1) * B * n_local * latent_row, (rank, layout, rows, fwd)
                if rows is not None and rows > 0:  # served: the latents out, their gradients home
                    assert bwd == 2 * (world - 1) * B * n_local * latent_row, (rank, layout, rows, bwd)


def test_latent_refusals_before_any_communication():
    q, c, rope, w, _ = full(8)
    kv = burst.LatentKV(c, rope, w, NOPE, VD)
    with pytest.raises(ValueError, match="does not move MLA's latent"):
        burst.attention(q, latent=kv, strategy="ring")
    with pytest.raises(ValueError, match="backward_side='queries'"):
        burst.attention(q, latent=kv, backward_side="queries")
    with pytest.raises(ValueError, match="not both"):
        burst.attention(q, c, c, latent=kv)
    with pytest.raises(TypeError, match="needs k and v"):
        burst.attention(q)
    with pytest.raises(ValueError, match="does not take compressed"):
        entries = torch.zeros(B, 2, 1, NOPE + ROPE, dtype=torch.float64)
        burst.attention(q, latent=kv, compressed=burst.CompressedKV(entries, entries, 4))
    with pytest.raises(ValueError, match="LatentKV.weight must be"):
        burst.attention(q, latent=burst.LatentKV(c, rope, w[:-1], NOPE, VD))
    with pytest.raises(ValueError, match="q's headdim"):
        burst.attention(q, latent=burst.LatentKV(c, rope, w, NOPE + 1, VD))
