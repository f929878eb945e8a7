"""Compressed keys beside the sequence: DeepSeek-V4's compressed attention (CSA and HCA).

DeepSeek-V4 compresses each window of `rate` tokens into one entry (a softmax-gated sum of the
window's projections) and lets a query attend, beside the raw keys of its sliding window, every entry
whose window has ended (HCA, rate 128) or only the entries its indexer chose among those (CSA, rate 4,
top-k). The entries are few (N / rate), so every rank holds them all: they never travel in the ring.

`CompressedKV(k, v, rate, indices)` hands them to burst.attention. Entry w summarises tokens
[w*rate, (w+1)*rate) and stands at the position of its window's last token, (w+1)*rate - 1, so a
query sees it exactly when it would see that token causally: the entries are one more key run (a
Segment of stride `rate`) planned under a causal mask by the same planner and kernels as any block
pair (masks/, kernels/attend.py), with the indexer's choice applied as an index selection
(masks/selection.py). No window, chunk or document mask applies to them.

Like the sinks (sinks.py) they fold into the finished rows after any strategy's forward:
(out, lse) of the sharded keys merges with the entries' partial (merge.py). The strategy's backward,
handed the folded (out', lse'), is exact for q, k and v, and the entries' own backward on the same
(out', lse') gives their gradient and the rest of dq. An entry's gradient is this rank's queries'
share: the caller that gathered the entries sums it back to their owner (the gather's backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.accumulators import accumulator_dtype, accumulator_zeros_like, lse_for_backward
from .kernels.attend import attend_backward, attend_forward
from .layout import Segment
from .masks import MaskSpec

ENTRY_MASK = MaskSpec(causal=True)  # an entry is seen from its window's last token on


@dataclass(frozen=True, eq=False)
class CompressedKV:
    """Compressed entries every rank holds whole.

    k, v: (batch, n, nheads_k, headdim), entry w summarising global tokens [w*rate, (w+1)*rate);
        nheads_k divides q's heads (DeepSeek-V4: one, with k and v the same tensor).
    rate: tokens per entry (DeepSeek-V4: 4 for CSA, 128 for HCA).
    indices: (batch, seqlen_local, topk) the entries each local query chose (entry numbers, -1: none),
        as DeepSeek-V4's CSA indexer picks them; None: every entry whose window has ended.
    """

    k: torch.Tensor
    v: torch.Tensor
    rate: int
    indices: torch.Tensor | None = None

    @property
    def segment(self) -> Segment:
        """The entries as a key run: entry w at position (w+1)*rate - 1."""
        return Segment(0, self.k.shape[1], self.rate - 1, self.rate)

    def positions(self) -> torch.Tensor | None:
        """The chosen entries as global key positions (masks/selection.py's indices), or None."""
        if self.indices is None:
            return None
        idx = self.indices.to(torch.long)
        return torch.where(idx >= 0, (idx + 1) * self.rate - 1, torch.full_like(idx, -1))


def check_compressed(compressed, q: torch.Tensor, v: torch.Tensor, global_len: int) -> None:
    """ValueError / TypeError unless `compressed` is None or a CompressedKV that fits q (batch,
    seqlen_local, nheads, headdim) and v over a sequence of global_len tokens. Local facts only."""
    if compressed is None:
        return
    if not isinstance(compressed, CompressedKV):
        raise TypeError(f"compressed must be a burst.CompressedKV, got {type(compressed).__name__}")
    ck, cv, rate = compressed.k, compressed.v, compressed.rate
    if not (isinstance(ck, torch.Tensor) and isinstance(cv, torch.Tensor)):
        raise TypeError("CompressedKV.k and .v must be tensors")
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
        raise ValueError(f"CompressedKV.rate must be a positive int (tokens per entry), got {rate!r}")
    b, _, h, d = q.shape
    if ck.dim() != 4 or ck.shape[0] != b or ck.shape[3] != d or h % max(ck.shape[2], 1) or ck.shape[2] == 0:
        raise ValueError(
            f"CompressedKV.k must be (batch, entries, nheads_k, headdim) with batch {b}, headdim {d} "
            f"and nheads_k dividing {h}, got {tuple(ck.shape)}"
        )
    if tuple(cv.shape[:3]) != tuple(ck.shape[:3]) or cv.shape[3] != v.shape[3]:
        raise ValueError(
            f"CompressedKV.v must be (batch, entries, nheads_k, v's headdim {v.shape[3]}) like k "
            f"{tuple(ck.shape)}, got {tuple(cv.shape)}"
        )
    if ck.dtype != q.dtype or cv.dtype != q.dtype or ck.device != q.device or cv.device != q.device:
        raise ValueError(
            f"CompressedKV.k and .v must be {q.dtype} on {q.device} like q, got {ck.dtype} and {cv.dtype} "
            f"on {ck.device}"
        )
    if ck.shape[1] * rate > global_len:
        raise ValueError(f"{ck.shape[1]} entries of {rate} tokens cover more than the sequence's {global_len} tokens")
    _check_entry_indices(compressed.indices, q, ck.shape[1])


def _check_entry_indices(indices, q: torch.Tensor, entries: int) -> None:
    if indices is None:
        return
    if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(
            f"CompressedKV.indices must be an integer tensor, got {getattr(indices, 'dtype', type(indices))}"
        )
    if indices.dim() != 3 or tuple(indices.shape[:2]) != tuple(q.shape[:2]) or indices.device != q.device:
        raise ValueError(
            f"CompressedKV.indices must be (batch, seqlen_local, topk) = ({q.shape[0]}, {q.shape[1]}, k) "
            f"on {q.device}, got {tuple(indices.shape)} on {indices.device}"
        )
    if indices.device.type == "cpu" and indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= entries):
        raise ValueError(
            f"CompressedKV.indices must be entry numbers in [-1, {entries}), got values from "
            f"{int(indices.min())} to {int(indices.max())}"
        )


def _tiles(call, compressed: CompressedKV):
    return call.plan(call.segments(call.rank), [compressed.segment], spec=ENTRY_MASK)


def fold_compressed(call, q: torch.Tensor, compressed: CompressedKV, out: torch.Tensor, lse: torch.Tensor):
    """(out', lse'): finished rows (out in q's dtype, lse float32) merged with their attention over the
    entries, in float32 accumulators."""
    acc = accumulator_dtype(q.dtype)
    out_acc, lse_acc = out.to(acc), lse.to(acc).clone()
    attend_forward(
        call.kernel,
        q,
        compressed.k,
        compressed.v,
        _tiles(call, compressed),
        out_acc,
        lse_acc,
        call.scale,
        indices=compressed.positions(),
    )
    return out_acc.to(out.dtype), lse_acc


def compressed_backward(call, dout, q, compressed: CompressedKV, out, lse):
    """(dq, dk, dv) of the entries' share, float32 (dk, dv shaped like the entries), from the folded
    (out', lse') of the rows."""
    dq, dk, dv = (accumulator_zeros_like(t) for t in (q, compressed.k, compressed.v))
    attend_backward(
        call.kernel,
        dout,
        q,
        compressed.k,
        compressed.v,
        out,
        lse_for_backward(lse),
        _tiles(call, compressed),
        dq,
        dk,
        dv,
        call.scale,
        indices=compressed.positions(),
    )
    return dq, dk, dv
