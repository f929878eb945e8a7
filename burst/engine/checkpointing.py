"""Activation checkpointing for the engine's decoder layers: one setting, four modes.

    none       keep every activation (fastest, most memory)
    full       keep each layer's input only; the backward re-runs the whole layer, attention's
               forward (and its ring) included (Chen et al.; HuggingFace's per-layer checkpoint)
    remat      DistFlashAttn §3.3, rematerialization-aware: keep each layer's input and its attention
               output (out, lse); the backward recomputes the projections and the MLP but never
               attention's forward, whose backward needs only q, k, v, out and lse
    selective  BurstEngine §3.2, sequence-level selective: like remat for the later part of the
               sequence (global positions >= split * seq_len), whose attention is the expensive one to
               recompute under a causal mask; the first part's attention output is not kept but
               recomputed (a prefix-only attention: cheap, early tokens attend few keys)

All four give the same gradients (tests/test_engine.py). Memory kept per layer and token, for
hidden size d and q heads x head_dim = d: none ~ everything; full d; remat 2d (+ lse); selective
d + (1 - split) d.

How remat and selective work: the layer runs under torch.utils.checkpoint (non-reentrant), which
drops every tensor autograd saves and, in the backward, recomputes the layer to rebuild them. The
layer's attention goes through `StoredAttention`: on the first run it computes attention and keeps
the chosen rows of (out, lse) outside autograd; on the recompute it replays them into the same
autograd node (strategies.base.ShardedAttentionFunction), so the recomputed graph needs no
attention forward and the stored rows are the only attention activation held between the passes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..api import attention, check_fixed_options
from ..call import AttentionRequest
from ..comm.membership import group_size
from ..keys import KeyBlocks
from ..layout import LAYOUTS, local_multiple, shard_indices
from ..masks import BlockSparseMask
from ..prepare import prepare_attention, prepare_single_device
from ..strategies.base import Strategy
from .offload import offloaded_checkpoint, to_host

MODES = ("none", "full", "remat", "selective")
# burst.attention's options given over the whole sequence's positions: the prefix is no sequence of its own then
WHOLE_SEQUENCE_OPTIONS = ("cu_seqlens", "block_sparse", "indices", "compressed")


def local_attention(q, k, v):
    """Single-device causal attention; q: (batch, seq, heads, head_dim), k, v: (batch, seq, kv_heads, head_dim)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)


def check_settings(mode: str, split: float, ffn_chunk: int, offload: bool = False, offload_layers: int = 0) -> None:
    """Raise ValueError for a checkpointing mode, selective split, blockwise-feedforward chunk or
    activation offload that does not exist (Transformer.set_checkpointing and `burst train` before it starts)."""
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")
    if isinstance(split, bool) or not isinstance(split, (int, float)):
        raise ValueError(f"checkpoint split must be a fraction in [0, 1], got {split!r}")
    if isinstance(ffn_chunk, bool) or not isinstance(ffn_chunk, int):
        raise ValueError(f"ffn chunk must be an int of tokens >= 0 (0: whole), got {ffn_chunk!r}")
    if offload and mode == "none":
        raise ValueError(
            "offloading activations moves what checkpointing keeps: needs a checkpointing mode "
            "(full, remat or selective), not none"
        )
    if isinstance(offload_layers, bool) or not isinstance(offload_layers, int) or offload_layers < 0:
        raise ValueError(f"offload layers must be an int >= 0 (0: every layer), got {offload_layers!r}")
    if offload_layers and not offload:
        raise ValueError("offload layers says how many layers' checkpoints go to the host: turn offloading on")
    if mode not in MODES:
        raise ValueError(f"checkpointing {mode!r}: one of {MODES}")
    if not 0.0 <= split <= 1.0:
        raise ValueError(f"checkpoint split {split} must lie in [0, 1]")
    if ffn_chunk < 0:
        raise ValueError(f"ffn chunk {ffn_chunk} must be >= 0")


