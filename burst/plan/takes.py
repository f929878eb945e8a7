"""Which calls a strategy takes, decided by burst.attention's own validation without a world.

    check_call(world=8, seq_len=1 << 20, heads=32, kv_heads=8, head_dim=128, strategy="distflash",
               layout="zigzag", causal=True)   # ValueError: distflash supports layout='contiguous' ...

The CLI checks its arguments with it before any process starts, and the planner marks the
strategies that would refuse the workload. The shards are zero-size stand-ins of the right shapes.
"""

from __future__ import annotations

import torch

from ..call import AttentionRequest
from ..comm.topology import Topology
from ..layout import DOCUMENT_LAYOUTS, check_layout, local_multiple
from ..validation import checked_call
from .auto import auto_choice


def check_split(seq_len: int, world: int, layout: str) -> None:
    """Raise ValueError unless `seq_len` tokens split evenly over `world` ranks in `layout`."""
    if layout in DOCUMENT_LAYOUTS:  # the documents come apart (cu_seqlens): the parts must split the length
        need = world * (2 if layout == "doc_zigzag" else 1)
    else:
        check_layout(layout)
        need = world * local_multiple(layout)
    if seq_len < 1 or seq_len % need:
        raise ValueError(
            f"{seq_len} tokens do not split over {world} ranks with layout {layout!r} "
            f"(use a positive multiple of {need})"
        )


def check_call(
    world: int,
    seq_len: int,
    heads: int,
    kv_heads: int | None,
    head_dim: int,
    strategy: str = "burst",
    layout: str = "contiguous",
    batch: int = 1,
    dtype: str = "float32",
    causal: bool = False,
    window=None,
    cu_seqlens=None,
    block_sparse=None,
    **options,
) -> str:
    """Raise ValueError (or TypeError) for a call burst.attention would refuse on `world` ranks
    sharing `seq_len` tokens; returns the strategy it would run ("auto" resolved)."""
    check_split(seq_len, world, layout)
    torch_dtype = getattr(torch, dtype)
    local = seq_len // world
    q = torch.empty((), dtype=torch_dtype).expand(batch, local, heads, head_dim)
    k = torch.empty((), dtype=torch_dtype).expand(batch, local, kv_heads or heads, head_dim)
    # A topology of one rank per node: without a process group the library sees a world of one,
    # so a real topology is checked apart (burst.Topology.check) against the real world.
    request = AttentionRequest(
        strategy=strategy,
        layout=layout,
        causal=causal,
        window=window,
        cu_seqlens=cu_seqlens,
        block_sparse=block_sparse,
        topology=Topology(local_world_size=1),
        options=options,
    )
    name, _ = checked_call(q, k, k, request, 0, world, auto=auto_choice)
    return name


def refusal(
    strategy: str,
    world: int,
    seq_len: int,
    heads: int,
    kv_heads: int | None,
    head_dim: int,
    layout: str,
    causal: bool,
    window: int | None = None,
) -> str | None:
    """Why burst.attention's `strategy` would refuse this workload (None when it takes it). window: the keys a
    causal query sees at most (the planner's; burst.attention's (window - 1, 0)). The sequence is rounded up to
    a length the layout splits: only the strategy's own limits count."""
    need = world * local_multiple(layout)
    even = -(-max(seq_len, 1) // need) * need
    bands = (window - 1, 0) if causal and window is not None else None
    try:
        check_call(
            world, even, heads, kv_heads, head_dim, strategy=strategy, layout=layout, causal=causal, window=bands
        )
    except (ValueError, TypeError) as err:
        return str(err)
    return None
