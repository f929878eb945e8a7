"""FlexAttention backend (torch.nn.attention.flex_attention): any mask as a rule, never as a bias.

On CUDA, auto takes it for softcap (no other CUDA kernel here takes one) and BURST_KERNEL=flex asks
for it. The tile's mask reaches it as a rule over global positions (masks.PositionRule), as bands
(masks.Bands), as a causal triangle or as a dense bool tensor. All but the dense one become tensors
that one `mask_mod` reads (`_rule_tensors`); the `BlockMask` built from it (once per plan and device,
cached) lets the kernel skip the blocks the mask leaves out. One mask_mod, and tiles as contiguous
copies, keep compiled flex_attention at a graph or two per grad mode (tests/test_kernels.py counts
them): on an H200 a mask_mod per tile kind recompiled per tile shape, dtype and grad mode until
dynamo's recompile limit sent it to its unfused path, 30-50x slower (benchmarks/gpu.md).

Forward: `flex_attention(..., return_aux=AuxRequest(lse=True))` (natural-log lse, -inf and out 0 for a
row with no key, as burst's merge wants).

Backward with the rows' *global* out and lse (ring backward). FlexAttention has no entry point that
takes them, so the tile's forward is recomputed under autograd and differentiated with weighted
incoming gradients. With w = exp(lse_tile - lse_global) per row (0 for a globally empty row) and
D = rowsum(dout * out_global):
    grad of out_tile = w * dout,    grad of lse_tile = w * (rowsum(dout * out_tile) - D).
Then dS = P_tile * w * (dout . v_j - D) = P_global * (dP - D): the global softmax's gradient, exactly
what flash_attn's backward computes from the global out and lse. The suite checks this algebra
against float64 with a differentiable stand-in of flex_attention, and with the real one compiled by
dynamo on the CPU (its CPU backward unlocked in the test: torch refuses it there);
scripts/gpu_check.sh ran it on an H200, exact (benchmarks/gpu.md).

On CUDA, flex_attention is compiled (torch.compile) as its documentation asks; eager it runs a slow
reference implementation.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..masks import Bands, PositionRule
from ..masks.rules import attends_within, window_bounds
from .masking import dense_mask
from .spec import HALF, KernelSpec

MAX_ROWS = 8192
SOFTCAP = True  # forward and backward take softcap= (a score_mod)
RULES = True  # takes partial tiles whole, as rules (masks.TileSizes.rules); bands from flash_attn's fallback too


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when this torch has FlexAttention with the lse output burst needs."""
    try:
        module = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return False
    return all(hasattr(module, name) for name in ("AuxRequest", "create_block_mask", "flex_attention"))


# auto: softcap only (its speed since the one mask_mod is not measured on a GPU)
SPEC = KernelSpec(
    "flex",
    "cuda",
    (*HALF, torch.float32),
    available=lambda: available(),
    missing=f"this torch ({torch.__version__}) has no FlexAttention with lse output",
    auto="softcap",
)


