"""Stand-ins for aten's memory-efficient attention ops (CUDA only) that enforce the CUDA kernels' rules.

kernels/cuda_sdpa.py calls the ops directly; here they compute with burst's reference kernel after
checking what the CUDA kernels check: equal head counts, a bias on q's device in q's dtype whose row
stride is a multiple of cuda_sdpa.BIAS_ALIGN, lse padded to 32 rows as the forward returns it.
"""

from __future__ import annotations

import torch
from burst.kernels import cuda_sdpa, reference


def _standin_forward(q, k, v, bias, compute_lse, dropout_p, causal, *, scale):
    """aten._scaled_dot_product_efficient_attention on (b, h, s, d), with the CUDA kernel's checks."""
    assert compute_lse and dropout_p == 0.0 and k.shape[1] == q.shape[1]  # equal heads: the adapter expands KV
    mask = _checked_bias(bias, q)
    out, lse = reference.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, causal, mask)
    b, h, sq = lse.shape
    padded = torch.zeros(b, h, -(-sq // 32) * 32, dtype=torch.float32)  # as the CUDA op returns it
    padded[..., :sq] = lse
    return out.transpose(1, 2), padded, torch.zeros(()), torch.zeros(())


def _standin_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, causal, *, scale):
    assert list(grad_mask) == [True, True, True, False]
    assert lse.dtype == torch.float32 and lse.stride(1) % 8 == 0 and lse.stride(0) % 8 == 0, (
        "LSE is not correctly aligned"
    )
    mask = _checked_bias(bias, q)
    sq = q.shape[2]
    grads = reference.backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse[..., :sq],
        scale,
        causal,
        mask,
    )
    return (*(g.transpose(1, 2) for g in grads), None)


def _checked_bias(bias, q):
    if bias is None:
        return None
    assert bias.device == q.device and bias.dtype == q.dtype
    assert bias.stride(2) % cuda_sdpa.BIAS_ALIGN == 0, "attn_bias is not correctly aligned (strideM)"
    return bias[0, 0] == 0


def install(monkeypatch) -> None:
    """Route cuda_sdpa's op calls to the stand-ins for one test."""
    monkeypatch.setattr(cuda_sdpa, "_forward_op", _standin_forward)
    monkeypatch.setattr(cuda_sdpa, "_backward_op", _standin_backward)
