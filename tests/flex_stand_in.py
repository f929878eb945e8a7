"""A differentiable stand-in for FlexAttention (torch on the CPU runs its forward but not its backward).

`create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device)` evaluates the mask_mod on broadcast index
grids, as FlexAttention's does per block, and `flex_attention(q, k, v, block_mask, scale, enable_gqa,
return_aux)` computes softmax attention on (b, h, s, d) with autograd, returning out and an aux with
the natural-log lse (-inf and out 0 for a row with no key), FlexAttention's conventions. The suite
uses it to check kernels/flex.py's backward algebra (global out and lse through weighted gradients);
the forward is also checked against the real flex_attention on the CPU.
"""

from __future__ import annotations

import types

import torch

CALLS: list[tuple] = []  # ("flex_attention", -1, -1, 1) per call: the record shape of flash_stand_in.CALLS


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", **kwargs):
    """B None: one mask for every batch row (mask_mod called with b = 0), else one per row, as FlexAttention."""
    assert H is None and not kwargs
    q_idx = torch.arange(Q_LEN, device=device)[:, None]
    kv_idx = torch.arange(KV_LEN, device=device)[None, :]
    rows = [torch.as_tensor(mask_mod(b, 0, q_idx, kv_idx)).expand(Q_LEN, KV_LEN) for b in range(B or 1)]
    dense = torch.stack(rows)[:, None]  # (B or 1, 1, Q_LEN, KV_LEN)
    assert dense.dtype == torch.bool
    return types.SimpleNamespace(dense=dense, shape=(B or 1, 1, Q_LEN, KV_LEN))


def flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):
    assert score_mod is None and not return_lse and return_aux is not None and return_aux.lse
    b, h, sq, d = query.shape
    hk = key.shape[1]
    assert enable_gqa == (h != hk) and h % hk == 0, "GQA needs enable_gqa=True"
    if block_mask is not None:
        assert block_mask.shape in ((1, 1, sq, key.shape[2]), (b, 1, sq, key.shape[2])), (
            "BlockMask built for another tile shape"
        )
    CALLS.append(("flex_attention", -1, -1, 1))
    kk, vv = key.repeat_interleave(h // hk, 1), value.repeat_interleave(h // hk, 1)
    s = (query @ kk.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    if block_mask is not None:
        s = s.masked_fill(~block_mask.dense, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = p @ vv
    return out, types.SimpleNamespace(lse=lse)
