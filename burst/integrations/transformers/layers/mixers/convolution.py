"""Short causal convolutions and token shifts across ranks: each chunk gets the inputs before it (its
halo) from whichever rank holds them, in one all-gather (state_passing.halo).

`causal_conv1d_fn` (the hybrids' short convolutions) is wrapped in the modeling module;
RecurrentGemma's temporal convolution is an nn.Conv1d module whose forward is replaced
(shard_convolution_modules); RWKV's time shift (each token mixes in the one before) is a ZeroPad2d
module replaced by a TokenShift (shard_token_shifts). ZAYA's compressed convolutional attention
(CCA) mixes its queries and keys by two causal convolutions and delays half of each value head by
one token, inside its q/k/v projection module: that module runs per chunk with the halo handed in
as the cache it reads in generation (cca_projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst import state_passing

from ...backend.registry import running_cache
from .state import Shards, local_chunks, running_on, runs_whole


def causal_conv(original, shards: Shards, hidden_states, weight, bias=None, *args, **kwargs):
    """Causal depthwise conv1d; hidden_states (B, C, T), weight (C, k): each chunk gets the k - 1
    inputs before it (its halo) from whichever rank holds them."""
    width = weight.shape[-1] - 1
    local_len = hidden_states.shape[-1]
    mine = local_chunks(shards, local_len)
    if width == 0:
        return original(hidden_states, weight, bias, *args, **kwargs)
    tails = [hidden_states[..., seg.rows][..., -width:] for seg in mine]  # a chunk shorter than width: all of it
    halos = state_passing.halo(tails, width, shards.layout, shards.group, local_len, phase="conv_halo")
    outs = [
        original(torch.cat([halo, hidden_states[..., seg.rows]], dim=-1), weight, bias, *args, **kwargs)[..., width:]
        for seg, halo in zip(mine, halos)
    ]
    return torch.cat(outs, dim=-1)


def _causal_depthwise(x, weight, bias):
    """x (B, C, T) through a depthwise convolution of weight (C, k), the k - 1 inputs before each
    output taken from x itself: causal_conv1d_fn's arithmetic, for causal_conv."""
    return F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight[:, None, :], bias, groups=x.shape[1])


def shard_convolution_modules(model: torch.nn.Module, shards: Shards) -> None:
    """RecurrentGemma's temporal convolution is an nn.Conv1d module (depthwise, padded k - 1 on both
    sides, the caller keeps the first T outputs): its forward becomes causal_conv's, each chunk with its halo.
    In a ShardedCache's prompt the block keeps (conv1d_state, on itself) the inputs of its last k - 1 tokens."""
    for block in model.modules():
        conv = getattr(block, "conv_1d", None)
        if type(block).__name__ != "RecurrentGemmaRecurrentBlock" or not isinstance(conv, torch.nn.Conv1d):
            continue
        if conv.groups != conv.in_channels or conv.padding != (conv.kernel_size[0] - 1,):
            raise ValueError(f"{type(block).__name__}.conv_1d is not the depthwise convolution burst knows")

        def forward(x, conv=conv, block=block):
            cache = running_cache()
            running = running_on(shards, block, cache)
            if running is not None and running.length is not None:  # a ShardedCache's prompt: its state for decoding
                block.conv1d_state = cache.prompt_tail(x, conv.kernel_size[0] - 1)
            return causal_conv(_causal_depthwise, running or shards, x, conv.weight[:, 0, :], conv.bias)

        conv.forward = forward


class TokenShift(torch.nn.Module):
    """RWKV's time shift (each token sees the one before it: ZeroPad2d((0, 0, 1, -1)) on (B, T, C)),
    with each chunk's first token seeing the last token of the chunk before it, wherever it is."""

    def __init__(self, shards: Shards):
        super().__init__()
        self.shards = shards

    def forward(self, hidden):
        if self.shards.world == 1:
            return F.pad(hidden, (0, 0, 1, -1))
        mine = local_chunks(self.shards, hidden.shape[1])
        tails = [hidden[:, seg.rows][:, -1:] for seg in mine]
        halos = state_passing.halo(
            tails, 1, self.shards.layout, self.shards.group, hidden.shape[1], phase="token_shift", dim=1
        )
        return torch.cat(
            [torch.cat([halo, hidden[:, seg.rows][:, :-1]], dim=1) for seg, halo in zip(mine, halos)], dim=1
        )


