"""CUDA backend: cuDNN's fused attention, through torch's ops (what SDPA's CUDNN_ATTENTION runs).

Called directly, so that the forward returns lse and the backward takes the rows' global out and lse:

    _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                                        return_debug_mask, *, scale)
        -> out (b, h, sq, dv) in q's stride order, lse (b, h, sq, 1) float32, cum_seq_q, cum_seq_k,
           max_q, max_k, philox_seed, philox_offset, debug_mask
    _scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, philox_seed, philox_offset,
                                                 attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                                 dropout_p, is_causal, *, scale) -> dq, dk, dv

q, k, v are (b, h, s, d) views with unit stride on the head dim (burst's (b, s, h, d) transposed); GQA
goes in without repeats and dk, dv come back with the KV heads; is_causal is the top-left triangle,
burst's tile convention, for any tile shape. The backward reads max_q, max_k as the dense lengths,
wants dout in out's strides and lse as the forward's (b, h, sq, 1), and is handed None for the bias
and the varlen tensors (what autograd hands it after a dense forward) and zero dropout seeds.

It runs full and causal tiles, and reversed triangles (query i sees keys i..: the planner's pieces of
a causal window, TRIANGLE_ROWS) as the causal tile of both runs reversed. Other masked tiles
(windows, documents, causal off the diagonal, all planned as masks.Bands since BANDS is set) and what
cuDNN does not take here (fp32, head dims that are not a multiple of 8 or over 128, a v head dim
unlike q's, a tile of one query and one key) go to aten_flash, the FlashAttention-2 inside torch,
which takes bands as window and varlen arguments (and hands on what it cannot take itself).
tests/cudnn_stand_in.py plays the two ops with these rules on the CPU; scripts/gpu_check.sh runs them.
"""

from __future__ import annotations

import functools

import torch

from ..masks import Bands
from . import aten_flash
from .spec import HALF, NO_ROW_CAP, KernelSpec

MAX_ROWS = NO_ROW_CAP
BANDS = True  # masks as band arguments, for aten_flash: cuDNN itself runs the unmasked and causal tiles
# Documents and causal windows whose pieces are this large run as cuDNN's causal tiles (and reversed
# ones) instead of FlashAttention-2's varlen and window calls: on an H200 SDPA's cuDNN ran causal attention
# in 0.55-0.60 of its flash backend's time, 16 documents of 4096 in 16.4 ms against 28.7 through burst's
# varlen FA2 (benchmarks/gpu.md); smaller pieces stay one varlen or band call (the 1024: not measured).
TRIANGLE_ROWS = 1024
RULES = False
SOFTCAP = False
MAX_HEAD_DIM = 128  # what torch's cuDNN path takes on every cuDNN 9 release (larger ones vary by version)

_forward_op = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
_backward_op = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)


# The ops' arguments as forward and backward below pass them by position (torch 2.5 to 2.13); a torch whose
# schema differs keeps FlashAttention-2 rather than fail at its first tile, inside a ring.
_FORWARD_ARGUMENTS = (
    "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask", "scale"
)  # fmt: skip
_BACKWARD_ARGUMENTS = (
    "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
    "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale",
)  # fmt: skip


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True on an NVIDIA GPU whose torch has cuDNN's attention ops, with the arguments passed here, and
    cuDNN 9 or newer."""
    if _forward_op is None or _backward_op is None or torch.version.hip or not torch.cuda.is_available():
        return False
    if _arguments(_forward_op) != _FORWARD_ARGUMENTS or _arguments(_backward_op) != _BACKWARD_ARGUMENTS:
        return False
    return torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000


def _arguments(op) -> tuple[str, ...]:
    return tuple(a.name for a in op.default._schema.arguments)


SPEC = KernelSpec(
    "cudnn",
    "cuda",
    HALF,
    available=lambda: available(),
    missing="this torch or GPU has no cuDNN attention (cuDNN 9 and torch 2.5 or newer on an NVIDIA GPU)",
    min_capability=(8, 0),
    fastest_from=(9, 0),
    head_dims=(8, MAX_HEAD_DIM),
    proven=True,  # exact on an H200 (benchmarks/gpu/h200_cudnn_run1.md, run2.md): sections 1, 2 (1 and 2 ranks), 5
)


def handles(q, k, v, causal: bool, mask) -> bool:
    """True when cuDNN runs this tile itself: fp16/bf16, no mask (causal is its own top-left
    triangle) or a reversed triangle (its causal path on both runs reversed), more than one query (its
    frontend refuses s_q = s_kv = 1, and newer torch refuses one-query "decode" tiles with some cuDNN
    releases on sm100: tiny tiles, FlashAttention-2's), equal q and v head dims that are multiples of 8
    up to MAX_HEAD_DIM."""
    return (
        (mask is None or _reversed(mask))
        and q.shape[1] > 1
        and q.dtype in HALF
        and k.shape[-1] == q.shape[-1]
        and SPEC.takes_head_dims(q.shape[-1], v.shape[-1])
    )


@functools.lru_cache(maxsize=8)
def _no_dropout_seeds(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's philox seed and offset: read only with dropout, which burst never asks."""
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> a (b, h, s, d) view of its contiguous copy (no copy when already contiguous)."""
    return x.contiguous().transpose(1, 2)


def _reversed(mask) -> bool:
    return isinstance(mask, Bands) and mask.is_reversed_triangle


def _flipped(*tensors, dim: int = 1):
    """The tensors with their rows in reverse order (copies: a reversed triangle's runs for the causal path)."""
    return [t.flip(dim) for t in tensors]


def forward(q, k, v, scale: float, causal: bool, mask=None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    if not handles(q, k, v, causal, mask):
        return aten_flash.forward(q, k, v, scale, causal, mask)
    if mask is not None:  # a reversed triangle: query i sees keys i.. = the causal tile of both runs reversed
        out, lse = forward(*_flipped(q, k, v), scale, True)
        return out.flip(1), lse.flip(-1)
    out, lse, *_ = _forward_op(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, False, scale=scale
    )
    return out.transpose(1, 2), lse.reshape(*lse.shape[:2], q.shape[1])  # (b, h, sq, 1), or (b, h, sq) before


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    if not handles(q, k, v, causal, mask):
        return aten_flash.backward(dout, q, k, v, out, lse, scale, causal, mask)
    if mask is not None:  # a reversed triangle, as forward runs it
        grads = backward(*_flipped(dout, q, k, v, out), lse.flip(-1), scale, True)
        return _flipped(*grads)
    dq, dk, dv = _backward_op(
        _heads_first(dout),
        _heads_first(q),
        _heads_first(k),
        _heads_first(v),
        _heads_first(out),
        lse.float().contiguous().unsqueeze(-1),
        *_no_dropout_seeds(q.device),
        None,
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
