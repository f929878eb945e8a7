"""A stand-in for flash_attn 2.7+'s interface module that enforces the real kernels' argument rules.

flash_attn needs a GPU; this module plays `flash_attn.flash_attn_interface` on the CPU so that the
suite checks burst's side of the contract (kernels/cuda_flash_attn.py): burst's (b, s, h, d) layout,
contiguous fp16/bf16 inputs, head dims that are multiples of 8, window sizes that are -1 or >= 0 with
the band aligned at the bottom-right corner (causal = right window 0) and read as FlashAttention-2 reads
them (a size >= max_seqlen_k unbounded, then one unbounded side beside a bound max_seqlen_k wide), the
varlen layout (total, h, d) with int32 `cu_seqlens` on q's device and lse (h, total_q), the gradients
written into the buffers given, and a row that sees no key returned with lse +inf (what flash_attn
does). It computes in float64 from the values it is given (including the global out and lse in the
backward) and records each call in `CALLS` as (function, window_left, window_right, sequences).
"""

from __future__ import annotations

import sys
import types

import torch

CALLS: list[tuple[str, int, int, int]] = []


def _check_common(q, k, v, softmax_scale, window_left, window_right, dropout_p=0.0, softcap=0.0, alibi=None):
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, q.dtype
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous(), "flash_attn wants contiguous inputs"
    assert q.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1] == v.shape[-1]
    assert q.shape[-2] % k.shape[-2] == 0, "query heads must be a multiple of key heads"
    assert isinstance(window_left, int) and isinstance(window_right, int), (window_left, window_right)
    assert window_left >= -1 and window_right >= -1, f"window sizes are -1 or >= 0: {(window_left, window_right)}"
    assert isinstance(softmax_scale, float) and (dropout_p, alibi) == (0.0, None)
    assert isinstance(softcap, float) and softcap >= 0.0, softcap


def _fa2_windows(left: int, right: int, max_k: int, causal: bool) -> tuple[int, int]:
    """What FlashAttention-2 does to the window sizes before its kernel: mha_fwd / mha_bwd make a size
    >= (max_)seqlen_k -1 and causal right 0, then set_params makes one -1 beside a bound max_seqlen_k."""
    left, right = (-1 if left >= max_k else left), (-1 if right >= max_k else right)
    if causal:
        right = 0
    if left < 0 <= right:
        left = max_k
    elif right < 0 <= left:
        right = max_k
    return left, right


def _band(sq: int, sk: int, causal: bool, left: int, right: int, max_k: int | None = None) -> torch.Tensor:
    """flash_attn's mask: query i sees keys i + sk - sq - left .. i + sk - sq + right, with the window
    sizes as FlashAttention-2 reads them (_fa2_windows; max_k: sk for the plain interface)."""
    left, right = _fa2_windows(left, right, sk if max_k is None else max_k, causal)
    d = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= d >= -left
    if right >= 0:
        ok &= d <= right
    return ok


