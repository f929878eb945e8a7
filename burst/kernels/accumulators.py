"""The accumulator protocol every strategy's loop keeps: float32 statistics whatever the input dtype.

Partial outputs, lse and gradient accumulators stay float32 (float64 for float64 input) across ring
steps, so bf16 over many ranks is as accurate as one device's bf16 attention. Here: the accumulators'
dtype and how they start, the per-row quantities of the backward (lse with empty rows made safe,
D = rowsum(dO * O), the stand-in for O rebuilt from D, exact in float32), and the accumulators that arrive with a
travelling block (ArrivingAccumulators).
"""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulators: float32 for every input dtype but float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulator_zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A float32 accumulator shaped like `t` (float64 stays float64)."""
    return torch.zeros(t.shape, dtype=accumulator_dtype(t.dtype), device=t.device)


def empty_accumulators(q: torch.Tensor):
    """(out_acc, lse_acc) for q's rows: zeros and -inf, float32 (float64 for float64 input)."""
    acc = accumulator_dtype(q.dtype)
    b, s, h, _ = q.shape
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out_acc, lse_acc


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows with nothing to attend) replaced by +inf, so exp(s - lse) = 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dout * out) in float32 (float64 for float64 input), (batch, nheads, seqlen)."""
    acc = accumulator_dtype(dout.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


def out_from_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A stand-in for `out` whose rowsum(dout * out), summed in float32 as the kernels sum it, is `delta`.

    Flash backward kernels take `out` only to compute delta = rowsum(dout * out). BurstAttention's
    backward (burstengine.md Alg. 2) moves delta instead of out around the ring, so on arrival we
    rebuild the projection of out onto dout, (delta / |dout|^2) * dout, whose norm never exceeds |out|.
    In bf16/fp16 that projection's rounding leaves delta off by ~2^-9 of itself, and where one key
    takes a row's whole softmax (very large scores) dS = P * (dP - delta) is a difference of two
    near-equal numbers, so the gradients were up to ~4x further from float64 than with the real out
    (docs/numerics.md). The two entries where |dout| is largest therefore carry the projection's
    remainder, the second what the first's rounding left: delta comes back to float32's precision.

    dout: (batch, seqlen, nheads, headdim); delta: (batch, nheads, seqlen) float32.
    """
    acc = accumulator_dtype(dout.dtype)
    delta = delta.transpose(1, 2)  # (b, s, h), as dout's rows
    norm2 = torch.linalg.vector_norm(dout, dim=-1, dtype=acc).square_()  # (b, s, h), no full-size temporary
    coef = torch.where(norm2 > 0, delta / norm2.clamp_min(torch.finfo(acc).tiny), 0.0)
    # Multiplied in float32 and rounded once into dout's dtype, with no float32 copy of dout.
    out = torch.mul(dout, coef.unsqueeze(-1), out=torch.empty_like(dout))
    if dout.dtype == acc or dout.shape[-1] < 2:
        return out  # float32 and float64 round the projection finely enough
    return _carry_remainder(dout, out, delta)


def _carry_remainder(dout: torch.Tensor, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out with its two entries of largest |dout| set so that rowsum(dout * out) = delta in float32.

    The first takes what the other entries leave of delta; the second what the first's rounding
    left (dropped where that would need an entry larger than twice the first: a tiny |dout|)."""
    acc = delta.dtype
    wide = dout.to(acc).abs_()  # the one float32 temporary of the rows (a flash backward's dq accumulator is as large)
    first = wide.argmax(-1, keepdim=True)  # two argmax: topk is ~7x slower on the CPU
    second = wide.scatter_(-1, first, -1.0).argmax(-1, keepdim=True)
    top = torch.cat([first, second], -1)  # (b, s, h, 2)
    out.scatter_(-1, top, 0)
    rest = delta - wide.copy_(dout).mul_(out).sum(-1)
    first, second = dout.gather(-1, top).to(acc).unbind(-1)  # exact in float32
    at_first = _quotient(rest, first).to(dout.dtype)
    rest = rest - at_first.to(acc) * first  # exact products of two half-precision numbers
    at_second = _quotient(rest, second)
    at_second = torch.where(at_second.abs() <= 2 * at_first.to(acc).abs(), at_second, 0.0)
    return out.scatter_(-1, top, torch.stack([at_first, at_second.to(dout.dtype)], -1))


def _quotient(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den is 0."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, 1.0), 0.0)


class ArrivingAccumulators:
    """The gradient accumulators of the block a rank holds in a ring: what the ranks before it added.

    They arrive on `comm` from the previous step's send_recv (`arriving`; None on the first step, which
    starts from zeros shaped like `likes`). attend_backward asks for them after its first kernel call:
    the transfer was posted a whole step earlier, so it has normally finished by then (a tile's compute
    outlasts a block's transfer) and the wait is free. The kernel's gradients then add straight onto
    the received buffers: two buffer sets per rank (one arriving, one leaving, swapped by RingComm)
    instead of three (a fresh one, the arriving one and the leaving one).
    """

    def __init__(self, likes: list[torch.Tensor], comm, arriving: list[torch.Tensor] | None):
        self._likes, self._comm, self._arriving = likes, comm, arriving
        self._accs: list[torch.Tensor] | None = None

    def __call__(self) -> list[torch.Tensor]:
        if self._accs is None:
            if self._arriving is None:
                self._accs = [accumulator_zeros_like(t) for t in self._likes]
            else:
                self._comm.wait()
                self._accs, self._arriving = list(self._arriving), None
        return self._accs

    def part(self, i: int):
        """The i-th accumulator, deferred: a function for attend_backward."""
        return lambda: self()[i]