class SequenceAttention:
    """The causal attention every layer calls: burst.attention over `group` (strategy, layout and
    options as given), or single-device attention when `world` is 1 (the reference model).

    attend(q, k, v) -> out; prepare(q, k, v) -> (Strategy, AttentionCall) for replaying a stored
    output; prefix(q, k, v, split) -> (out, lse) of the rows at global positions < split (others
    are garbage), without autograd.
    """

    def __init__(
        self, group=None, strategy: str = "burst", layout: str = "zigzag", world: int | None = None, **options
    ):
        import torch.distributed as dist

        why = "the engine's model is causal and takes attention's output alone"
        check_fixed_options("parallelize", strategy, options, ("q", "k", "v", "causal", "return_lse"), why)
        self.group, self.strategy, self.layout, self.options = group, strategy, layout, options
        if world is None:
            world = group_size(group)
        self.world = world
        self.rank = dist.get_rank(group) if world > 1 else 0
        # torch's SDPA on one device: the reference model, which has no option. With options (a window,
        # documents...) one rank runs burst.attention over its one-rank group, which applies them.
        self.single = world == 1 and not options

    def _kwargs(self, **extra):
        return {
            "group": self.group,
            "strategy": self.strategy,
            "layout": self.layout,
            "causal": True,
            **self.options,
            **extra,
        }

    def __call__(self, q, k, v):
        if self.single:
            return local_attention(q, k, v)
        return attention(q, k, v, **self._kwargs())

    def prepare(self, q, k, v):
        if self.single:
            return prepare_single_device(q, k, causal=True)
        return prepare_attention(q, KeyBlocks(k, v), AttentionRequest.of(**self._kwargs()))

    @torch.no_grad()
    def prefix(self, q, k, v, split: int):
        """(out, lse) for the rows at global positions < split (the other rows: zeros, or garbage).

        When the prefix's rows form a layout of the prefix on every rank (zigzag at split = half,
        striped), attention runs on those rows alone, so only the prefix's K/V travel; otherwise the
        whole shards run under a one-block BlockSparseMask, which computes no key past the prefix.
        Causal, the prefix's rows attend no key past it, so they are the whole call's rows: with a mask
        of the whole sequence (documents, a block-sparse layout) the call runs as it is, or under both
        masks, but never on the prefix's rows as a sequence of their own."""
        if self.single:
            prefix = (q[:, :split], k[:, :split], v[:, :split])
            strategy, call = self.prepare(*prefix)
            out, lse = strategy.forward(call, prefix[0], KeyBlocks(*prefix[1:]))
            return F.pad(out, (0, 0, 0, 0, 0, q.shape[1] - split)), F.pad(lse, (0, q.shape[1] - split))
        global_len = q.shape[1] * self.world
        sub_layout = prefix_layout(self.layout, self.world, global_len, split)
        whole_sequence_mask = any(self.options.get(name) is not None for name in WHOLE_SEQUENCE_OPTIONS)
        rows = None
        if sub_layout is not None and not whole_sequence_mask:  # the prefix's rows are a layout of the prefix
            rows = shard_indices(self.layout, self.rank, self.world, global_len) < split
            tensors, kwargs = (q[:, rows], k[:, rows], v[:, rows]), self._kwargs(layout=sub_layout)
        elif self.options.get("block_sparse") is not None:  # the user's block mask stands: no key skipped
            tensors, kwargs = (q, k, v), self._kwargs()
        else:
            blocks = -(-global_len // split)
            only_prefix = torch.zeros(blocks, blocks, dtype=torch.bool)
            only_prefix[0, 0] = True
            tensors, kwargs = (q, k, v), self._kwargs(block_sparse=BlockSparseMask(split, only_prefix))
        if self.strategy == "distflash" and (kwargs["layout"] != "contiguous" or "block_sparse" in kwargs):
            kwargs["strategy"] = "burst"  # distflash takes contiguous causal only; burst takes any
        out, lse = attention(*tensors, return_lse=True, **kwargs)
        if rows is None:
            return out, lse
        full_out, full_lse = q.new_zeros(q.shape), lse.new_zeros((q.shape[0], q.shape[2], q.shape[1]))
        full_out[:, rows], full_lse[:, :, rows] = out, lse
        return full_out, full_lse


@functools.lru_cache(maxsize=64)  # asked by every layer of every backward with the same numbers
def prefix_layout(layout: str, world: int, global_len: int, split: int) -> str | None:
    """The layout in which every rank's tokens at global positions < split (in local order) are the
    rank's shard of those `split` tokens (zigzag cut in half: contiguous; striped: striped), or None.
    Computed for every rank from shared facts, so all ranks take the same path."""
    if split == 0:
        return None
    for candidate in LAYOUTS:
        if split % (world * local_multiple(candidate)):
            continue
        if all(
            torch.equal(mine[mine < split], shard_indices(candidate, r, world, split))
            for r in range(world)
            for mine in (shard_indices(layout, r, world, global_len),)
        ):
            return candidate
    return None


class StoredAttention:
    """One layer call's attention output (out, lse), kept across a checkpointed forward for the
    rows in `keep` (bool, (seq_local,)); None keeps every row (remat)."""

    def __init__(self, attend: SequenceAttention, keep: torch.Tensor | None, split: int, offload: bool = False):
        self.attend, self.keep, self.split, self.offload = attend, keep, split, offload
        self.strategy = self.call = self.out = self.lse = None

    def __call__(self, q, k, v):
        if self.call is None:  # the forward: compute, keep the chosen rows
            self.strategy, self.call = self.attend.prepare(q, k, v)
            out, lse = self.strategy(self.call, q, KeyBlocks(k, v).ready(q))
            rows = slice(None) if self.keep is None else self.keep
            self.out, self.lse = out.detach()[:, rows], lse.detach()[:, :, rows]
            if self.offload:  # kept in host memory until the backward (offload.py)
                self.out, self.lse = to_host(self.out), to_host(self.lse)
            return out
        if self.offload:
            self.out, self.lse = self.out.to(q.device, non_blocking=True), self.lse.to(q.device, non_blocking=True)
        replay = Strategy(self.strategy.name, forward=self._replay, backward=self.strategy.backward)
        out, _ = replay(self.call, q, KeyBlocks(k, v).ready(q))
        return out

    def _replay(self, call, q, keys):
        """The recompute's forward: stored rows, and the prefix's rows recomputed (selective)."""
        k, v = keys.k, keys.v
        if self.keep is None:  # fresh aliases: the autograd node this returns into must not become
            return self.out.detach(), self.lse.detach()  # the stored tensors' grad_fn (it would hold the recompute)
        out, lse = self.attend.prefix(q, k, v, self.split)
        out[:, self.keep], lse[:, :, self.keep] = self.out, self.lse
        return out, lse


def run_layer(layer, x, cos, sin, positions, mode: str, split: float, offload: bool = False):
    """layer(x, cos, sin, attend=...) under checkpointing `mode` (see the module docstring).

    positions: (batch, seq_local) global positions of this rank's tokens (the same in every row);
    split: the fraction of the sequence whose attention `selective` recomputes; offload: keep what
    the mode stores (the layer's input, the attention rows) in host memory (offload.py).
    """
    if mode == "none" or not torch.is_grad_enabled():
        return layer(x, cos, sin)
    keep_layer = offloaded_checkpoint if offload else functools.partial(checkpoint, use_reentrant=False)
    if mode == "full":
        return keep_layer(layer, x, cos, sin)
    attend = layer.attention.attend
    if mode == "remat":
        stored = StoredAttention(attend, None, 0, offload)
    elif mode == "selective":
        global_len = positions.shape[1] * attend.world
        cut = min(global_len, max(0, round(split * global_len)))
        keep = positions[0] >= cut
        stored = StoredAttention(attend, None if cut == 0 else keep, cut, offload)
    else:
        raise ValueError(f"checkpointing mode {mode!r}: one of {MODES}")
    return keep_layer(functools.partial(layer, attend=stored), x, cos, sin)
