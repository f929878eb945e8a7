"""How the global sequence is split across the ranks of a group, and shard / unshard.

Global token indices held by rank r of G, in local order (DESIGN.md):
- contiguous: chunk r of G equal chunks.
- zigzag:     chunks r and 2G-1-r of 2G equal chunks (burstengine.md eq. 11): balances causal work.
- striped:    tokens r, r+G, r+2G, ... (burstengine.md eq. 13): balances causal work token by token.

Per document (packed sequences, the peers' convention: ring-flash-attention's varlen functions,
TransformerEngine's and Megatron's THD format): a `DocumentLayout(cu_seqlens, split)` cuts each
document on its own, "contiguous" into G equal parts (rank r holds part r of every document) or
"zigzag" into 2G parts (parts r and 2G-1-r), so every document's causal triangle is split evenly
whatever the document lengths. Each document's length must be a multiple of G (or 2G). Strings
"doc_contiguous" / "doc_zigzag" name them where the documents come separately (cu_seqlens=).

A rank's shard is described as a list of `Segment`s, arithmetic runs of global positions, so that
mask planning (masks.py) can reason about whole runs instead of token by token.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .agreement import agree
from .comm.membership import group_rank, group_size

LAYOUTS = ("contiguous", "zigzag", "striped")
DOCUMENT_SPLITS = ("contiguous", "zigzag")
DOCUMENT_LAYOUTS = tuple(f"doc_{split}" for split in DOCUMENT_SPLITS)


@dataclass(frozen=True)
class Rows:
    """Local rows [local_start, local_start + length) of a shard. As itself, rows that are not one run of
    positions: the side of a tile joined across two runs (masks.TileSizes.join_runs), with no positions
    on purpose, so that nothing that needs them (a mask, an index selection) can read wrong ones."""

    local_start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.local_start, self.local_start + self.length)


@dataclass(frozen=True)
class Segment(Rows):
    """Local rows [local_start, local_start + length) hold global tokens first, first + stride, ..."""

    first: int
    stride: int = 1

    @property
    def last(self) -> int:
        return self.first + self.stride * (self.length - 1)

    def positions(self, device=None) -> torch.Tensor:
        return self.first + self.stride * torch.arange(self.length, device=device)

    def sub(self, start: int, stop: int) -> "Segment":
        """Rows [start, stop) of this segment, as a segment."""
        return Segment(self.local_start + start, stop - start, self.first + self.stride * start, self.stride)


@dataclass(frozen=True)
class DocumentLayout:
    """Packed documents, each cut across the ranks on its own (see the module docstring).

    cu_seqlens: (ndocs + 1,) global offsets from 0 to the packed length. split: "contiguous" (each
    document in G equal parts) or "zigzag" (2G parts, rank r holding parts r and 2G-1-r). As
    burst.attention's layout, its documents are the call's document mask too (cu_seqlens= may be left out).
    """

    cu_seqlens: tuple[int, ...]
    split: str = "zigzag"

    def __post_init__(self):
        if self.split not in DOCUMENT_SPLITS:
            raise ValueError(f"DocumentLayout split must be one of {DOCUMENT_SPLITS}, got {self.split!r}")
        cu = tuple(listed_documents(self.cu_seqlens))
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"DocumentLayout cu_seqlens must rise strictly from 0 (one entry per document "
                f"boundary), got {list(cu)[:6]}"
            )
        object.__setattr__(self, "cu_seqlens", cu)

    @property
    def parts(self) -> int:
        """Parts per document and rank: 1 (contiguous) or 2 (zigzag)."""
        return 2 if self.split == "zigzag" else 1

    def check(self, world: int, seq_len: int) -> None:
        """Raise ValueError unless these documents cover seq_len tokens and each cuts into its parts."""
        if self.cu_seqlens[-1] != seq_len:
            raise ValueError(
                f"the documents (cu_seqlens ending {self.cu_seqlens[-1]}) must cover the global "
                f"sequence of {seq_len} tokens"
            )
        need = world * self.parts
        bad = [(i, b - a) for i, (a, b) in enumerate(zip(self.cu_seqlens, self.cu_seqlens[1:])) if (b - a) % need]
        if bad:
            i, n = bad[0]
            raise ValueError(
                f"layout doc_{self.split} on {world} ranks cuts every document into {need} equal parts: document {i} "
                f"has {n} tokens ({len(bad)} documents are not multiples of {need}); pad each document to a "
                f"multiple of {need} (as TransformerEngine requires), or use a layout over the whole sequence"
            )

    def segments(self, rank: int, world: int) -> list[Segment]:
        out, at = [], 0
        for start, stop in zip(self.cu_seqlens, self.cu_seqlens[1:]):
            part = (stop - start) // (world * self.parts)
            chosen = (rank,) if self.parts == 1 else (rank, 2 * world - 1 - rank)
            for index in chosen:
                out.append(Segment(at, part, start + index * part))
                at += part
        return out


def is_int(x) -> bool:
    """An int, numpy's included; not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def listed_documents(cu_seqlens) -> list[int] | None:
    """cu_seqlens as a list of ints, from a 1-D integer tensor or a sequence of ints (numpy's too): how
    every entry point reads it (burst.attention, shard, unshard, DocumentLayout). Floats and bools are
    refused, not rounded."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, DocumentLayout):
        raise ValueError("cu_seqlens got a DocumentLayout: pass it as layout= (its documents are the mask too)")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise ValueError("cu_seqlens must be a 1-D integer tensor or a sequence of ints")
        return cu_seqlens.tolist()
    try:
        values = list(cu_seqlens)
    except TypeError:
        values = []
    if not values or not all(is_int(x) for x in values):
        raise ValueError(f"cu_seqlens must be a non-empty 1-D sequence of ints, got {cu_seqlens!r}")
    return [int(x) for x in values]


def resolve_layout(layout, cu_seqlens=None, world: int = 1, local_len: int | None = None):
    """`layout` as the layouts below take it: a name of LAYOUTS, or a DocumentLayout; "doc_contiguous"
    and "doc_zigzag" become one from cu_seqlens, given over the global sequence or in the peers'
    local form (each rank's own offsets, ending at local_len: every document is cut alike, so the
    global offsets are G times the local ones)."""
    if isinstance(layout, DocumentLayout) or layout not in DOCUMENT_LAYOUTS:
        return layout
    if cu_seqlens is None:
        raise ValueError(f"layout={layout!r} cuts each packed document on its own: pass the documents' cu_seqlens")
    cu = listed_documents(cu_seqlens)
    if world > 1 and local_len is not None and cu and cu[-1] == local_len:
        cu = [x * world for x in cu]  # the local form
    return DocumentLayout(tuple(cu), layout.removeprefix("doc_"))


def check_layout(layout) -> None:
    if isinstance(layout, DocumentLayout):
        return
    if layout in DOCUMENT_LAYOUTS:
        raise ValueError(
            f"layout={layout!r} needs the documents: pass burst.DocumentLayout(cu_seqlens, "
            f"{layout.removeprefix('doc_')!r}) (or cu_seqlens= to burst.attention)"
        )
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {LAYOUTS + DOCUMENT_LAYOUTS} or a burst.DocumentLayout, got {layout!r}"
        )


def local_multiple(layout) -> int:
    """The local shard length must be a multiple of this (zigzag holds two equal chunks; a
    DocumentLayout checks its documents instead: DocumentLayout.check)."""
    return 2 if layout == "zigzag" else 1


def segments(layout, rank: int, world: int, local_len: int) -> list[Segment]:
    """The runs of global positions held by `rank` when each rank holds `local_len` tokens."""
    check_layout(layout)
    if isinstance(layout, DocumentLayout):
        return layout.segments(rank, world)
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


def _check_divisible(layout, world: int, seq_len: int) -> None:
    if isinstance(layout, DocumentLayout):
        layout.check(world, seq_len)
        return
    need = world * local_multiple(layout)
    if seq_len % need:
        padded = -(-seq_len // need) * need
        raise ValueError(
            f"sequence length {seq_len} must be divisible by {need} for layout={layout!r} on {world} ranks: pad "
            f"the batch at the end to {padded} tokens. Under a causal mask no real token sees the padding (labels "
            "-100 there keep it out of the loss; SequenceParallelTrainer and generate() on a ShardedCache pad "
            f"themselves); without one every token would attend it: make it a document of its own (append "
            f"{padded} to your cu_seqlens; one sequence: cu_seqlens=[0, {seq_len}, {padded}])"
        )


def _world_and_rank(group):
    return group_size(group), group_rank(group)


def _agree_on_layout(entry: str, x, group, dim: int, resolve, facts) -> tuple[int, int, int, object]:
    """Check locally, then that every rank of `group` agrees; returns (world, rank, dim >= 0, layout).
    resolve(world, length along dim) -> the layout (resolve_layout): inside the checks, so a rank whose
    documents are wrong raises on every rank, not alone before the collective."""
    world, rank = _world_and_rank(group)
    problem, layout = None, None
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{entry} needs a torch.Tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
        dim = dim % x.dim()
        layout = resolve(world, x.shape[dim])
        check_layout(layout)
    except (TypeError, ValueError) as err:
        problem = err
    agree(entry, facts(dim, layout) if problem is None else None, problem, group, world)
    return world, rank, dim, layout


def shard(x: torch.Tensor, group=None, layout="contiguous", dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim`.

    layout: a name of LAYOUTS, a DocumentLayout, or "doc_contiguous" / "doc_zigzag" with the
    documents' global cu_seqlens. Every rank must pass the same layout and a tensor of the same
    length along `dim`: one small collective checks that (see burst.agreement), so a rank that
    differs raises on every rank instead of holding tokens the others think it does not.

    For tensors your own code feeds to burst.attention. Not for a transformers model's token ids:
    a model that never calls attention (Mamba), runs its own (GPT-1) or keeps state outside it
    would run each shard alone; models go through
    `burst.integrations.transformers.shard_batch(batch, ..., model=model)`, which checks the model.
    """
    world, rank, dim, layout = _agree_on_layout(
        "burst.shard",
        x,
        group,
        dim,
        lambda world, length: resolve_layout(layout, cu_seqlens),
        lambda d, resolved: {"layout": resolved, "dim": d, "length": x.shape[d], "ndim": x.dim()},
    )
    idx = shard_indices(layout, rank, world, x.shape[dim], device=x.device)
    out = x.index_select(dim, idx)
    if not torch.compiler.is_compiling():
        out._burst_layout = layout  # burst.attention refuses it under another layout (check_sharded_with)
    return out


