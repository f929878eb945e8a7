"""The state-space scans of Mamba and Mamba2, sharded: `mamba_selective_scan` (a decay per channel and
state entry; it takes no starting state, so each chunk's decays are computed here) and
`mamba2_chunk_scan` (a scalar decay per head; its transition read off identity columns appended to the
state). Both are affine in their starting state: out = out(0) + coefficients @ start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst import state_passing

from .state import Shards, local_chunks, refuse_state_arguments


def mamba2_scan(
    original,
    shards: Shards,
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size=None,
    *args,
    initial_states=None,
    return_final_states=False,
    **kwargs,
):
    """Mamba2's chunked scan (scalar decay per head); hidden_states (B, T, H, P), B/C (B, T, G, N);
    state (B, H, P, N), transition (B, H, N, N) acting on the state's N side (a multiple of I)."""
    refuse_state_arguments("the Mamba2 scan", initial_states, return_final_states, kwargs.get("seq_idx"))
    batch, local_len, heads, head_dim = hidden_states.shape
    n = B.shape[-1]
    identity = torch.eye(n, dtype=torch.float32, device=hidden_states.device).expand(batch, heads, n, n)
    start = torch.cat([identity.new_zeros(batch, heads, head_dim, n), identity], dim=2)
    outs, coefficients, finals, transitions = [], [], [], []
    for seg in local_chunks(shards, local_len):
        rows = seg.rows
        x_ext = torch.cat([hidden_states[:, rows], hidden_states.new_zeros(batch, seg.length, heads, n)], dim=-1)
        out, final = original(
            x_ext,
            dt[:, rows],
            A,
            B[:, rows],
            C[:, rows],
            chunk_size,
            *args,
            initial_states=start,
            return_final_states=True,
            **kwargs,
        )
        outs.append(out[..., :head_dim])
        coefficients.append(out[..., head_dim:])
        finals.append(final[:, :, :head_dim].float())
        transitions.append(final[:, :, head_dim:].float())
    starts = state_passing.initial_states(
        finals, transitions, lambda m, h: h @ m, shards.layout, shards.group, local_len, phase="mamba2_state"
    )
    out = [o + torch.einsum("bthj,bhpj->bthp", c.float(), s).to(o.dtype) for o, c, s in zip(outs, coefficients, starts)]
    return torch.cat(out, dim=1)


def mamba_scan(
    original,
    shards: Shards,
    hidden_states,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    *args,
    **kwargs,
):
    """Mamba's selective scan (a decay per channel and state entry); hidden_states/dt/z (B, D, T),
    A (D, N), B/C (B, N, T); state (B, D, N), transition (B, D, N) elementwise. It takes no starting
    state, so each chunk's decays are computed here: exp(A * cumsum(dt)) after the scan's own bias
    and softplus."""
    refuse_state_arguments("the Mamba scan", None, return_last_state, None)
    local_len = hidden_states.shape[-1]
    steps = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
    steps = F.softplus(steps) if delta_softplus else steps
    mine = local_chunks(shards, local_len)
    outs, decays, finals, transitions = [], [], [], []
    for seg in mine:
        rows = seg.rows
        out, final = original(
            hidden_states[..., rows],
            dt[..., rows],
            A,
            B[..., rows],
            C[..., rows],
            D,
            None if z is None else z[..., rows],
            delta_bias,
            delta_softplus,
            True,
            *args,
            **kwargs,
        )
        cumulative = steps[..., rows].float().cumsum(-1)  # (B, D, t)
        decay = torch.exp(A.float()[None, :, None, :] * cumulative[..., None])  # (B, D, t, N)
        outs.append(out)
        decays.append(decay)
        finals.append(final.float())
        transitions.append(decay[:, :, -1])
    starts = state_passing.initial_states(
        finals, transitions, torch.mul, shards.layout, shards.group, local_len, phase="mamba_state"
    )
    result = []
    for seg, out, decay, start in zip(mine, outs, decays, starts):
        rows = seg.rows
        correction = torch.einsum("bdtn,bdn,bnt->bdt", decay, start, C[..., rows].float())
        if z is not None:
            correction = correction * F.silu(z[..., rows].float())
        result.append(out + correction.to(out.dtype))
    return torch.cat(result, dim=-1)
