"""CUDA backend: aten's memory-efficient SDPA ops, which return logsumexp and take an attention bias.

They need equal head counts, so KV heads are expanded for the kernel and their gradients summed
back (only the KV heads travel between ranks). Not exercised by the CPU test suite; see
benchmarks/README.md for what has been run on a GPU.
"""

from __future__ import annotations

import torch

from .masking import additive_mask, clear_empty_rows

# Rows per call at most (fresh outputs per call); larger than on CPU so that one call fills the GPU.
MAX_ROWS = 8192
_forward_op = torch.ops.aten._scaled_dot_product_efficient_attention
_backward_op = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def _bias(mask, q):
    bias = additive_mask(mask, q.dtype)
    return None if bias is None else bias.expand(q.shape[0], q.shape[2], *mask.shape)


def _expand_heads(k, v, nheads):
    group = nheads // k.shape[2]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def forward(q, k, v, scale: float, causal: bool, mask=None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    kk, vv = _expand_heads(k, v, q.shape[2])
    out, lse, _, _ = _forward_op(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), _bias(mask, q), True, 0.0, causal,
        scale=scale,
    )
    lse = lse[..., : q.shape[1]].float()  # some versions pad lse's last dim to a multiple of 32
    return clear_empty_rows(out.transpose(1, 2), lse, mask)


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    kk, vv = _expand_heads(k, v, q.shape[2])
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _backward_op(
        dout.transpose(1, 2), q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), _bias(mask, q),
        out.transpose(1, 2), lse.float().contiguous(), zero, zero, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    if group > 1:
        b, sk, hk, d = k.shape
        dk = dk.reshape(b, sk, hk, group, d).sum(3)
        dv = dv.reshape(b, sk, hk, group, d).sum(3)
    return dq, dk, dv
