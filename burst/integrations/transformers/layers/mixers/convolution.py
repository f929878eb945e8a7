"""Short causal convolutions and token shifts across ranks: each chunk gets the inputs before it (its
halo) from whichever rank holds them, in one all-gather (state_passing.halo).

`causal_conv1d_fn` (the hybrids' short convolutions) is wrapped in the modeling module;
RecurrentGemma's temporal convolution is an nn.Conv1d module whose forward is replaced
(shard_convolution_modules); RWKV's time shift (each token mixes in the one before) is a ZeroPad2d
module replaced by a TokenShift (shard_token_shifts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from burst import state_passing

from .state import Shards, local_chunks


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
    outs = [original(torch.cat([halo, hidden_states[..., seg.rows]], dim=-1), weight, bias, *args, **kwargs)
            [..., width:] for seg, halo in zip(mine, halos)]
    return torch.cat(outs, dim=-1)


def _causal_depthwise(x, weight, bias):
    """x (B, C, T) through a depthwise convolution of weight (C, k), the k - 1 inputs before each
    output taken from x itself: causal_conv1d_fn's arithmetic, for causal_conv."""
    return F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight[:, None, :], bias, groups=x.shape[1])


def shard_convolution_modules(model: torch.nn.Module, shards: Shards) -> None:
    """RecurrentGemma's temporal convolution is an nn.Conv1d module (depthwise, padded k - 1 on both
    sides, the caller keeps the first T outputs): its forward becomes causal_conv's, each chunk with its halo."""
    for block in model.modules():
        conv = getattr(block, "conv_1d", None)
        if type(block).__name__ != "RecurrentGemmaRecurrentBlock" or not isinstance(conv, torch.nn.Conv1d):
            continue
        if conv.groups != conv.in_channels or conv.padding != (conv.kernel_size[0] - 1,):
            raise ValueError(f"{type(block).__name__}.conv_1d is not the depthwise convolution burst knows")

        def forward(x, conv=conv):
            return causal_conv(_causal_depthwise, shards, x, conv.weight[:, 0, :], conv.bias)

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
        halos = state_passing.halo(tails, 1, self.shards.layout, self.shards.group, hidden.shape[1],
                                   phase="token_shift", dim=1)
        return torch.cat([torch.cat([halo, hidden[:, seg.rows][:, :-1]], dim=1) for seg, halo in zip(mine, halos)],
                         dim=1)


def shard_token_shifts(model: torch.nn.Module, shards: Shards) -> None:
    """Replace each RWKV-style `time_shift` (a ZeroPad2d shifting one token) with a TokenShift."""
    for module in model.modules():
        shift = getattr(module, "time_shift", None)
        if isinstance(shift, TokenShift) or (isinstance(shift, torch.nn.ZeroPad2d) and
                                             tuple(shift.padding) == (0, 0, 1, -1)):
            module.time_shift = TokenShift(shards)
