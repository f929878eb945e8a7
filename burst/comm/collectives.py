"""Flat collectives under the names of whichever PyTorch is installed.

PyTorch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; we support >= 2.4.
Both gather or scatter along dim 0 of a contiguous tensor.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_in_place(tensors, group=None, divide_by: float = 1) -> None:
    """Sum `tensors` (one dtype) over `group` with one all-reduce of their flattened copy, then
    divide by `divide_by`; each tensor is overwritten with its result (gradients once per step)."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(reduced)


def record_to_peers(phase: str, nbytes: int, group, topology=None, posted: float | None = None) -> None:
    """Count `nbytes` sent to every other rank of `group` (a collective's share), by link; with
    emulated slow links (comm/emulation.py) and the time `posted` the collective started, wait as
    long as those links would have taken."""
    from . import emulation
    from .stats import active, record_sent
    from .topology import link_between

    emulate = posted is not None and emulation.active()
    if not (active() or emulate) or not dist.is_initialized():
        return
    me = dist.get_rank(group)
    deadline = 0.0
    for peer in range(dist.get_world_size(group)):
        if peer != me:
            link = link_between(topology, group, peer)
            record_sent(phase, nbytes, link=link)
            if emulate:  # as much comes in as goes out in these collectives
                deadline = max(
                    deadline,
                    emulation.reserve(link, nbytes, posted, "out"),
                    emulation.reserve(link, nbytes, posted, "in"),
                )
    if deadline:
        emulation.wait_until(deadline)


def all_to_all_blocks(blocks, group, phase: str, topology=None):
    """Send blocks[r] to rank r and return what every rank sent here, stacked in rank order.

    blocks: (world, ...) with one block per destination (made contiguous). Counted in CommStats as
    the (world - 1) blocks that leave this rank, by link under `topology`.
    """
    import torch

    from .stats import tensor_bytes

    blocks = blocks.contiguous()
    world = blocks.shape[0]
    if world == 1:
        return blocks
    received = torch.empty_like(blocks)
    posted = time.perf_counter()
    dist.all_to_all_single(received, blocks, group=group)
    record_to_peers(phase, tensor_bytes(blocks[0]), group, topology, posted)
    return received
