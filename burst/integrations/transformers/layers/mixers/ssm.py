"""The state-space scans of Mamba and Mamba2, sharded: `mamba_selective_scan` (a decay per channel and
state entry; it takes no starting state, so each chunk's decays are computed here) and
`mamba2_chunk_scan` (a scalar decay per head; its transition read off identity columns appended to the
state). Both are affine in their starting state: out = out(0) + coefficients @ start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst import state_passing

from .state import Shards, local_chunks, one_rank_prompt, quiet_padding, refuse_state_arguments, undo_padding_decay


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
    state (B, H, P, N), transition (B, H, N, N) acting on the state's N side (a multiple of I). In a
    ShardedCache's prompt the final state is the whole prompt's, the same on every rank: the padding has
    no input and the least step the scan takes (0, or the floor of its clamp, whose decay is undone)."""
    refuse_state_arguments("the Mamba2 scan", initial_states, return_final_states, kwargs.get("seq_idx"), shards.length)
    quiet, floor = _no_step(kwargs.get("dt_softplus", False)), kwargs.get("dt_limit", (0.0, float("inf")))[0]
    batch, local_len, heads, head_dim = hidden_states.shape
    prompt = one_rank_prompt(shards, local_len)
    if prompt is not None:  # the identity columns are not needed
        x, dt = quiet_padding(shards, prompt, hidden_states), quiet_padding(shards, prompt, dt, quiet)
        out = original(x, dt, A, B, C, chunk_size, *args, return_final_states=return_final_states, **kwargs)
        if return_final_states and floor > 0:
            final = undo_padding_decay(out[1].float(), -A[None, :, None, None] * floor, shards, local_len)
            out = (out[0], final.to(out[1].dtype))
        return out
    n = B.shape[-1]
    identity = torch.eye(n, dtype=torch.float32, device=hidden_states.device).expand(batch, heads, n, n)
    start = torch.cat([identity.new_zeros(batch, heads, head_dim, n), identity], dim=2)
    outs, coefficients, finals, transitions = [], [], [], []
    for seg in local_chunks(shards, local_len):
        rows = seg.rows
        x = quiet_padding(shards, seg, hidden_states[:, rows])
        x_ext = torch.cat([x, hidden_states.new_zeros(batch, seg.length, heads, n)], dim=-1)
        out, final = original(
            x_ext,
            quiet_padding(shards, seg, dt[:, rows], quiet),
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
    starts, whole = state_passing.scan_states(
        finals, transitions, lambda m, h: h @ m, shards.layout, shards.group, local_len, phase="mamba2_state"
    )
    out = [o + torch.einsum("bthj,bhpj->bthp", c.float(), s).to(o.dtype) for o, c, s in zip(outs, coefficients, starts)]
    out = torch.cat(out, dim=1)
    if shards.length is not None and floor > 0:  # each padding token still decayed the state by exp(A floor)
        whole = undo_padding_decay(whole, -A[None, :, None, None] * floor, shards, local_len)
    return (out, whole.to(final.dtype)) if return_final_states else out


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
    and softplus. In a ShardedCache's prompt the final state is the whole prompt's (the padding's step
    quiet: 0 after the softplus), the same on every rank."""
    refuse_state_arguments("the Mamba scan", None, return_last_state, None, shards.length)
    local_len = hidden_states.shape[-1]
    mine = local_chunks(shards, local_len)
    if shards.length is not None:
        quiet = _no_step(delta_softplus)
        dt = torch.cat([quiet_padding(shards, seg, dt[..., seg.rows], quiet, dim=-1) for seg in mine], dim=-1)
    steps = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
    steps = F.softplus(steps) if delta_softplus else steps
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
    starts, whole = state_passing.scan_states(
        finals, transitions, torch.mul, shards.layout, shards.group, local_len, phase="mamba_state"
    )
    result = []
    for seg, out, decay, start in zip(mine, outs, decays, starts):
        rows = seg.rows
        correction = torch.einsum("bdtn,bdn,bnt->bdt", decay, start, C[..., rows].float())
        if z is not None:
            correction = correction * F.silu(z[..., rows].float())
        result.append(out + correction.to(out.dtype))
    result = torch.cat(result, dim=-1)
    return (result, whole.to(final.dtype)) if return_last_state else result


def _no_step(softplus: bool) -> float:
    """The step (dt, before the scan's own softplus) of a padding token: 0, no decay and no input."""
    return float("-inf") if softplus else 0.0