def _scores(q, k, scale, allowed, softcap=0.0):
    """q (sq, h, d), k (sk, hk, d) -> scores (h, sq, sk) float64, capped (softcap > 0), masked."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~allowed, float("-inf")), group


def _forward_one(q, k, v, scale, allowed, softcap=0.0):
    s, group = _scores(q, k, scale, allowed, softcap)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: p 0
    out = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(group, 1))
    return out, lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash_attn: lse +inf for empty rows


def _backward_one(dout, q, k, v, out, lse, scale, allowed, softcap=0.0):
    s, group = _scores(q, k, scale, allowed, softcap)
    p = torch.exp(s - lse.double()[..., None])
    dp = torch.einsum("qhd,khd->hqk", dout.double(), v.double().repeat_interleave(group, 1))
    delta = (dout.double() * out.double()).sum(-1).transpose(0, 1)[..., None]
    ds = p * (dp - delta) * scale
    if softcap:
        ds = ds * (1 - (s.masked_fill(p == 0, 0.0) / softcap) ** 2)
    sk, hk, d = k.shape
    dq = torch.einsum("hqk,khd->qhd", ds, k.double().repeat_interleave(group, 1))
    dk = torch.einsum("hqk,qhd->khd", ds, q.double()).reshape(sk, hk, group, d).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p, dout.double()).reshape(sk, hk, group, d).sum(2)
    return dq, dk, dv


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    _check_common(q, k, v, softmax_scale, window_size_left, window_size_right, dropout_p, softcap, alibi_slopes)
    assert q.dim() == 4 and not return_softmax
    CALLS.append(("forward", window_size_left, 0 if causal else window_size_right, 1))
    allowed = _band(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    outs, lses = zip(*(_forward_one(q[b], k[b], v[b], softmax_scale, allowed, softcap) for b in range(q.shape[0])))
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float(), torch.empty(0), torch.empty(2, dtype=torch.int64)


def _flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state,
):
    _check_common(q, k, v, softmax_scale, window_size_left, window_size_right, dropout_p, softcap, alibi_slopes)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    CALLS.append(("backward", window_size_left, 0 if causal else window_size_right, 1))
    allowed = _band(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    for b in range(q.shape[0]):
        grads = _backward_one(dout[b], q[b], k[b], v[b], out[b], softmax_lse[b], softmax_scale, allowed, softcap)
        for buf, g in zip((dq, dk, dv), grads):
            buf[b].copy_(g)
    return torch.empty(0)


def _sequences(cu_seqlens, total, max_seqlen, device):
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.device == device
    cu = cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == total and all(a <= b for a, b in zip(cu, cu[1:])), cu
    assert isinstance(max_seqlen, int) and max_seqlen >= max(b - a for a, b in zip(cu, cu[1:]))
    return list(zip(cu, cu[1:]))


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
):
    _check_common(q, k, v, softmax_scale, window_size_left, window_size_right, dropout_p, softcap, alibi_slopes)
    assert q.dim() == 3 and not return_softmax and block_table is None and leftpad_k is None and seqused_k is None
    qseq = _sequences(cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    kseq = _sequences(cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    assert len(qseq) == len(kseq)
    CALLS.append(("varlen_forward", window_size_left, 0 if causal else window_size_right, len(qseq)))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for (q0, q1), (k0, k1) in zip(qseq, kseq):
        allowed = _band(q1 - q0, k1 - k0, causal, window_size_left, window_size_right, max_seqlen_k)
        out[q0:q1], lse[:, q0:q1] = _forward_one(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, allowed, softcap)
    return out.to(q.dtype), lse.float(), torch.empty(0), torch.empty(2, dtype=torch.int64)


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    _check_common(q, k, v, softmax_scale, window_size_left, window_size_right, dropout_p, softcap, alibi_slopes)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[1], q.shape[0])
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qseq = _sequences(cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    kseq = _sequences(cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    CALLS.append(("varlen_backward", window_size_left, 0 if causal else window_size_right, len(qseq)))
    dq.zero_(), dk.zero_(), dv.zero_()
    for (q0, q1), (k0, k1) in zip(qseq, kseq):
        allowed = _band(q1 - q0, k1 - k0, causal, window_size_left, window_size_right, max_seqlen_k)
        g = _backward_one(
            dout[q0:q1],
            q[q0:q1],
            k[k0:k1],
            v[k0:k1],
            out[q0:q1],
            softmax_lse[:, q0:q1],
            softmax_scale,
            allowed,
            softcap,
        )
        dq[q0:q1].copy_(g[0]), dk[k0:k1].copy_(g[1]), dv[k0:k1].copy_(g[2])
    return torch.empty(0)


def modules() -> dict[str, types.ModuleType]:
    """The stand-in package and interface, by the names `import flash_attn.flash_attn_interface` looks up."""
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    for name in (
        "_flash_attn_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
    ):
        setattr(interface, name, globals()[name])
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


class AtenOps:
    """aten's `_flash_attention_forward` / `_backward` (the FlashAttention-2 inside torch) on top of the
    stand-in above, with the ops' own rules: dense when cum_seq_q is None, scale and windows as
    keywords, the gradients returned; `padded_lse`: the varlen lse as older builds return it,
    (sequences, h, max_q), which the backward must get back in that layout."""

    def __init__(self, padded_lse: bool = False):
        self.padded_lse = padded_lse

    def forward(
        self,
        q,
        k,
        v,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale,
        window_size_left,
        window_size_right,
    ):
        assert not return_debug_mask and (cum_seq_q is None) == (cum_seq_k is None)
        empty = torch.empty(0)
        if cum_seq_q is None:
            assert (max_q, max_k) == (q.shape[1], k.shape[1])
            out, lse, _, _ = _flash_attn_forward(
                q, k, v, dropout_p, scale, is_causal, window_size_left, window_size_right, 0.0, None, False
            )
            return out, lse, empty, empty, empty
        out, lse, _, _ = _flash_attn_varlen_forward(
            q,
            k,
            v,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            scale,
            is_causal,
            window_size_left,
            window_size_right,
        )
        if self.padded_lse:
            lse = self._pad(lse, cum_seq_q, max_q)
        return out, lse, empty, empty, empty

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng_state,
        unused,
        *,
        scale,
        window_size_left,
        window_size_right,
    ):
        assert isinstance(rng_state, torch.Tensor) and isinstance(unused, torch.Tensor)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if cum_seq_q is None:
            _flash_attn_backward(
                dout,
                q,
                k,
                v,
                out,
                lse,
                dq,
                dk,
                dv,
                dropout_p,
                scale,
                is_causal,
                window_size_left,
                window_size_right,
                0.0,
                None,
                False,
                rng_state,
            )
            return dq, dk, dv
        if self.padded_lse:
            assert lse.shape == (len(cum_seq_q) - 1, q.shape[1], max_q), lse.shape
            lse = torch.cat(
                [lse[i, :, : b - a] for i, (a, b) in enumerate(zip(cum_seq_q.tolist(), cum_seq_q.tolist()[1:]))], 1
            )
        _flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            scale,
            is_causal,
            window_size_left,
            window_size_right,
            0.0,
            None,
            False,
            rng_state,
        )
        return dq, dk, dv

    @staticmethod
    def _pad(lse, cu, max_q):
        cu = cu.tolist()
        padded = torch.full((len(cu) - 1, lse.shape[0], max_q), float("nan"))
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            padded[i, :, : b - a] = lse[:, a:b]
        return padded


def install() -> None:
    """Put the stand-in in sys.modules for the rest of this process (a spawned rank)."""
    sys.modules.update(modules())
