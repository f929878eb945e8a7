"""The key side of a call: what a strategy's ring moves and how a held block becomes the kernel's K, V.

Every call's key side is one of these objects, from burst.attention down through prepare_attention,
Strategy.__call__ and the one autograd Function (strategies/base.py): here `KeyBlocks`, the K and V
tensors themselves; burst/latent.py's `LatentKeys`, MLA's latent, is another kind. A kind says:

    strategies                the strategies that move it (None: every one; "auto" takes the first);
    check(q)                  its local checks against q (before any collective), and
    check_strategy(name, call), check_entries(compressed, q, global_len): what it does not take;
    facts()                   what every rank must agree on;
    ready(q)                  itself as the strategy reads it (unit-stride head dims, q's dtype);
    inputs, rebuilder()       the tensors the Function differentiates, and how to rebuild from them;
    travelling, expand(held), for_backward(held, acc_first, acc_last), gradients(accs)
                              the blocks a ring moves and what a held one becomes (below);
    k, v                      (KeyBlocks only) the tensors, for strategies that move K, V themselves;
    with_lse_channel(), narrow_gradients(grads)
                              itself widened for lse's gradient (burst/lse_channel.py), and the
                              widened gradients back to its inputs';
    value_width               the output's head dim when narrower than the kernels' (None: theirs);
    kernel_value_dim(q)       the values' head dim the kernels see.
"""

from __future__ import annotations

import functools

import torch

from .compressed import check_compressed
from .kernels import reference
from .lse_channel import narrowed, ones_after, zeros_after

DTYPES = tuple(reference.DTYPES.values())  # what burst.attention takes


def check_query(q) -> None:
    """TypeError / ValueError unless q is a 4-D tensor of a dtype burst.attention takes."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    _check_4d("q", q)
    if q.dtype not in DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: float32, bfloat16, float16, float64")
    if q.device.type == "meta":
        raise ValueError("q is on the meta device (a shape without data): burst.attention computes on real tensors")
    if q.shape[2] == 0 or q.shape[3] == 0:
        raise ValueError(f"q has shape {tuple(q.shape)}: heads and headdim must be at least 1")


def _check_4d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 4:
        varlen = (  # flash_attn's varlen calls pack the batch's documents as (total_tokens, heads, headdim)
            f"; packed documents as flash_attn's varlen calls take them: {name}.unsqueeze(0) with cu_seqlens="
            if t.dim() == 3
            else ""
        )
        raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, headdim), got shape {tuple(t.shape)}{varlen}")


def check_tensors(q, k, v) -> None:
    """The local checks of q, k, v: 4-D tensors of one dtype and device, k and v of one shape, shards of
    one batch and sequence, one head dim, q's heads a multiple of k's."""
    check_query(q)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_4d(name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k, v must be on one device")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k has {k.shape[0]}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"q holds {q.shape[1]} tokens but k holds {k.shape[1]}; q, k, v must be shards of one sequence"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[3]} but k has {k.shape[3]}; they must match")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads but k has {k.shape[2]}; q heads must be a multiple of k heads")


def unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    """Any strides are fine (transposed views, slices) except along head_dim: the attention kernels
    read each head's vector as one run (aten's CPU flash op silently misreads a strided last dim), so
    only a tensor whose head_dim is strided is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def travelling_kv(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The K, V blocks a strategy moves: one when the values are the keys (`v is k`: DeepSeek-V4's
    shared K = V, or any caller passing one tensor as both), sent once and read as both (held[0], held[-1])."""
    return [k] if v is k else [k, v]


def kv_gradients(dk: torch.Tensor, dv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(dk, dv) in k's and v's dtypes; with v is k, dk is dv is one accumulator holding both sums, returned
    once (the other None: autograd adds nothing more for the same tensor)."""
    if v is k:
        return dk.to(k.dtype), None
    return dk.to(k.dtype), dv.to(v.dtype)


class KeyBlocks:
    """The K, V tensors themselves (one when v is k): k, v (batch, seqlen_local, nheads_k, headdim).

    travelling: this rank's blocks; expand(held) -> (k, v); for_backward(held, acc_first, acc_last) ->
    (k, v, dk, dv, finish): what attend_backward adds the held block's dK, dV into and a call that
    completes the step (the accumulators may be deferred, kernels/accumulators.ArrivingAccumulators);
    gradients(accs) -> the inputs' gradients from the float32 accumulators that came home.
    """

    strategies = None  # every strategy moves K, V
    value_width = None

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.travelling = travelling_kv(k, v)

    def check(self, q) -> None:
        check_tensors(q, self.k, self.v)

    def check_strategy(self, name: str, call) -> None:
        return None

    def check_entries(self, compressed, q, global_len: int) -> None:
        check_compressed(compressed, q, self.v, global_len)

    def kernel_value_dim(self, q) -> int:
        return self.v.shape[-1]

    def facts(self) -> dict:
        return {"kv_heads": self.k.shape[2], "values are keys": self.v is self.k}  # (travelling_kv)

    def ready(self, q) -> KeyBlocks:
        """Unit-stride head dims; values that are the keys stay one tensor, so one block travels."""
        k = unit_stride_last(self.k)
        return KeyBlocks(k, k if self.v is self.k else unit_stride_last(self.v))

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v

    def rebuilder(self):
        """KeyBlocks from saved (k, v), holding no tensor (v is k kept)."""
        return functools.partial(_kv_from_inputs, self.v is self.k)

    def expand(self, held):
        return held[0], held[-1]

    def for_backward(self, held, acc_first, acc_last):
        return held[0], held[-1], acc_first, acc_last, _nothing

    def gradients(self, accs):
        return kv_gradients(accs[0], accs[-1], self.k, self.v)

    def with_lse_channel(self) -> KeyBlocks:
        """k with zero channels, v with the ones channel (two tensors, also when v is k)."""
        return KeyBlocks(zeros_after(self.k), ones_after(self.v))

    def narrow_gradients(self, grads):
        """with_lse_channel()'s (dk, dv) as this one's: the first channels (summed when v is k)."""
        dk, dv = narrowed(grads[0], self.k), narrowed(grads[1], self.v)
        return (dk + dv, None) if self.v is self.k else (dk, dv)


def _kv_from_inputs(values_are_keys: bool, k, v) -> KeyBlocks:
    return KeyBlocks(k, k if values_are_keys else v)


def _nothing() -> None:
    return None
