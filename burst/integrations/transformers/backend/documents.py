"""Packed documents on transformers' convention: position_ids restarting at 0 begin a document.

burst's attention takes documents as `cu_seqlens` over the global sequence. The attention function
finds them from the shard's position_ids (`documents`: gathered once per forward, checked to be
global positions in the registered layout's order), shard_batch from the whole batch's
(`documents_from_positions`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import weakref

import torch

from burst import layout as layout_mod
from burst.comm.membership import group_size
from burst.custom_op import run_eagerly

from ..layers.configs import decoder_of
from .registry import Backend


class _DocumentCache:
    """cu_seqlens of the last position_ids tensor seen: every layer of one forward passes the same
    tensor, so the gather runs once per forward (on every rank alike, as all ranks run the same model)."""

    def __init__(self):
        self.ref, self.version, self.value = None, None, None

    def get(self, position_ids):
        version = _version(position_ids)
        if version is not None and self.ref is not None and self.ref() is position_ids and self.version == version:
            return True, self.value
        return False, None

    def put(self, position_ids, value):
        self.ref, self.version, self.value = weakref.ref(position_ids), _version(position_ids), value


def _version(tensor) -> int | None:
    """The tensor's version counter, None for an inference tensor (torch.inference_mode), which keeps none:
    never cached then, since inside inference_mode it may still change in place."""
    return None if tensor.is_inference() else tensor._version


_document_cache = _DocumentCache()


@run_eagerly  # host-side checks and a collective: under torch.compile one call, not graph breaks at every .item()
def documents(position_ids, batch: int, local_len: int, backend: Backend):
    """burst's cu_seqlens from transformers' packing convention, on the global positions, or None.

    position_ids: (batch or 1, seq_local) at global positions in the layout's order (shard_batch).
    """
    if position_ids is None:
        raise ValueError(
            "burst's transformers backend needs position_ids at global positions: "
            "shard the batch with burst.integrations.transformers.shard_batch"
        )
    hit, value = _document_cache.get(position_ids)
    if hit:
        return value
    world = group_size(backend.group)
    local = position_ids.expand(batch, local_len).to(torch.long)
    if backend.layout in layout_mod.DOCUMENT_LAYOUTS:
        value = _documents_cut_per_document(local, world, backend)
    else:
        full = layout_mod.unshard(local.contiguous(), group=backend.group, layout=backend.layout, dim=1)
        value = documents_from_positions(full, world, backend.layout)
    _document_cache.put(position_ids, value)
    return value


def _documents_cut_per_document(local: torch.Tensor, world: int, backend: Backend) -> list[int]:
    """Global cu_seqlens when each document is cut on its own (doc_contiguous / doc_zigzag).

    Rank 0 holds the first part of every document, so its positions restart at 0 once per document,
    and it holds 1/G of each: document d has G times the tokens rank 0 holds of it. Every rank's
    positions are then checked against that layout (the model's own 0..n-1 would not pass).
    """
    gathered = layout_mod.unshard(local.contiguous(), group=backend.group, layout="contiguous", dim=1)
    n = local.shape[1]
    first = gathered[0, :n]
    starts = (first == 0).nonzero().flatten().tolist()
    cu = [0]
    for start, stop in zip(starts, starts[1:] + [n]):
        cu.append(cu[-1] + (stop - start) * world)
    split = backend.layout.removeprefix("doc_")
    expected = None
    if starts[:1] == [0] and cu[-1] == n * world:
        try:
            doc_layout = layout_mod.DocumentLayout(tuple(cu), split)
            doc_layout.check(world, cu[-1])
            expected = _positions_in_documents(doc_layout, world, n)
        except ValueError:
            expected = None
    if expected is None or not bool((gathered == expected).all()):
        raise ValueError(
            f"position_ids are not global positions in layout={backend.layout!r} order: each document's positions "
            "must restart at 0 and rise by 1, cut per document. Shard the batch with "
            f"burst.integrations.transformers.shard_batch(batch, layout={backend.layout!r})"
        )
    return cu


def _positions_in_documents(doc_layout, world: int, n: int) -> torch.Tensor:
    """(world * n,) every rank's tokens' positions inside their documents, rank after rank."""
    starts = torch.tensor(doc_layout.cu_seqlens[:-1])
    out = []
    for r in range(world):
        g = torch.cat([seg.positions() for seg in layout_mod.segments(doc_layout, r, world, n)])
        out.append(g - starts[torch.bucketize(g, starts, right=True) - 1])
    return torch.cat(out)


def documents_from_positions(
    positions: torch.Tensor, world: int, layout: str, before_sharding: bool = False
) -> list[int] | None:
    """cu_seqlens over the global sequence from position ids (batch, seq_len) in global order:
    a document starts where the position restarts at 0. None for one plain sequence per row.

    Raises ValueError for positions that are not global positions (the model's default arange of a
    local shard, a batch sharded in another layout, or, `before_sharding`, the positions shard_batch
    was given: an offset) and for rows packed differently.
    """
    batch, seq_len = positions.shape
    starts_row = positions[:, 1:] != positions[:, :-1] + 1
    # Each rank's own 0..n-1 (what the model makes when no position_ids are passed) would read as
    # world documents under the contiguous layout: refuse it rather than cut the sequence silently.
    own_aranges = world > 1 and bool((positions == _rank_local_aranges(world, layout, seq_len)).all())
    if own_aranges or bool((positions[:, 0] != 0).any()) or bool((positions[:, 1:][starts_row] != 0).any()):
        if before_sharding:  # the user's own positions: shard_batch's advice would be no help
            raise ValueError(
                f"shard_batch: position_ids starting at {positions[:, 0].tolist()} are not a whole sequence's: every "
                "run must start at 0 (a new document) and rise by 1; burst runs sequences from their start (a "
                "continuation of a longer one, at an offset, is not supported across ranks)"
            )
        hint = " (they are each rank's own 0..n-1: the model made them because none were passed)" if own_aranges else ""
        raise ValueError(
            f"position_ids are not global positions in layout={layout!r} order{hint}: every run must start "
            "at 0 (a new document) and rise by 1. Shard the batch with "
            f"burst.integrations.transformers.shard_batch(batch, layout={layout!r})"
        )
    if not bool((starts_row == starts_row[:1]).all()):
        raise ValueError(
            "packed rows must share their document boundaries (burst's cu_seqlens applies to "
            "every row); pack into batch 1, or make the rows' documents line up"
        )
    starts = (torch.nonzero(starts_row[0]).flatten() + 1).tolist()
    if not starts:
        return None
    return [0, *starts, seq_len]


def _rank_local_aranges(world: int, layout: str, seq_len: int) -> torch.Tensor:
    """The global-order positions seen when every rank passes arange(seq_len // world)."""
    local = seq_len // world
    full = torch.empty(seq_len, dtype=torch.long)
    for r in range(world):
        full[layout_mod.shard_indices(layout, r, world, seq_len)] = torch.arange(local)
    return full


# transformers' mask builders, which find packed documents in the position_ids they are given
_MASK_BUILDERS = frozenset(
    {
        "create_causal_mask",
        "create_sliding_window_causal_mask",
        "create_chunked_causal_mask",
        "create_masks_for_generate",
    }
)


def masks_read_positions(model) -> bool:
    """Whether the model's decoder hands position_ids to transformers' mask builders, so that its eager
    and sdpa attention keep packed documents apart (without a cache). Some families build their masks
    without them (GPT-OSS, AFMoE, OPT, BioGPT, GraniteMoeHybrid in transformers 5.24): there every
    document of a packed row attends to the ones before it. True when the source cannot be read."""
    return _forward_reads_positions(type(decoder_of(model)))


@functools.lru_cache(maxsize=None)
def _forward_reads_positions(decoder_class) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(decoder_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    dicts = {  # name = {"key": ...}: the mask keywords some families gather first (mask_kwargs)
        node.targets[0].id: {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Dict)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
    }
    builds = False
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _called_name(node.func) in _MASK_BUILDERS):
            continue
        builds = True
        keywords = {k.arg for k in node.keywords if k.arg is not None}
        for k in node.keywords:
            if k.arg is None and isinstance(k.value, ast.Name):
                keywords |= dicts.get(k.value.id, set())
        if "position_ids" in keywords:
            return True
    return not builds


def _called_name(func) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
