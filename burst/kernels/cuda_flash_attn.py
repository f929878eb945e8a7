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

from ..masks import Bands
from . import cuda_sdpa, flex, reference
from .spec import HALF, KernelSpec

MAX_ROWS = 8192  # rows per call at most (fresh outputs per call); a call this size fills a GPU
DTYPES = HALF
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
    return all(
        hasattr(interface, f)
        for f in (
            "_flash_attn_forward",
            "_flash_attn_backward",
            "_flash_attn_varlen_forward",
            "_flash_attn_varlen_backward",
        )
    )


SPEC = KernelSpec(
    "flash_attn",
    "cuda",
    HALF,
    available=lambda: available(),
    missing="flash_attn (2.7 or newer) does not import here: pip install flash-attn, or leave BURST_KERNEL unset "
    "to use the flash kernel inside torch (aten_flash) or SDPA",
    proven=False,  # the package was never installed on a lent GPU: checked against its stand-in only
)


def handles(q, k, causal: bool, mask) -> bool:
    """True when a FlashAttention-2 build runs this tile (else `_fallback` does): fp16/bf16, head dims
    that are multiples of 8 up to 256, no mask or masks.Bands (those it would misread run as several
    calls it reads as meant: `_parts`), a causal tile square."""
    d = q.shape[-1]
    if q.dtype not in DTYPES or d % 8 or d > 256 or not (mask is None or isinstance(mask, Bands)):
        return False
    return not causal or q.shape[1] == k.shape[1]


def _fallback(mask, softcap: float = 0.0):
    """Who runs a tile flash_attn cannot: FlexAttention for a masked or softcapped one when torch has
    it (no bias), else aten's efficient kernel (a dense bias for a mask, counted), or for softcap the
    reference (explicit scores: aten's kernel has no softcap)."""
    if (mask is not None or softcap) and flex.available():
        return flex
    return reference if softcap else cuda_sdpa


class FlashAttnPackage:
    """The four calls into the `flash_attn` package (signatures in the module docstring). Every
    FlashAttention-2 build burst drives offers these four; kernels/aten_flash.py is the other one."""

    SOFTCAP = True
    fallback = staticmethod(_fallback)

    @staticmethod
    def dense_forward(q, k, v, scale, causal, left, right, softcap):
        """(b, s, h, d) inputs, contiguous -> out (b, sq, h, d), lse (b, h, sq) float32."""
        out, lse, _, _ = _interface()._flash_attn_forward(
            q, k, v, 0.0, scale, causal, left, right, softcap, None, False
        )
        return out, lse

    @staticmethod
    def dense_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _interface()._flash_attn_backward(
            dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, left, right, softcap, None, False, None
        )
        return dq, dk, dv

    @staticmethod
    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, softcap):
        """(total, h, d) inputs -> out (total_q, h, d), lse (h, total_q) float32."""
        out, lse, _, _ = _interface()._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, False, left, right, softcap, None, False
        )
        return out, lse

    @staticmethod
    def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _interface()._flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            scale,
            False,
            left,
            right,
            softcap,
            None,
            False,
            None,
        )
        return dq, dk, dv


FLASH_ATTN = FlashAttnPackage()


def _runs(library, q, k, v, causal: bool, mask, softcap: float) -> bool:
    """True when `library` takes this tile as it is (equal q, k, v head dims: FlashAttention-2 has one)."""
    return handles(q, k, causal, mask) and v.shape[-1] == q.shape[-1] and (not softcap or library.SOFTCAP)


def _parts(mask) -> tuple | None:
    """For bands FlashAttention-2 would misread (Bands.flash_misreads): the calls it reads as meant
    (Bands.flash_parts); None for any other mask."""
    return _parts_of_bands(mask) if isinstance(mask, Bands) else None


@functools.lru_cache(maxsize=1024)
def _parts_of_bands(mask: Bands) -> tuple | None:
    # once per distinct bands, not per kernel call: plans are cached, so a run's tiles repeat their Bands
    return tuple(mask.flash_parts()) if mask.flash_misreads() else None


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
    return (
        _cu_seqlens(mask.cu_q, batch, q.shape[1], q.device),
        _cu_seqlens(mask.cu_k, batch, k.shape[1], q.device),
        max_q,
        max_k,
    )


def _packed(x):
    """(b, s, h, d) -> (b * s, h, d), the varlen interface's layout."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def forward(
    q,
    k,
    v,
    scale: float,
    causal: bool,
    mask: torch.Tensor | Bands | None = None,
    softcap: float = 0.0,
    library=FLASH_ATTN,
):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32, on `library`'s
    FlashAttention-2 (flash_attn's by default)."""
    if not _runs(library, q, k, v, causal, mask, softcap):
        return library.fallback(mask, softcap).forward(q, k, v, scale, causal, mask, **_softcap_kwargs(softcap))
    parts = _parts(mask)
    if parts:  # FlashAttention-2 would read these bands' windows otherwise: calls it reads as meant
        outs, lses = zip(
            *(
                forward(q[:, a:b], k[:, c:d], v[:, c:d], scale, False, band, softcap, library)
                for a, b, c, d, band in parts
            )
        )
        return torch.cat(outs, 1), torch.cat(lses, 2)
    left, right = _window(causal, mask)
    if mask is not None and mask.sequences > 1:
        b, sq, h, _ = q.shape
        out, lse = library.varlen_forward(
            _packed(q), _packed(k), _packed(v), *_varlen_args(mask, q, k), scale, left, right, softcap
        )
        out, lse = out.view(q.shape), lse.view(h, b, sq).transpose(0, 1)
    else:
        out, lse = library.dense_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), scale, causal and mask is None, left, right, softcap
        )
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    causal: bool,
    mask: torch.Tensor | Bands | None = None,
    softcap: float = 0.0,
    library=FLASH_ATTN,
):
    """Gradients of one block given the rows' global out and lse (see kernels/__init__.py)."""
    if not _runs(library, q, k, v, causal, mask, softcap):
        return library.fallback(mask, softcap).backward(
            dout, q, k, v, out, lse, scale, causal, mask, **_softcap_kwargs(softcap)
        )
    parts = _parts(mask)
    if parts:
        dq = []
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
        for a, b, c, d, band in parts:
            rows = slice(a, b)
            dq_p, dk_p, dv_p = backward(
                dout[:, rows],
                q[:, rows],
                k[:, c:d],
                v[:, c:d],
                out[:, rows],
                lse[:, :, rows],
                scale,
                False,
                band,
                softcap,
                library,
            )
            dq.append(dq_p)
            dk[:, c:d] += dk_p  # row pieces share their keys: summed in float32, handed back in k's dtype
            dv[:, c:d] += dv_p
        return torch.cat(dq, 1), dk.to(k.dtype), dv.to(v.dtype)
    left, right = _window(causal, mask)
    if mask is not None and mask.sequences > 1:
        b, sq, h, _ = q.shape
        dq, dk, dv = library.varlen_backward(
            _packed(dout),
            _packed(q),
            _packed(k),
            _packed(v),
            _packed(out),
            lse.float().transpose(0, 1).reshape(h, b * sq),
            *_varlen_args(mask, q, k),
            scale,
            left,
            right,
            softcap,
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    return library.dense_backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        out.contiguous(),
        lse.float().contiguous(),
        scale,
        causal and mask is None,
        left,
        right,
        softcap,
    )
