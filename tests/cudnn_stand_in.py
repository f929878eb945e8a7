"""A stand-in for torch's cuDNN attention ops (CUDA only) that enforces their argument rules.

kernels/cudnn.py calls `aten::_scaled_dot_product_cudnn_attention` and its backward directly. Here they
compute in float64 (flash_stand_in's math: the backward from the out and lse it is handed) after
checking what torch's cuDNN path asks: (b, h, s, d) tensors with unit stride on the head dim, fp16/bf16
alike, head dims multiples of 8 up to 128, query heads a multiple of key heads (GQA without repeats),
no bias, lse requested, no dropout, not a one-query one-key tile (its frontend refuses s_q = s_kv = 1, found
at 4 ranks on an H200; 1 x n and n x 1 run), the causal triangle top-left; the backward's dout in out's strides,
lse as the forward returns it ((b, h, sq, 1) float32, contiguous), max_q and max_k the dense lengths
(its dense path reads them as such), None for the bias and the varlen tensors, seed and offset tensors.
Each call is logged in CALLS as (op, is_causal, sq, sk).
"""

from __future__ import annotations

import torch

from flash_stand_in import _backward_one, _forward_one

CALLS: list[tuple[str, bool, int, int]] = []


def _check_inputs(*tensors):
    q = tensors[0]
    for t in tensors:
        assert t.dim() == 4 and t.stride(-1) == 1, f"cuDNN wants (b, h, s, d) with unit stride on d: {t.stride()}"
        assert t.dtype == q.dtype and t.dtype in (torch.float16, torch.bfloat16), t.dtype
    b, h, _, d = q.shape
    k, v = tensors[1], tensors[2]
    assert d % 8 == 0 and d <= 128 and k.shape[-1] == d and v.shape[-1] % 8 == 0, (d, k.shape, v.shape)
    assert k.shape[0] == v.shape[0] == b and k.shape[1] == v.shape[1] and h % k.shape[1] == 0, (q.shape, k.shape)
    assert k.shape[2] == v.shape[2]
    assert (q.shape[2], k.shape[2]) != (1, 1), "cuDNN Frontend error: s_q = s_kv = 1 is not supported."


def _top_left(sq: int, sk: int, causal: bool) -> torch.Tensor:
    """Query i sees keys 0..i (the triangle anchored at the top-left corner, any tile shape)."""
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    return allowed.tril() if causal else allowed


def _like(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values in t's dtype and strides (the op allocates its outputs with the input's layout)."""
    return torch.empty_like(t).copy_(values)


def forward(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    _check_inputs(query, key, value)
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
    assert isinstance(scale, float) and isinstance(is_causal, bool)
    b, h, sq, _ = query.shape
    sk = key.shape[2]
    allowed = _top_left(sq, sk, is_causal)
    out = torch.empty(b, sq, h, value.shape[-1], dtype=torch.float64)
    lse = torch.empty(b, h, sq, dtype=torch.float64)
    for i in range(b):
        o, l = _forward_one(query[i].transpose(0, 1), key[i].transpose(0, 1), value[i].transpose(0, 1), scale, allowed)
        out[i], lse[i] = o, l
    CALLS.append(("forward", is_causal, sq, sk))
    seed = torch.zeros((), dtype=torch.int64)
    return (
        _like(query[..., : value.shape[-1]], out.transpose(1, 2)),
        lse.float().unsqueeze(-1).contiguous(),
        None,
        None,
        sq,
        sk,
        seed,
        seed.clone(),
        None,
    )


def backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    _check_inputs(query, key, value, grad_out, out)
    assert grad_out.stride() == out.stride(), f"same_strides(o, dO): {out.stride()} != {grad_out.stride()}"
    b, h, sq, _ = query.shape
    sk = key.shape[2]
    assert logsumexp.shape == (b, h, sq, 1) and logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    assert all(isinstance(t, torch.Tensor) for t in (philox_seed, philox_offset))
    assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
    assert (max_q, max_k) == (sq, sk), "the dense backward reads max_q, max_k as the lengths"
    assert isinstance(scale, float) and isinstance(is_causal, bool)
    allowed = _top_left(sq, sk, is_causal)
    dq, dk, dv = (torch.empty(t.shape, dtype=torch.float64) for t in (query, key, value))
    for i in range(b):
        grads = _backward_one(
            *(t[i].transpose(0, 1) for t in (grad_out, query, key, value, out)), logsumexp[i, ..., 0], scale, allowed
        )
        for acc, g in zip((dq, dk, dv), grads):
            acc[i] = g.transpose(0, 1)
    CALLS.append(("backward", is_causal, sq, sk))
    return _like(query, dq), _like(key, dk), _like(value, dv)


def install(monkeypatch) -> None:
    """Route kernels/cudnn.py's op calls to the stand-ins for one test, and let it run on the CPU."""
    from burst.kernels import cudnn

    monkeypatch.setattr(cudnn, "_forward_op", forward)
    monkeypatch.setattr(cudnn, "_backward_op", backward)
    CALLS.clear()
