"""Online-softmax merge of partial attention results, in float32 (burstattention.md eq. 5-6).

Each block of keys gives a partial (out_j, lse_j) for the same query rows. With
lse = log(exp(lse_acc) + exp(lse_j)), the merged output is

    out = exp(lse_acc - lse) * out_acc + exp(lse_j - lse) * out_j,

which equals attention over the union of the key blocks. Rows that saw no key yet have lse -inf and
contribute weight 0 (never NaN).
"""

from __future__ import annotations

import torch


def merge_partial(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Merge a block's partial result into the float32 accumulators, in place.

    out_acc: (batch, seqlen, nheads, headdim) float32; lse_acc: (batch, nheads, seqlen) float32.
    out_blk, lse_blk: the same shapes, any dtype; left unchanged. Two passes over out_acc: addcmul_
    reads a half-precision out_blk as it is (no float32 copy of the block), 18 bytes an element for
    bf16 against 34 with a converted, scaled copy: on a GPU the merge is memory-bound, so it is what a
    ring step adds to its kernel call (benchmarks/merge.md).
    """
    lse_new, w_acc, w_blk = merged_lse_and_weights(lse_acc, lse_blk)
    out_acc.mul_(w_acc).addcmul_(out_blk, w_blk)
    lse_acc.copy_(lse_new)


def merged_lse_and_weights(lse_acc: torch.Tensor, lse_blk: torch.Tensor):
    """(lse, w_acc, w_blk) of the merge: lse (batch, nheads, seqlen) in lse_acc's dtype, and the weights
    exp(lse_acc - lse), exp(lse_blk - lse) as (batch, seqlen, nheads, 1), to scale outputs with."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isneginf(lse_new), 0.0, lse_new)
    w_acc = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - safe).transpose(1, 2).unsqueeze(-1)
    return lse_new, w_acc, w_blk
