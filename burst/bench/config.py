"""`burst bench`'s settings (BenchConfig): the workload, its masks (window, documents, block-sparse
layout, each drawn from the seed), the world and the devices; bench/harness.py runs them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from burst.devices import local_ranks, resolve_device
from burst.layout import DOCUMENT_LAYOUTS, resolve_layout
from burst.masks import BlockSparseMask


@dataclass
class BenchConfig:
    seq_len: int = 4096  # global tokens
    heads: int = 8
    kv_heads: int | None = None  # default: heads (MHA)
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    causal: bool = False
    layout: str = "contiguous"
    nproc: int = 2
    threads: int | None = None  # per rank; default: cores // nproc
    repeats: int = 2
    strategies: list[str] = field(default_factory=lambda: ["burst", "ring", "allgather"])
    baseline: bool = True
    check_rows: int = 64  # query rows per rank checked against float64 attention
    seed: int = 0
    window: tuple[int, int] | None = None  # sliding window (left, right), -1 = unbounded
    documents: int = 0  # > 0: pack this many documents of uneven (seeded) lengths
    block_sparse: tuple[int, float] | None = None  # (block size, density): seeded random block layout
    ranks_per_node: int | None = None  # a burst.Topology: this many ranks per (emulated) node
    inter_node_gbps: float | None = None  # emulated inter-node bandwidth (comm/emulation.py)
    intra_node_gbps: float | None = None  # emulated intra-node bandwidth
    device: str = "auto"  # auto | cpu | cuda (burst/devices.py)

    def resolved_device(self) -> str:
        """cpu or cuda for this machine's ranks (auto: cuda when every local rank has a GPU)."""
        return resolve_device(self.device, local_ranks(self.nproc))

    def block_mask(self) -> BlockSparseMask | None:
        """A random block layout of the given density with the diagonal kept (seeded)."""
        if not self.block_sparse:
            return None
        size, density = self.block_sparse
        nb = -(-self.seq_len // int(size))
        g = torch.Generator().manual_seed(self.seed + 2)
        layout = (torch.rand(nb, nb, generator=g) < density) | torch.eye(nb, dtype=torch.bool)
        return BlockSparseMask(int(size), layout)

    def cu_seqlens(self) -> list[int] | None:
        """Document boundaries: `documents` uneven lengths drawn from the seed, summing to seq_len
        (under a per-document layout each a multiple of the parts it is cut into)."""
        if self.documents <= 0:
            return None
        unit = self.nproc * (2 if self.layout == "doc_zigzag" else 1) if self.layout in DOCUMENT_LAYOUTS else 1
        g = torch.Generator().manual_seed(self.seed + 1)
        cuts = torch.randperm(self.seq_len // unit - 1, generator=g)[: self.documents - 1] + 1
        return [0, *sorted(int(c) * unit for c in cuts), self.seq_len]

    def resolved_layout(self):
        """The layout shard_indices takes: a DocumentLayout for doc_contiguous / doc_zigzag."""
        return resolve_layout(self.layout, self.cu_seqlens())

    def mask_kwargs(self) -> dict:
        return {
            "causal": self.causal,
            "window": tuple(self.window) if self.window else None,
            "cu_seqlens": self.cu_seqlens(),
            "block_sparse": self.block_mask(),
        }

    def resolved_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.nproc)