def check_sharded_with(layout, **tensors) -> None:
    """ValueError for a tensor burst.shard cut by another layout than `layout` (its own result, as returned:
    a new tensor made from it, `.to()` or a projection, is not marked). Every rank makes the same call, so a
    mismatch is the same everywhere and nothing else would notice it: the numbers are silently wrong."""
    for name, t in tensors.items():
        cut = getattr(t, "_burst_layout", None)
        if cut is not None and cut != layout:
            raise ValueError(
                f"{name} was cut by burst.shard with layout={cut!r} and is attended with layout={layout!r}: "
                "pass burst.attention the layout its inputs were sharded with"
            )


class _Gathered(torch.autograd.Function):
    """Every rank's shard along `dim`, in rank order (an all-gather). The backward keeps this rank's
    rows of the gradient, with no communication: every rank is taken to compute the same from the
    full tensor, as one process would (DTensor's full_tensor() assumes as much), so its gradient of
    its own rows is the whole of theirs; a sum over ranks would count it world times."""

    @staticmethod
    def forward(ctx, x, dim: int, rank: int, world: int, group):
        ctx.dim, ctx.rows = dim, (rank * x.shape[dim], x.shape[dim])
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, *ctx.rows), None, None, None, None


def unshard(x_local: torch.Tensor, group=None, layout="contiguous", dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard along `dim` (an all-gather; every rank gets it all).

    layout and cu_seqlens as in shard (cu_seqlens global, or local). Every rank must pass the same
    layout and shards of one shape and dtype (checked first). Differentiable: the backward gives
    each rank the gradient of its own rows, as one process computing the same loss from the full
    tensor would (every rank must compute that same loss; nothing is summed over ranks).
    """
    world, rank, dim, layout = _agree_on_layout(
        "burst.unshard",
        x_local,
        group,
        dim,
        lambda world, length: resolve_layout(layout, cu_seqlens, world, length),
        lambda d, resolved: {"layout": resolved, "dim": d, "shape": tuple(x_local.shape), "dtype": str(x_local.dtype)},
    )
    if world == 1:
        return x_local
    gathered = _Gathered.apply(x_local, dim, rank, world, group)
    seq_len = gathered.shape[dim]
    order = torch.cat([shard_indices(layout, r, world, seq_len, device=x_local.device) for r in range(world)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, device=order.device)
    return gathered.index_select(dim, inverse)
