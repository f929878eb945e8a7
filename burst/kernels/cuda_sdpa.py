"""CUDA backend: aten's memory-efficient SDPA ops, which return logsumexp and take an attention bias.

They need equal head counts, so KV heads are expanded for the kernel and their gradients summed
back (only the KV heads travel between ranks). Called directly, the ops skip what SDPA's dispatcher
does for them, so it is done here: the tile's mask (planned on the CPU, or band arguments) is made a
dense bias on q's device (the last resort, counted in CommStats.dense_masks), the
bias rows are padded to a multiple of 16 elements (the kernel refuses an unaligned bias stride,
"attn_bias is not correctly aligned"), and the backward gets lse padded to a multiple of 32 rows as
the forward returns it ("LSE is not correctly aligned"). The CPU suite checks this adapter against a
stand-in with those rules (tests/sdpa_stand_in.py); scripts/gpu_check.sh runs it on a GPU.
"""

from __future__ import annotations

import torch

from .heads import repeated_kv, summed_kv
from .masking import additive_mask, clear_empty_rows, dense_mask
from .spec import HALF, KernelSpec

# Rows per call at most (fresh outputs per call); larger than on CPU so that one call fills the GPU.
MAX_ROWS = 8192
SOFTCAP = False
SPEC = KernelSpec("sdpa", "cuda", (*HALF, torch.float32))  # aten's efficient op: no float64
_forward_op = torch.ops.aten._scaled_dot_product_efficient_attention
_backward_op = torch.ops.aten._scaled_dot_product_efficient_attention_backward


BIAS_ALIGN = 16  # elements: the largest alignment the efficient kernels ask of a bias row (SDPA pads so too)
LSE_ALIGN = 32  # rows: how the forward pads lse, so its head stride is a multiple of 8


def _bias(mask, q):
    """(b, h, sq, sk) additive bias over a row stride padded to BIAS_ALIGN; mask is on q's device."""
    if mask is None:
        return None
    *lead, sq, sk = mask.shape  # (sq, sk), or (b, 1, sq, sk) for an index selection
    padded = torch.full((*lead, sq, -(-sk // BIAS_ALIGN) * BIAS_ALIGN), float("-inf"), dtype=q.dtype, device=q.device)
    padded[..., :sk] = additive_mask(mask, q.dtype)
    return padded[..., :sk].expand(q.shape[0], q.shape[2], sq, sk)


def _padded_lse(lse):
    """lse (b, h, sq) as float32 in a buffer of LSE_ALIGN-padded rows (the forward's own layout)."""
    b, h, sq = lse.shape
    buf = torch.zeros(b, h, -(-sq // LSE_ALIGN) * LSE_ALIGN, dtype=torch.float32, device=lse.device)
    buf[..., :sq] = lse
    return buf


def forward(q, k, v, scale: float, causal: bool, mask=None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    mask = dense_mask(mask, q.device)
    kk, vv = repeated_kv(k, v, q.shape[2])
    out, lse, _, _ = _forward_op(
        q.transpose(1, 2),
        kk.transpose(1, 2),
        vv.transpose(1, 2),
        _bias(mask, q),
        True,
        0.0,
        causal,
        scale=scale,
    )
    lse = lse[..., : q.shape[1]].float()  # some versions pad lse's last dim to a multiple of 32
    return clear_empty_rows(out.transpose(1, 2), lse, mask)


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    mask = dense_mask(mask, q.device)
    kk, vv = repeated_kv(k, v, q.shape[2])
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _backward_op(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        kk.transpose(1, 2),
        vv.transpose(1, 2),
        _bias(mask, q),
        out.transpose(1, 2),
        _padded_lse(lse),
        zero,
        zero,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    kv_heads = k.shape[2]
    return dq.transpose(1, 2), summed_kv(dk.transpose(1, 2), kv_heads), summed_kv(dv.transpose(1, 2), kv_heads)
