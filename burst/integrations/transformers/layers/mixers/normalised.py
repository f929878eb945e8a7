"""The recurrences whose output divides by their state: RWKV-4's WKV and xLSTM's mLSTM. Not affine in
their state, so each chunk runs twice (from_true_starts): from zero to learn its final state, then
from the state it truly starts from. The states, kept by the layers as (sums, running max), are
combined as true sums in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .state import Shards, from_true_starts, refuse_state_arguments


def rwkv_wkv(original, shards: Shards, time_decay, time_first, key, value, state=None, return_state=False):
    """RWKV-4's WKV; key/value (B, T, C), time_decay/time_first (C,). Its state is (numerator,
    denominator, running max), the true sums being numerator * e^max and denominator * e^max, each
    decaying by e^w per token (w = -exp(time_decay)). The output divides by the state, so it is not
    affine in it: each chunk runs twice, from zero to learn its final state, then from the state it
    really starts from. The states are combined as true sums in float64 (no overflow below e^700)."""
    refuse_state_arguments("the RWKV WKV", state, return_state, None)
    decay = -torch.exp(time_decay.double())  # (C,) per token, in log space

    def final_and_transition(seg):
        _, (numerator, denominator, running_max) = original(
            time_decay, time_first, key[:, seg.rows], value[:, seg.rows], return_state=True
        )
        scale = torch.exp(running_max.double())
        final = torch.stack([numerator.double() * scale, denominator.double() * scale])  # (2, B, C)
        return final, torch.exp(decay * seg.length).expand_as(final)

    def run_from(seg, start):
        # Back to the stabilised form: max = log(denominator) (the denominator sums positive terms).
        running_max = torch.log(start[1].clamp_min(1e-150))
        stabilised = [
            (start[0] / start[1].clamp_min(1e-150)).float(),
            (start[1] > 0).float(),
            torch.where(start[1] > 0, running_max, torch.full_like(running_max, -1e38)).float(),
        ]
        return original(time_decay, time_first, key[:, seg.rows], value[:, seg.rows], state=stabilised)[0]

    outs, _ = from_true_starts(shards, key.shape[1], "rwkv_state", final_and_transition, run_from)
    return torch.cat(outs, dim=1), None


def mlstm(
    module,
    forward,
    shards: Shards,
    query,
    key,
    value,
    igate,
    fgate,
    c_initial=None,
    n_initial=None,
    m_initial=None,
    return_last_states=None,
    mode=None,
):
    """xLSTM's mLSTM backend; query/key (B, H, T, dk), value (B, H, T, dv), igate/fgate (B, H, T).
    State (c, n, m): the true cell and normaliser are c e^m (B, H, dk, dv) and n e^m (B, H, dk),
    each decaying by sigmoid(fgate) per token; the output divides by the normaliser, so each chunk
    runs twice (from zero for its final state, then from its true start). The states are combined as
    true sums in float64 and scaled back by their largest entry."""
    refuse_state_arguments("the mLSTM", c_initial, False, None)

    def final_and_transition(seg):
        rows = (slice(None), slice(None), seg.rows)
        _, (c, n, m) = forward(
            query[rows], key[rows], value[rows], igate[rows], fgate[rows], return_last_states=True, mode=mode
        )
        scale = torch.exp(m.double())[..., None]  # (B, H, 1, 1)
        final = torch.cat([c.double(), n.double()[..., None]], dim=-1) * scale  # (B, H, dk, dv + 1)
        decay = torch.exp(F.logsigmoid(fgate[rows].double()).sum(-1))[..., None, None]
        return final, decay.expand_as(final)

    def run_from(seg, start):
        rows = (slice(None), slice(None), seg.rows)
        largest = start.abs().amax(dim=(-2, -1))  # (B, H)
        m = torch.where(largest > 0, torch.log(largest.clamp_min(1e-300)), torch.zeros_like(largest))
        scaled = start / torch.exp(m)[..., None, None]
        c, n = scaled[..., :-1].to(query.dtype), scaled[..., -1].to(query.dtype)
        return forward(
            query[rows],
            key[rows],
            value[rows],
            igate[rows],
            fgate[rows],
            c_initial=c,
            n_initial=n,
            m_initial=m[..., None].to(query.dtype),
            return_last_states=True,
            mode=mode,
        )[0]

    outs, _ = from_true_starts(shards, query.shape[2], "mlstm_state", final_and_transition, run_from)
    return torch.cat(outs, dim=2), None
