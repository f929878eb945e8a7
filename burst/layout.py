"""How the global sequence is split across the ranks of a group, and shard / unshard.

Global token indices held by rank r of G, in local order (DESIGN.md):
- contiguous: chunk r of G equal chunks.
- zigzag:     chunks r and 2G-1-r of 2G equal chunks (burstengine.md eq. 11): balances causal work.
- striped:    tokens r, r+G, r+2G, ... (burstengine.md eq. 13): balances causal work token by token.

A rank's shard is described as a list of `Segment`s, arithmetic runs of global positions, so that
mask planning (masks.py) can reason about whole runs instead of token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .agreement import agree

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Segment:
    """Local rows [local_start, local_start + length) hold global tokens first, first + stride, ..."""

    local_start: int
    length: int
    first: int
    stride: int = 1

    @property
    def last(self) -> int:
        return self.first + self.stride * (self.length - 1)

    @property
    def rows(self) -> slice:
        return slice(self.local_start, self.local_start + self.length)

    def positions(self, device=None) -> torch.Tensor:
        return self.first + self.stride * torch.arange(self.length, device=device)

    def sub(self, start: int, stop: int) -> "Segment":
        """Rows [start, stop) of this segment, as a segment."""
        return Segment(self.local_start + start, stop - start, self.first + self.stride * start, self.stride)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def local_multiple(layout: str) -> int:
    """The local shard length must be a multiple of this (zigzag holds two equal chunks)."""
    return 2 if layout == "zigzag" else 1


def segments(layout: str, rank: int, world: int, local_len: int) -> list[Segment]:
    """The runs of global positions held by `rank` when each rank holds `local_len` tokens."""
    check_layout(layout)
    if layout == "contiguous":
        return [Segment(0, local_len, rank * local_len)]
    if layout == "zigzag":
        half = local_len // 2
        return [Segment(0, half, rank * half), Segment(half, half, (2 * world - 1 - rank) * half)]
    return [Segment(0, local_len, rank, world)]


def shard_indices(layout: str, rank: int, world: int, seq_len: int, device=None) -> torch.Tensor:
    """Global token indices held by `rank`, in local order: (seq_len // world,) int64."""
    _check_divisible(layout, world, seq_len)
    segs = segments(layout, rank, world, seq_len // world)
    return torch.cat([s.positions(device) for s in segs])


def _check_divisible(layout: str, world: int, seq_len: int) -> None:
    need = world * local_multiple(layout)
    if seq_len % need:
        raise ValueError(
            f"sequence length {seq_len} must be divisible by {need} for layout={layout!r} on {world} ranks"
        )


def _world_and_rank(group):
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _agree_on_layout(entry: str, x, group, layout: str, dim: int, facts) -> tuple[int, int, int]:
    """Check locally, then that every rank of `group` agrees; returns (world, rank, dim >= 0)."""
    world, rank = _world_and_rank(group)
    problem = None
    try:
        check_layout(layout)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{entry} needs a torch.Tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
        dim = dim % x.dim()
    except (TypeError, ValueError) as err:
        problem = err
    agree(entry, facts(dim) if problem is None else None, problem, group, world)
    return world, rank, dim


def shard(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim`.

    Every rank must pass the same layout and a tensor of the same length along `dim`: one small
    collective checks that (see burst.agreement), so a rank that differs raises on every rank
    instead of holding tokens the others think it does not.
    """
    world, rank, dim = _agree_on_layout(
        "burst.shard", x, group, layout, dim,
        lambda d: {"layout": layout, "dim": d, "length": x.shape[d], "ndim": x.dim()})
    idx = shard_indices(layout, rank, world, x.shape[dim], device=x.device)
    return x.index_select(dim, idx)


def unshard(x_local: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard along `dim` (an all-gather; every rank gets it all).

    Every rank must pass the same layout and shards of one shape and dtype (checked first).
    """
    world, rank, dim = _agree_on_layout(
        "burst.unshard", x_local, group, layout, dim,
        lambda d: {"layout": layout, "dim": d, "shape": tuple(x_local.shape), "dtype": str(x_local.dtype)})
    if world == 1:
        return x_local
    parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    gathered = torch.cat(parts, dim=dim)
    seq_len = gathered.shape[dim]
    order = torch.cat([shard_indices(layout, r, world, seq_len, device=x_local.device) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, device=order.device)
    return gathered.index_select(dim, inverse)
