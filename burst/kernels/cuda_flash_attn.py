"""CUDA backend: the `flash_attn` package (FlashAttention-2, 2.7 or newer), when it is installed.

Chosen for fp16/bf16 on CUDA. flash_attn takes burst's (batch, seqlen, heads, headdim) layout as is,
runs GQA natively and returns the float32 logsumexp; its backward takes the rows' global out and lse,
which is what ring backward needs. Masks reach it as arguments, never as tensors (`BANDS`: the
planner hands it masks.Bands instead of dense masks for causal, window and document masks):
- a square causal tile: `causal=True` (its causal mask is aligned bottom-right; square, that is ours);
- one band (a causal tile off the diagonal, a sliding window, striped runs): `window_size_left/right`,
  which the planner derives from the tile's global positions (masks.Bands says how);
- several documents in one tile: the varlen interface, one sequence per document piece, `cu_seqlens`
  as int32 tensors built once per plan and device, the window the same for every piece.
Block-sparse tiles and runs of unequal strides come whole, as rules (masks.PositionRule), and go to
FlexAttention (flex.py); head dims that are not a multiple of 8 too. Without FlexAttention they go to
the SDPA backend (cuda_sdpa.py) with a dense bias, counted in CommStats.dense_masks.

Interface used (flash_attn.flash_attn_interface, 2.7+):
    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax)
        -> out, softmax_lse (b, h, sq) float32, S_dmask, rng_state
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state)   # writes dq, dk, dv
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                               softcap, alibi_slopes, return_softmax)
        -> out (total_q, h, d), softmax_lse (h, total_q) float32, S_dmask, rng_state
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                window_size_left, window_size_right, softcap, alibi_slopes,
                                deterministic, rng_state)
A row that sees no key comes back with lse +inf; burst's merge wants -inf there (done on the device).
The suite checks this adapter against a stand-in module that enforces these rules
(tests/test_kernels.py); benchmarks/README.md says what has run on a GPU.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import cuda_sdpa, flex, reference
from ..masks import Bands

MAX_ROWS = 8192  # rows per call at most (fresh outputs per call); a call this size fills a GPU
DTYPES = (torch.float16, torch.bfloat16)
BANDS = True  # takes causal, window and document masks as arguments (masks.TileSizes.bands)
RULES = flex.available()  # other partial tiles whole, as rules, for FlexAttention (masks.TileSizes.rules)
SOFTCAP = True  # forward and backward take softcap= (flash_attn's own argument)
_NO_WINDOW = (-1, -1)


def _interface():
    return importlib.import_module("flash_attn.flash_attn_interface")


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when flash_attn (with the 2.7+ interface above) imports."""
    try:
        interface = _interface()
    except Exception:  # not installed, or built for another torch/CUDA: SDPA serves instead
        return False
    return all(hasattr(interface, f) for f in ("_flash_attn_forward", "_flash_attn_backward",
                                               "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"))


def handles(q, k, causal: bool, mask) -> bool:
    """True when flash_attn runs this tile (else `_fallback` does)."""
    if q.dtype not in DTYPES or q.shape[-1] % 8 or not (mask is None or isinstance(mask, Bands)):
        return False
    return not causal or q.shape[1] == k.shape[1]


def _fallback(mask, softcap: float):
    """Who runs a tile flash_attn cannot: FlexAttention for a masked or softcapped one when torch has
    it (no bias), else aten's efficient kernel (a dense bias for a mask, counted), or for softcap the
    reference (explicit scores: aten's kernel has no softcap)."""
    if (mask is not None or softcap) and flex.available():
        return flex
    return reference if softcap else cuda_sdpa


def _softcap_kwargs(softcap: float) -> dict:
    return {"softcap": softcap} if softcap else {}


def _window(causal: bool, mask: Bands | None) -> tuple[int, int]:
    if mask is not None:
        return mask.left, mask.right
    return (-1, 0) if causal else _NO_WINDOW


@functools.lru_cache(maxsize=256)
def _cu_seqlens(bounds: tuple[int, ...], batch: int, rows: int, device: torch.device) -> torch.Tensor:
    """int32 cu_seqlens on `device` for `batch` copies of a tile of `rows` rows cut at `bounds`: built
    once per plan, batch and device, so the loop issues no host-to-device copy."""
    cu = [b * rows + x for b in range(batch) for x in bounds[:-1]] + [batch * rows]
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _varlen_args(mask: Bands, q, k) -> tuple:
    batch = q.shape[0]
    max_q, max_k = mask.max_rows
    return (_cu_seqlens(mask.cu_q, batch, q.shape[1], q.device), _cu_seqlens(mask.cu_k, batch, k.shape[1], q.device),
            max_q, max_k)


def _packed(x):
    """(b, s, h, d) -> (b * s, h, d), the varlen interface's layout."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def forward(q, k, v, scale: float, causal: bool, mask: torch.Tensor | Bands | None = None, softcap: float = 0.0):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32."""
    if not handles(q, k, causal, mask):
        return _fallback(mask, softcap).forward(q, k, v, scale, causal, mask, **_softcap_kwargs(softcap))
    left, right = _window(causal, mask)
    if mask is not None and mask.sequences > 1:
        b, sq, h, _ = q.shape
        out, lse, _, _ = _interface()._flash_attn_varlen_forward(
            _packed(q), _packed(k), _packed(v), *_varlen_args(mask, q, k), 0.0, scale, False, left, right,
            softcap, None, False,
        )
        out, lse = out.view(q.shape), lse.view(h, b, sq).transpose(0, 1)
    else:
        out, lse, _, _ = _interface()._flash_attn_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, scale, causal and mask is None, left, right,
            softcap, None, False,
        )
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask: torch.Tensor | Bands | None = None,
             softcap: float = 0.0):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    if not handles(q, k, causal, mask):
        return _fallback(mask, softcap).backward(dout, q, k, v, out, lse, scale, causal, mask,
                                                 **_softcap_kwargs(softcap))
    left, right = _window(causal, mask)
    if mask is not None and mask.sequences > 1:
        b, sq, h, _ = q.shape
        qp, kp, vp = _packed(q), _packed(k), _packed(v)
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        _interface()._flash_attn_varlen_backward(
            _packed(dout), qp, kp, vp, _packed(out), lse.float().transpose(0, 1).reshape(h, b * sq), dq, dk, dv,
            *_varlen_args(mask, q, k), 0.0, scale, False, left, right, softcap, None, False, None,
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _interface()._flash_attn_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous(), dq, dk, dv,
        0.0, scale, causal and mask is None, left, right, softcap, None, False, None,
    )
    return dq, dk, dv
