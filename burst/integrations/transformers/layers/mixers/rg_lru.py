"""RecurrentGemma's RG-LRU across ranks: a diagonal linear recurrence whose state the module keeps on
itself (`recurrent_states`), run per chunk from 0, from 1 and from its true start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...backend.registry import running_cache
from .state import Shards, from_true_starts, quiet_padding, running_on, runs_whole, undo_padding_decay


def rg_lru(module, forward, shards: Shards, activations, position_ids):
    """RecurrentGemma's RG-LRU; activations (B, T, W). A diagonal linear recurrence h_t = a_t h_{t-1} + x_t
    (a_t = 0 where a document starts), run by the module from `module.recurrent_states`: its outputs
    and final state are affine in that start, so each chunk runs from 0 and from 1 (the difference is
    its transition per channel), then from the state it truly starts from. In a ShardedCache's prompt
    the padding's activations are zeros (no input; its decay undone) and the module keeps the state after
    the prompt's last real token; a decoded token runs whole, from it."""
    running = running_on(shards, module, running_cache())
    if runs_whole(running):
        return forward(activations, position_ids)
    if activations.shape[1] == 1:
        raise ValueError(
            f"{type(module).__name__}: a shard of one token, which the layer runs as a decode step: decoding with "
            f"the sequence split across {shards.world} ranks needs burst's ShardedCache (model.generate(ids, "
            "**bt.sharded_cache(model))); training needs at least 2 tokens per rank"
        )

    def from_state(seg, start):
        module.recurrent_states = start
        try:
            out = forward(quiet_padding(running, seg, activations[:, seg.rows]), position_ids[:, seg.rows])
            return out, module.recurrent_states
        finally:
            module.recurrent_states = None

    def final_and_transition(seg):
        zeros = activations.new_zeros(activations.shape[0], activations.shape[2], dtype=torch.float32)
        _, final = from_state(seg, zeros)
        _, final_from_ones = from_state(seg, zeros + 1)
        return final, final_from_ones - final

    def run_from(seg, start):
        # A third run rather than out(0) + (out(1) - out(0)) * start: the module returns its outputs in
        # the activations' dtype, and in bf16 that difference would lose the decays' precision.
        return from_state(seg, start)[0]

    local_len = activations.shape[1]
    outs, whole = from_true_starts(running, local_len, "rg_lru_state", final_and_transition, run_from)
    if running.length is not None:  # a zero activation still decays the state by a = exp(-8 sigmoid(b) softplus(c))
        log_a = (
            -8
            * torch.sigmoid(module.recurrent_gate_bias.float().reshape(-1))
            * F.softplus(module.recurrent_param.float())
        )
        module.recurrent_states = undo_padding_decay(whole, -log_a, running, local_len)
    return torch.cat(outs, dim=1)
