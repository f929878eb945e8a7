"""Flat collectives under the names of whichever PyTorch is installed.

PyTorch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; we support >= 2.4.
Both gather or scatter along dim 0 of a contiguous tensor.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_to_all_blocks(blocks, group, phase: str):
    """Send blocks[r] to rank r and return what every rank sent here, stacked in rank order.

    blocks: (world, ...) with one block per destination (made contiguous). Counted in CommStats as
    the (world - 1) blocks that leave this rank.
    """
    import torch

    from .stats import record_sent, tensor_bytes

    blocks = blocks.contiguous()
    world = blocks.shape[0]
    if world == 1:
        return blocks
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    record_sent(phase, (world - 1) * tensor_bytes(blocks[0]), messages=world - 1)
    return received