def shard_token_shifts(model: torch.nn.Module, shards: Shards) -> None:
    """Replace each RWKV-style `time_shift` (a ZeroPad2d shifting one token) with a TokenShift."""
    for module in model.modules():
        shift = getattr(module, "time_shift", None)
        if isinstance(shift, TokenShift) or (
            isinstance(shift, torch.nn.ZeroPad2d) and tuple(shift.padding) == (0, 0, 1, -1)
        ):
            module.time_shift = TokenShift(shards)


class _Halo:
    """The cache a ZAYA CCA projection reads the tokens before its chunk from (in generation, the
    cached ones): the pre-convolution q/k states of the last `conv_kernel_size` tokens, and the delayed
    value projection of the last token (None before the sequence's first token: the layer makes its own)."""

    def __init__(self, qk: torch.Tensor, value: torch.Tensor | None):
        self.qk, self.value, self.read = qk, value, False

    def get_conv_state(self, layer_idx, state_idx=0):
        self.read = True
        return self.qk

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.value

    def update_conv_state(self, *args, **kwargs):
        pass

    def update_recurrent_state(self, *args, **kwargs):
        pass


def cca_projection(module, forward, shards: Shards, hidden_states, cache=None, conv_mask=None, **kwargs):
    """ZAYA's CCA q/k/v projection; hidden_states (B, T, D). Queries and keys are a causal convolution
    (kernel conv_kernel_size + 1) of their projections, and half of each value head is the previous
    token's delayed projection: each chunk gets its halo, the q/k projections of the conv_kernel_size
    tokens before it and the delayed value projection of the one before it, in one all-gather, and the
    layer runs on the chunk with the halo handed in as its cache."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    running = running_on(shards, module, cache)
    if runs_whole(running):
        return forward(hidden_states, cache, conv_mask, **kwargs)
    if conv_mask is not None:  # burst's mask interface refuses padding first; this is the backstop
        raise ValueError(
            f"{type(module).__name__}: a padding mask with the sequence split across {shards.world} "
            "ranks is not supported; pack documents or pad at the end with labels -100"
        )
    width = module.conv_kernel_size
    mine = local_chunks(running, hidden_states.shape[1])

    def tail(seg):  # the last max(width, 1) tokens' q/k projections (B, C_qk, t) and delayed values (B, C_v, t)
        last = hidden_states[:, seg.rows][:, -max(width, 1) :]
        qk = torch.cat([module.q_proj(last), module.k_proj(last)], dim=-1)
        return torch.cat([qk, module.v_proj_delayed(last)], dim=-1).transpose(1, 2)

    halos = state_passing.halo(
        [tail(seg) for seg in mine],
        max(width, 1),
        running.layout,
        running.group,
        hidden_states.shape[1],
        phase="cca_halo",
    )
    qk_channels = module.q_proj.out_features + module.k_proj.out_features
    outs = []
    for seg, halo in zip(mine, halos):
        given = _Halo(
            halo[:, :qk_channels, halo.shape[-1] - width :], None if seg.first == 0 else halo[:, qk_channels:, -1]
        )
        outs.append(forward(hidden_states[:, seg.rows], given, None, **kwargs))
        if not given.read:  # the layer ran as if the chunk began the sequence: wrong, so loud
            raise RuntimeError(
                f"{type(module).__name__} did not read the halo burst handed it; this transformers "
                "release arranges the layer differently from what burst knows"
            )
    if cache is not None:  # a ShardedCache's prompt: the last tokens' q/k projections, the last delayed value
        keep_cca_states(module, cache, hidden_states)
    return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))


def keep_cca_states(module, cache, hidden_states) -> None:
    """What a ZAYA CCA layer keeps for decoding after a prompt split across ranks, as one process's does: the
    q/k projections of the prompt's last conv_kernel_size tokens (its convolution state) and the delayed value
    projection of its last one (its recurrent state), each from the rank that holds it (the cache's prompt_tail).
    hidden_states: (B, T, D), this rank's shard (the projections of it all: a prefill's one more q/k)."""
    qk = torch.cat([module.q_proj(hidden_states), module.k_proj(hidden_states)], dim=-1).transpose(1, 2)
    cache.update_conv_state(qk, module.layer_idx, conv_kernel_size=module.conv_kernel_size)
    delayed = cache.prompt_tail(module.v_proj_delayed(hidden_states).transpose(1, 2), 1)[..., 0]
    cache.update_recurrent_state(delayed, module.layer_idx)
