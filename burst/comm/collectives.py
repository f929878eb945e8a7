"""Flat collectives under the names of whichever PyTorch is installed.

PyTorch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; we support >= 2.4.
Both gather or scatter along dim 0 of a contiguous tensor.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