def _compile(backend: str = "inductor"):
    """flex_attention compiled: dynamic=None, so that after a second tile shape dynamo traces for
    dynamic shapes instead of one graph a shape (a test counts the graphs with backend="eager")."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend)


@functools.lru_cache(maxsize=None)
def _compiled(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return _compile() if device_type == "cuda" else flex_attention


def _rule_tensors(mask, causal: bool, sq: int, sk: int, device) -> tuple:
    """Any tile's mask but a dense one as the operands of `attends_within`, as per-row tensors: each
    query row's and key row's position and document, each query row's window bounds, and a
    block-sparse mask's layout and block size (None without one). One mask_mod then serves every tile
    (rule, bands, causal triangle, whole tile), so compiled flex_attention traces one graph for all of
    them: a Python int or another function in the mask_mod would be a guard, and a new graph per tile
    kind, shape and window, up to dynamo's recompile limit. The bounds are rows, not 0-d tensors, so
    the kernel reads every operand as the same kind of lookup. The block size stays an int: one per run."""
    blocks = None
    if isinstance(mask, PositionRule):
        q_pos, k_pos = mask.q.positions(device), mask.k.positions(device)
        q_doc, k_doc = mask.spec.documents(q_pos, k_pos)
        left, right = window_bounds(mask.spec.causal, mask.spec.window)
        if mask.spec.block_sparse is not None:
            blocks = (mask.spec.block_sparse.layout.to(device), mask.spec.block_sparse.block_size)
    elif isinstance(mask, Bands):
        q_pos, k_pos, q_doc, k_doc = mask.rows(device)
        left, right = window_bounds(False, (mask.left, mask.right))
    else:  # the whole tile, or its causal triangle (top-left: query row i sees key rows 0..i)
        q_pos, k_pos = torch.arange(sq, device=device), torch.arange(sk, device=device)
        q_doc = k_doc = None
        left, right = window_bounds(causal, None)
    if q_doc is None:
        q_doc, k_doc = q_pos.new_zeros(sq), k_pos.new_zeros(sk)
    left, right = (q_pos.new_full((sq,), n) for n in (left, right))
    return q_pos, k_pos, left, right, q_doc, k_doc, blocks


def _rule_mod(q_pos, k_pos, left, right, q_doc, k_doc, blocks):
    def mask_mod(b, h, q_idx, kv_idx):
        q = q_pos[q_idx]
        return attends_within(q, k_pos[kv_idx], left[q_idx], right[q_idx], q_doc[q_idx], k_doc[kv_idx], blocks)

    return mask_mod


def _mask_mod(mask, causal: bool, sq: int, sk: int, device):
    if isinstance(mask, torch.Tensor):  # a dense mask: looked up, still never widened to a bias
        allowed = dense_mask(mask, device)
        if allowed.dim() == 4:  # an index selection: one mask per batch row, (batch, 1, sq, sk)
            return lambda b, h, q_idx, kv_idx: allowed[b, 0, q_idx, kv_idx]
        return lambda b, h, q_idx, kv_idx: allowed[q_idx, kv_idx]
    return _rule_mod(*_rule_tensors(mask, causal, sq, sk, device))


_BLOCK_MASKS: dict = {}  # (mask, causal, sq, sk, device) -> BlockMask; masks are the plan's, cached with it
_BLOCK_MASKS_MAX = 512


def _block_mask(mask, causal: bool, sq: int, sk: int, device):
    key = (id(mask) if mask is not None else None, causal, sq, sk, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]
    mod = _mask_mod(mask, causal, sq, sk, device)
    from torch.nn.attention.flex_attention import create_block_mask

    batch = mask.shape[0] if isinstance(mask, torch.Tensor) and mask.dim() == 4 else None
    block_mask = create_block_mask(mod, batch, None, sq, sk, device=device)
    if len(_BLOCK_MASKS) >= _BLOCK_MASKS_MAX:
        _BLOCK_MASKS.clear()
    _BLOCK_MASKS[key] = (mask, block_mask)  # the mask object kept alive, so its id is not reused
    return block_mask


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float):
    """score_mod of logit softcapping: FlexAttention applies it to the scaled score, as Gemma 2 does."""
    return lambda score, b, h, q_idx, kv_idx: softcap * torch.tanh(score / softcap)


def _attend(q, k, v, scale: float, block_mask, softcap: float = 0.0):
    """(b, s, h, d) in, FlexAttention's (b, h, s, d) layout inside; out (b, sq, h, d), lse (b, h, sq)."""
    from torch.nn.attention.flex_attention import AuxRequest

    # Contiguous copies: a tile is a row slice of the shard, and compiled flex_attention guards on its
    # strides and storage offset, so slices would trace new graphs where copies share one.
    out, aux = _compiled(q.device.type)(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        block_mask=block_mask,
        scale=scale,
        score_mod=_softcap_mod(softcap) if softcap else None,
        enable_gqa=q.shape[2] != k.shape[2],
        return_aux=AuxRequest(lse=True),
    )
    return out.transpose(1, 2), aux.lse


def forward(
    q, k, v, scale: float, causal: bool, mask: torch.Tensor | Bands | PositionRule | None = None, softcap: float = 0.0
):
    """(b, sq, h, d) x (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32 (float64 for float64)."""
    block_mask = _block_mask(mask, causal, q.shape[1], k.shape[1], q.device)
    out, lse = _attend(q, k, v, scale, block_mask, softcap)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    scale: float,
    causal: bool,
    mask: torch.Tensor | Bands | PositionRule | None = None,
    softcap: float = 0.0,
):
    """Gradients of one block given the rows' global out and lse (see the module docstring)."""
    block_mask = _block_mask(mask, causal, q.shape[1], k.shape[1], q.device)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out_tile, lse_tile = _attend(qq, kk, vv, scale, block_mask, softcap)  # autograd: tanh's derivative too
        weight = torch.exp(lse_tile.to(acc) - lse.to(acc))  # (b, h, sq); 0 where either lse is -inf / +inf
        weight = torch.nan_to_num(weight, nan=0.0)  # a row empty both here and globally
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # D, (b, h, sq)
        own = (dout.to(acc) * out_tile.to(acc)).sum(-1).transpose(1, 2)  # rowsum(dout * out_tile)
        grad_out = (dout.to(acc) * weight.transpose(1, 2)[..., None]).to(out_tile.dtype)
        grad_lse = (weight * (own - delta)).to(lse_tile.dtype)
        dq, dk, dv = torch.autograd.grad((out_tile, lse_tile), (qq, kk, vv), (grad_out, grad_lse))
    return dq, dk, dv
