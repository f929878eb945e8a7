"""Linear recurrences and short convolutions across ranks: LASP-2's state passing, and halos.

A sequence mixer of the form h_t = A_t h_{t-1} + u_t (Mamba's scans, lightning attention, the gated
delta rule) run on a shard from a zero state is wrong for every rank but the first. Its state after
a chunk is affine in the state before it: h_end = T(h_start) + S, where S is the chunk's final
state from zero and T its transition (a per-element decay, or a d_k x d_k matrix for the gated
delta rule). So each rank computes (S, T) for each of its chunks, one all-gather shares them (O(state)
bytes per rank and layer, whatever the sequence length: LASP-2, Sun et al. 2025), every rank scans
them in global token order to get the state each of its chunks starts from, and reruns its chunks
from those states. Gradients reach earlier ranks through the all-gather's backward.

A causal 1-D convolution of width k needs the k - 1 tokens before each chunk: `halo` gathers every
chunk's last k - 1 tokens (again one all-gather of O(k) tokens per rank).

Chunks are the runs of global positions a layout gives a rank (layout.segments): one for contiguous,
two for zigzag, one per document part for DocumentLayout. Striped layouts (every G-th token) have
no runs to pass a state along, so they are refused.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import layout as layout_mod
from .comm.collectives import all_gather_flat
from .comm.stats import active as stats_active
from .comm.stats import record_sent
from .strategies.base import refuse_double_backward


def chunks(layout, group, local_len: int) -> tuple[list[layout_mod.Segment], list[list[layout_mod.Segment]]]:
    """(this rank's chunks, every rank's chunks) for a shard of `local_len` tokens; ValueError for a
    layout whose runs are not consecutive tokens (striped)."""
    world, rank = layout_mod._world_and_rank(group)
    every = [layout_mod.segments(layout, r, world, local_len) for r in range(world)]
    if any(s.stride != 1 for segs in every for s in segs):
        raise ValueError(
            f"layout={layout!r} holds one token in {world} on each rank: a recurrent or "
            "convolutional layer has no run of consecutive tokens to pass its state along; "
            "use layout 'contiguous' or 'zigzag'"
        )
    return every[rank], every


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather of a flat tensor whose backward sums every rank's gradient for this rank's part."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, group, world: int, phase: str):
        ctx.group, ctx.world, ctx.numel, ctx.phase = group, world, flat.numel(), phase
        out = flat.new_empty(world * flat.numel())
        all_gather_flat(out, flat.contiguous(), group=group)
        if stats_active():
            record_sent(phase, flat.numel() * flat.element_size() * (world - 1), messages=world - 1)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward("a recurrent layer's state passing across ranks")
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        if stats_active():  # what a ring all-reduce sends: 2 (G - 1) / G of the tensor
            record_sent(
                ctx.phase,
                2 * grad.numel() * grad.element_size() * (ctx.world - 1) // ctx.world,
                messages=2 * (ctx.world - 1),
            )
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.numel : (rank + 1) * ctx.numel], None, None, None


def all_gather_tensors(
    tensors: Sequence[torch.Tensor], group, phase: str
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Every rank's `tensors` (same shapes and dtype on every rank), in one differentiable all-gather:
    (result, anchor), result[r][i] being rank r's tensors[i]. anchor is a zero that depends on the
    gathered tensor: add it to what this rank returns, so that its backward (a collective) runs on
    every rank even where nothing gathered is used (the first rank's chunks start from zero). One rank (a
    process group of one, or none at all): no collective."""
    world, _ = layout_mod._world_and_rank(group)
    if world == 1:
        return [list(tensors)], tensors[0].new_zeros(())
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = _AllGatherWithGrad.apply(flat, group, world, phase).view(world, -1)
    anchor = gathered[:, :0].sum()
    out = []
    for r in range(world):
        parts, at = [], 0
        for t in tensors:
            parts.append(gathered[r, at : at + t.numel()].view(t.shape))
            at += t.numel()
        out.append(parts)
    return out, anchor


def scan_states(
    finals: Sequence[torch.Tensor],
    transitions: Sequence[torch.Tensor],
    apply_transition: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    layout,
    group,
    local_len: int,
    phase: str = "state_passing",
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the state each of this rank's chunks starts from, in the global token order; the state after the
    sequence's last chunk, the same on every rank: what a cache keeps after a prompt split across ranks).

    finals[c]: the state after local chunk c when it starts from zero; transitions[c]: its transition,
    in whatever form `apply_transition(transition, state) -> state` takes (both with one shape on
    every rank). The starts are one state per local chunk (zeros for the sequence's first chunk)."""
    mine, every = chunks(layout, group, local_len)
    count = len(mine)
    gathered, anchor = all_gather_tensors(list(finals) + list(transitions), group, phase)
    order = sorted((seg.first, r, c) for r, segs in enumerate(every) for c, seg in enumerate(segs))
    _, rank = layout_mod._world_and_rank(group)
    state = torch.zeros_like(finals[0])
    starts: dict[int, torch.Tensor] = {}
    for _, r, c in order:
        if r == rank:
            starts[c] = state
        state = apply_transition(gathered[r][count + c], state) + gathered[r][c]
    return [starts[c] + anchor for c in range(count)], state + anchor


def halo(
    tails: Sequence[torch.Tensor], width: int, layout, group, local_len: int, phase: str = "halo", dim: int = -1
) -> list[torch.Tensor]:
    """The `width` tokens before each of this rank's chunks, from whichever ranks hold them.

    tails[c]: the last min(width, chunk length) tokens of local chunk c along `dim`, in any shape (the
    same on every rank; the convolutions pass (B, C, width), the compressors (B, width, C) with dim=1).
    A halo wider than a chunk is made of as many chunks before it as it spans (their tails are then
    the whole chunks), all in the same one all-gather. Returns one tensor per local chunk with `width`
    tokens along `dim`, zeros before the sequence's first token."""
    mine, every = chunks(layout, group, local_len)
    gathered, anchor = all_gather_tensors(tails, group, phase)
    ending_at = {seg.last: (seg, gathered[r][c]) for r, segs in enumerate(every) for c, seg in enumerate(segs)}
    return [_tokens_before(seg.first, width, ending_at, tails[c], dim) + anchor for c, seg in enumerate(mine)]


def _tokens_before(first: int, width: int, ending_at: dict, like: torch.Tensor, dim: int) -> torch.Tensor:
    """The `width` tokens before position `first`, walking back through the chunks' gathered tails."""
    pieces, need, end = [], width, first - 1
    while need > 0 and end in ending_at:
        seg, tail = ending_at[end]
        take = min(need, tail.shape[dim])
        pieces.insert(0, tail.narrow(dim, tail.shape[dim] - take, take))
        need, end = need - take, seg.first - 1  # a tail shorter than `need` is the whole chunk
    if need > 0:  # before the sequence's first token
        shape = list(like.shape)
        shape[dim] = need
        pieces.insert(0, like.new_zeros(shape))
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
