"""Linear attention across ranks: the gated delta rule (Qwen3-Next / Qwen3.5, OLMo hybrid; Kimi's delta
attention, a decay per key channel, through the same function) and MiniMax's lightning attention (a
decay per head, its loop inline in the layer's forward).

The gated delta rule's state after a chunk, and its outputs, are affine in the state before it: the
original function, given identity columns appended to the state (and zero values for them), returns
the chunk's transition and how each output reads the starting state in the same call. Lightning
attention runs each chunk twice instead (from_true_starts), the second time from the state handed in
as the cache the layer reads.
"""

from __future__ import annotations

import torch

from burst import state_passing

from ...keywords import cache_keyword
from .state import (
    Shards,
    from_true_starts,
    local_chunks,
    one_rank_prompt,
    quiet_padding,
    refuse_state_arguments,
    running_on,
    runs_whole,
    undo_padding_decay,
)


def gated_delta_rule(
    original,
    shards: Shards,
    query,
    key,
    value,
    g,
    beta,
    *args,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    **kwargs,
):
    """Gated delta rule; query/key (B, T, Hk, dk), value (B, T, Hv, dv), g (B, T, Hv) or, Kimi's,
    (B, T, Hv, dk), beta (B, T, Hv); state (B, Hv, dk, dv), transition (B, Hv, dk, dk) acting on the
    state's dk side. In a ShardedCache's prompt the final state is the whole prompt's (the padding
    quiet: g = 0 keeps the state, beta = 0 writes nothing), the same on every rank."""
    refuse_state_arguments("the gated delta rule", initial_state, output_final_state, cu_seqlens, shards.length)
    batch, local_len, heads, dv = value.shape
    prompt = one_rank_prompt(shards, local_len)
    if prompt is not None:  # the identity columns are not needed
        g, beta = quiet_padding(shards, prompt, g), quiet_padding(shards, prompt, beta)
        return original(query, key, value, g, beta, *args, output_final_state=output_final_state, **kwargs)
    dk = key.shape[-1]
    identity = torch.eye(dk, dtype=torch.float32, device=value.device).expand(batch, heads, dk, dk)
    start = torch.cat([identity.new_zeros(batch, heads, dk, dv), identity], dim=-1)
    outs, coefficients, finals, transitions = [], [], [], []
    for seg in local_chunks(shards, local_len):
        rows = seg.rows
        value_ext = torch.cat([value[:, rows], value.new_zeros(batch, seg.length, heads, dk)], dim=-1)
        out, final = original(
            query[:, rows],
            key[:, rows],
            value_ext,
            quiet_padding(shards, seg, g[:, rows]),
            quiet_padding(shards, seg, beta[:, rows]),
            *args,
            initial_state=start,
            output_final_state=True,
            **kwargs,
        )
        outs.append(out[..., :dv])
        coefficients.append(out[..., dv:])
        finals.append(final[..., :dv].float())
        transitions.append(final[..., dv:].float())
    starts, whole = state_passing.scan_states(
        finals, transitions, torch.matmul, shards.layout, shards.group, local_len, phase="gated_delta_rule_state"
    )
    out = [o + torch.einsum("bthk,bhkv->bthv", c.float(), s).to(o.dtype) for o, c, s in zip(outs, coefficients, starts)]
    return torch.cat(out, dim=1), whole.to(final.dtype) if output_final_state else None


class _StartState:
    """The cache a MiniMax lightning-attention layer reads its starting state from (and whose update
    it makes at the end, dropped): with a state, the layer runs its token-by-token recurrence."""

    def __init__(self, state: torch.Tensor):
        self.state, self.read = state, False

    def get_linear_cache(self, layer_idx):
        self.read = True
        return self.state

    def set_linear_cache(self, layer_idx, value):
        pass


def lightning_attention(module, forward, shards: Shards, hidden_states, *args, **kwargs):
    """MiniMax's lightning attention (linear attention with a decay per head, its loop inline in the
    forward); hidden_states (B, T, D); state (B, H, d, d), decaying by exp(-slope) per token. Each
    chunk runs the layer twice: from zero (its final state: the forward returns it), then from the
    state it truly starts from (handed in as the cache the layer reads). In a ShardedCache's prompt the
    padding's inputs are zeros (no key, no value: the state only decays there, undone) and the cache
    keeps the state after the prompt's last real token; a decoded token runs the layer whole."""
    keyword = cache_keyword(forward)
    caches = [kwargs.pop(name, None) for name in ("cache", "past_key_values")]
    cache = next((c for c in caches if c is not None), None)
    running = running_on(shards, module, cache)
    if runs_whole(running):
        return forward(hidden_states, *args, **({keyword: cache} if cache is not None else {}), **kwargs)
    local_len = hidden_states.shape[1]
    if running.length is not None:
        _check_zero_is_quiet(module)
    prompt = one_rank_prompt(running, local_len)
    if prompt is not None:  # a ShardedCache's prompt on one rank: one run from zero, its padding quiet
        out, final = forward(quiet_padding(running, prompt, hidden_states), *args, **kwargs)
        whole = undo_padding_decay(final.float(), module.slope_rate, running, local_len)
        cache.set_linear_cache(module.layer_idx, whole.to(final.dtype))
        return out, None
    state_dtype = {}  # the layer's own state dtype (its value projection's, under autocast too)

    def final_and_transition(seg):
        _, final = forward(quiet_padding(running, seg, hidden_states[:, seg.rows]), *args, **kwargs)
        state_dtype["value"] = final.dtype
        return final.float(), torch.exp(-module.slope_rate.float() * seg.length).expand_as(final)

    def run_from(seg, start):
        given = _StartState(start.to(state_dtype["value"]))
        out = forward(quiet_padding(running, seg, hidden_states[:, seg.rows]), *args, **{keyword: given}, **kwargs)[0]
        if not given.read:  # the layer ran from zero: wrong, so loud
            raise RuntimeError(
                f"{type(module).__name__} did not read the starting state burst handed it; this "
                "transformers release arranges the layer differently from what burst knows"
            )
        return out

    outs, whole = from_true_starts(running, local_len, "lightning_state", final_and_transition, run_from)
    if cache is not None:  # the padding's decay undone
        whole = undo_padding_decay(whole, module.slope_rate, running, local_len)
        cache.set_linear_cache(module.layer_idx, whole.to(state_dtype["value"]))
    return torch.cat(outs, dim=1), None


def _check_zero_is_quiet(module) -> None:
    """ValueError unless a zero input gives no key and no value (a projection without bias, an activation
    with act(0) = 0), which quiets a ShardedCache's padding."""
    zero = torch.zeros(1, device=module.slope_rate.device)
    if module.qkv_proj.bias is not None or bool(module.act_fn(zero).abs().max() > 0):
        raise ValueError(
            f"{type(module).__name__}: its keys and values of a zero input are not zero, so the padding of a "
            "prompt split across ranks would change its state: generate() on a ShardedCache is refused for it"
        )
