"""CUDA backend: the FlashAttention-2 inside PyTorch (aten's `_flash_attention_forward` / `_backward`).

What SDPA's flash backend runs, called directly so that the forward returns lse and the backward
takes the rows' global out and lse (what ring backward needs). The proven CUDA kernel for fp16/bf16
(kernels/registry.py): SDPA's flash backend itself, with the lse burst's merges need. The ops take
flash_attn's layout and conventions (b, s, h, d; GQA native; windows with the band at the
bottom-right corner; varlen with int32 cu_seqlens), so the tile logic is cuda_flash_attn's, handed
this module's `ATEN` library:

    _flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, *, scale, window_size_left, window_size_right)
        -> out, lse (b, h, sq) or, varlen, (h, total_q) (older builds: (sequences, h, max_q)), rng_state,
           unused, debug_mask
    _flash_attention_backward(dout, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                              is_causal, rng_state, unused, *, scale, window_size_left, window_size_right)
        -> dq, dk, dv   (cum_seq_q None: the dense kernel; dk, dv summed over the group for GQA)

It has no softcap (select_kernel gives softcapped calls to FlexAttention) and no rules: a tile with
another mask, an fp32 tile, a head dim over 256 or (from a kernel-level caller) a v head dim unlike q's
goes to aten's efficient kernel (cuda_sdpa.py). tests/test_kernels.py checks this adapter against a stand-in of the
two ops with their argument rules; scripts/gpu_check.sh runs it on a GPU.
"""

from __future__ import annotations

import functools

import torch

from . import cuda_flash_attn, cuda_sdpa, reference
from .spec import HALF, NO_ROW_CAP, KernelSpec

MAX_ROWS = NO_ROW_CAP  # its tiles it cannot take are partial (leaf-sized) or excluded by SPEC.head_dims
DTYPES = cuda_flash_attn.DTYPES
BANDS = True  # causal, window and document masks as arguments, like flash_attn's
RULES = False  # other partial tiles as dense masks, for aten's efficient kernel (flex recompiles: gpu.md)
SOFTCAP = False
handles = cuda_flash_attn.handles

_forward_op = getattr(torch.ops.aten, "_flash_attention_forward", None)
_backward_op = getattr(torch.ops.aten, "_flash_attention_backward", None)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True on an sm80+ NVIDIA GPU whose torch was built with flash attention and whose ops take
    windows (ROCm builds run another flash under these names: not checked, so not chosen)."""
    if _forward_op is None or _backward_op is None or torch.version.hip or not torch.cuda.is_available():
        return False
    takes_windows = all(
        any(a.name == "window_size_left" for a in op.default._schema.arguments) for op in (_forward_op, _backward_op)
    )
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)()
    return takes_windows and built and torch.cuda.get_device_capability() >= (8, 0)


SPEC = KernelSpec(
    "aten_flash",
    "cuda",
    HALF,
    available=lambda: available(),
    head_dims=(8, 256),
    missing="this torch or GPU has no flash attention with window arguments (an sm80+ GPU and "
    "torch 2.5 or newer built with it)",
)


def _fallback(mask, softcap: float = 0.0):
    return reference if softcap else cuda_sdpa


@functools.lru_cache(maxsize=8)
def _no_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's rng_state and unused arguments: read only with dropout, which burst never asks."""
    return torch.zeros(2, dtype=torch.int64, device=device), torch.empty(0, device=device)


def _rows_of_sequences(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed row: its sequence and its position in that sequence."""
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    return seq, torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].long()[seq]


@functools.lru_cache(maxsize=None)
def varlen_lse_padded() -> bool:
    """Whether this build's varlen forward returns lse padded per sequence, (sequences, h, max_q), as
    older builds do, rather than (h, total_q): read once from the op's own shape rule on the meta
    device (two sequences of three tokens), so the backward hands the build's layout back."""
    q = torch.empty(3, 1, 8, device="meta", dtype=torch.float16)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    try:
        lse = _forward_op(
            q, q, q, cu, cu, 2, 2, 0.0, False, False, scale=1.0, window_size_left=-1, window_size_right=-1
        )[1]
    except Exception:  # no meta rule in this build: the layout of the builds that have windows
        return False
    return lse.dim() == 3


class AtenFlash:
    """The four calls cuda_flash_attn makes, on aten's ops, in burst's lse layouts."""

    SOFTCAP = False
    fallback = staticmethod(_fallback)

    @staticmethod
    def _windows(left, right) -> dict:
        return {"window_size_left": left, "window_size_right": right}

    @staticmethod
    def dense_forward(q, k, v, scale, causal, left, right, softcap):
        out, lse, *_ = _forward_op(
            q,
            k,
            v,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            False,
            scale=scale,
            **AtenFlash._windows(left, right),
        )
        return out, lse[..., : q.shape[1]]

    @staticmethod
    def dense_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap):
        dq, dk, dv = _backward_op(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            *_no_rng(q.device),
            scale=scale,
            **AtenFlash._windows(left, right),
        )
        return dq, dk, dv

    @staticmethod
    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, softcap):
        out, lse, *_ = _forward_op(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, **AtenFlash._windows(left, right)
        )
        if varlen_lse_padded():
            seq, pos = _rows_of_sequences(cu_q)
            lse = lse[seq, :, pos].transpose(0, 1)
        return out, lse

    @staticmethod
    def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right, softcap):
        if varlen_lse_padded():
            seq, pos = _rows_of_sequences(cu_q)
            padded = lse.new_zeros(len(cu_q) - 1, lse.shape[0], max_q)
            padded[seq, :, pos] = lse.transpose(0, 1)
            lse = padded
        dq, dk, dv = _backward_op(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            False,
            *_no_rng(q.device),
            scale=scale,
            **AtenFlash._windows(left, right),
        )
        return dq, dk, dv


ATEN = AtenFlash()


def forward(q, k, v, scale: float, causal: bool, mask=None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    return cuda_flash_attn.forward(q, k, v, scale, causal, mask, library=ATEN)


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    return cuda_flash_attn.backward(dout, q, k, v, out, lse, scale, causal, mask, library=ATEN)
