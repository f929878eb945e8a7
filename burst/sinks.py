"""Attention sinks: one learned logit per head that joins every row's softmax and adds no value
(gpt-oss, and the transformers families that pass `s_aux` to their attention function).

A sink is a key whose value is zero and whose score is s_h for every query of head h. Attention over
the real keys plus the sink is the online-softmax merge (merge.py) of the finished (out, lse) with the
sink's partial (value 0, lse s_h):

    lse' = logaddexp(lse, s_h)            out' = exp(lse - lse') * out

so no kernel changes: ShardedAttentionFunction folds the sinks into each rank's finished rows after
any strategy's forward, and decode_attention after its merge.

Backward. P'_ij = exp(S_ij - lse'_i) are the real keys' probabilities with the sink in the
denominator, and out'_i = sum_j P'_ij v_j. The flash backward (dS = P' (dP - D), D_i = dO_i . out'_i)
is exact for q, k and v when it is handed (out', lse') in place of (out, lse): the sink's column has no
value, so it adds nothing to dP, and its share of D is already in out'. The sink is one more score of
each row of head h, with dP = 0 there, so

    d s_h = sum over rows i (and batch) of P'_i,sink (0 - D_i) = -sum_i exp(s_h - lse'_i) D_i,

and a loss that also reads lse' adds dlse_i P'_i,sink to each row's term (d lse'_i / d s_h = P'_i,sink;
the real keys get theirs through burst/lse_channel.py).
"""

from __future__ import annotations

import torch

from .merge import merged_lse_and_weights


def check_sinks(sinks, q: torch.Tensor) -> None:
    """ValueError / TypeError unless sinks is a floating (heads,) tensor on q's device (or None).

    q: (batch, seqlen_local, heads, head_dim)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape (heads,) = ({q.shape[2]},), got {type(sinks).__name__}")
    if sinks.shape != (q.shape[2],) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a floating tensor of shape (heads,) = ({q.shape[2]},), one logit per query "
            f"head; got {sinks.dtype} of shape {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}: put them on one device")


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse'): finished rows with the sinks in their softmax denominators.

    out: (batch, seqlen, heads, head_dim), any dtype (out' keeps it, the product taken in lse's
    dtype); lse: (batch, heads, seqlen) float32 or float64, -inf for a row with nothing to attend
    (its out' is 0 and lse' the sink); sinks: (heads,).
    """
    sink_lse = sinks.detach().to(lse.dtype)[None, :, None].expand_as(lse)
    lse_new, w_out, _ = merged_lse_and_weights(lse, sink_lse)
    return (out.to(lse.dtype) * w_out).to(out.dtype), lse_new


def sink_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, dlse: torch.Tensor | None = None
) -> torch.Tensor:
    """d sinks (heads,) in sinks' dtype, from this rank's rows only: sum_i exp(s_h - lse'_i) (dlse_i - D_i)
    with D_i = dO_i . out'_i (d lse'_i / d s_h = P'_i,sink, as for any score).

    dout, out: (batch, seqlen, heads, head_dim), out and lse after fold_sinks; dlse: (batch, heads,
    seqlen), lse's gradient, or None when the loss does not read lse. Like any parameter
    applied to this rank's rows, the sinks' gradient is this rank's share; summing it over the group
    (as bt.reduce_gradients does for every parameter) gives the whole sequence's.
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (batch, heads, seqlen)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    p_sink = torch.exp(sinks.detach().to(acc)[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
