"""CUDA backend: the `flash_attn` package (FlashAttention-2, 2.6 or newer), when it is installed.

Chosen for fp16/bf16 on CUDA. flash_attn takes burst's (batch, seqlen, heads, headdim) layout as is,
runs GQA natively and returns the float32 logsumexp; its backward takes the rows' global out and lse,
which is what ring backward needs. It has no arbitrary masks and its causal mask is aligned
bottom-right, so partial tiles, causal tiles that are not square, and head dims that are not a
multiple of 8 go to the SDPA backend (cuda_sdpa.py) instead.

Interface used (flash_attn.flash_attn_interface, 2.6+):
    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax)
        -> out, softmax_lse (b, h, sq) float32, S_dmask, rng_state
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state)   # writes dq, dk, dv
The suite checks this adapter against a stand-in module with that interface (tests/test_kernels.py);
benchmarks/README.md says what has run on a GPU.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import cuda_sdpa

MAX_ROWS = 8192  # rows per call at most (fresh outputs per call); a call this size fills a GPU
DTYPES = (torch.float16, torch.bfloat16)


def _interface():
    return importlib.import_module("flash_attn.flash_attn_interface")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when flash_attn (with the 2.6+ interface above) imports."""
    try:
        interface = _interface()
    except Exception:  # not installed, or built for another torch/CUDA: SDPA serves instead
        return False
    return hasattr(interface, "_flash_attn_forward") and hasattr(interface, "_flash_attn_backward")


def _handles(q, k, causal: bool, mask) -> bool:
    return mask is None and q.dtype in DTYPES and q.shape[-1] % 8 == 0 and (not causal or q.shape[1] == k.shape[1])


def forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    if not _handles(q, k, causal, mask):
        return cuda_sdpa.forward(q, k, v, scale, causal, mask)
    out, lse, _, _ = _interface()._flash_attn_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, scale, causal, -1, -1, 0.0, None, False
    )
    return out, lse


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    if not _handles(q, k, causal, mask):
        return cuda_sdpa.backward(dout, q, k, v, out, lse, scale, causal, mask)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _interface()._flash_attn_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous(), dq, dk, dv,
        0.0, scale, causal, -1, -1, 0.0, None, False, None,
    )
    return dq, dk, dv
