"""The flash_attn adapter (kernels/cuda_flash_attn.py) and backend dispatch, in one process.

flash_attn needs a GPU, so its interface is played by a stand-in module (tests/flash_stand_in.py)
with flash_attn 2.7+'s signatures and argument rules that computes in float64 from the values it is
given (including the global out and lse in the backward). This checks our side of the contract:
layout, argument order, lse shapes, GQA, window sizes and varlen sequences derived from each tile's
global positions, gradients written into the buffers we pass, and which tiles go to SDPA instead. It
does not check flash_attn itself (see benchmarks/README.md for what has run on a GPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import pytest
import torch
from burst import kernels
from burst.kernels import aten_flash, cuda_flash_attn, cuda_sdpa, cudnn, flex
from burst.kernels import spec as kernel_spec
from burst.kernels.reference import attention as reference_attention
from burst.kernels.reference import lse_error

import cudnn_stand_in
import flash_stand_in
import sdpa_stand_in
from cases import rel_err


@pytest.fixture
def stand_in(monkeypatch):
    for name, module in flash_stand_in.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda_flash_attn.available.cache_clear()
    yield
    cuda_flash_attn.available.cache_clear()


@pytest.fixture
def aten_stand_in(monkeypatch):
    """aten's two flash ops played by flash_stand_in.AtenOps; returns a function that picks the varlen
    lse layout (padded per sequence, as older builds return it, or (h, total_q))."""

    def use(padded_lse: bool = False):
        ops = flash_stand_in.AtenOps(padded_lse)
        monkeypatch.setattr(aten_flash, "_forward_op", ops.forward)
        monkeypatch.setattr(aten_flash, "_backward_op", ops.backward)
        monkeypatch.setattr(aten_flash, "varlen_lse_padded", lambda: padded_lse)  # the build's rule

    use()
    return use


@pytest.fixture
def cudnn_ops(monkeypatch):
    """torch's two cuDNN attention ops played by tests/cudnn_stand_in.py."""
    cudnn_stand_in.install(monkeypatch)
    return cudnn_stand_in.CALLS


@pytest.mark.parametrize("kernel", [cuda_flash_attn, aten_flash, cudnn], ids=["flash_attn", "aten_flash", "cudnn"])
def test_flash_attn_adapter_matches_float64_attention(stand_in, aten_stand_in, cudnn_ops, kernel):
    torch.manual_seed(0)
    b, s, d = 2, 48, 16
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
        for causal in (False, True):
            q64, dout64 = (
                torch.randn(b, s, heads, d, dtype=torch.float64),
                torch.randn(b, s, heads, d, dtype=torch.float64),
            )
            k64, v64 = (torch.randn(b, s, kv_heads, d, dtype=torch.float64) for _ in range(2))
            q64.requires_grad_(), k64.requires_grad_(), v64.requires_grad_()
            ref_out, ref_lse = reference_attention(q64, k64, v64, causal=causal)
            ref_out.backward(dout64)
            q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
            out, lse = kernel.forward(q, k, v, d**-0.5, causal)
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (b, heads, s)
            assert rel_err(out, ref_out) < 2e-2 and rel_err(lse, ref_lse) < 1e-2
            # The backward gets the global out and lse, as in a ring step.
            grads = kernel.backward(dout, q, k, v, ref_out.detach().to(q.dtype), ref_lse.float(), d**-0.5, causal)
            for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
                assert got.shape == want.shape and got.dtype == torch.bfloat16
                assert rel_err(got, want) < 3e-2, (heads, kv_heads, causal)


@pytest.mark.parametrize("kernel", [cuda_flash_attn, aten_flash], ids=["flash_attn", "aten_flash"])
def test_flash_attn_hands_what_it_cannot_do_to_sdpa(stand_in, aten_stand_in, monkeypatch, kernel):
    """flash_attn without FlexAttention (see the flex tests for with); aten_flash always (its RULES are off)."""
    monkeypatch.setattr(flex, "available", lambda: False)
    handed = []
    monkeypatch.setattr(cuda_sdpa, "forward", lambda *a: handed.append("forward") or "sdpa")
    monkeypatch.setattr(cuda_sdpa, "backward", lambda *a: handed.append("backward") or "sdpa")
    q, k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16), torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    odd = torch.randn(1, 8, 2, 12, dtype=torch.bfloat16)
    cases = [
        (q, k, False, mask),  # a partial tile needs a mask
        (q, k[:, :4], True, None),  # causal but not square: alignment differs
        (odd, odd, False, None),  # head dim not a multiple of 8
        (q.float(), k.float(), False, None),  # float32
        (torch.randn(1, 8, 2, 264, dtype=torch.bfloat16),) * 2 + (False, None),
    ]  # head dim over 256
    for qq, kk, causal, m in cases:
        assert kernel.forward(qq, kk, kk, 1.0, causal, m) == "sdpa"
        assert kernel.backward(qq, qq, kk, kk, qq, None, 1.0, causal, m) == "sdpa"
    narrow_v = torch.randn(1, 8, 2, 8, dtype=torch.bfloat16)  # MLA's v head dim below q's: one head dim only
    assert kernel.forward(q, k, narrow_v, 1.0, False, None) == "sdpa"
    assert kernel.backward(q, q, k, narrow_v, q, None, 1.0, False, None) == "sdpa"
    assert handed == ["forward", "backward"] * (len(cases) + 1)
    out, _ = kernel.forward(q, k, k, 1.0, True, None)  # square causal, no mask: flash's
    assert out.shape == q.shape


@pytest.fixture
def flex_stand_in(monkeypatch):
    """FlexAttention played by tests/flex_stand_in.py (differentiable on the CPU)."""
    from torch.nn.attention import flex_attention as real

    import flex_stand_in as module

    monkeypatch.setattr(real, "flex_attention", module.flex_attention)
    monkeypatch.setattr(real, "create_block_mask", module.create_block_mask)
    flex._compiled.cache_clear()
    flex._BLOCK_MASKS.clear()
    yield module
    flex._compiled.cache_clear()
    flex._BLOCK_MASKS.clear()


def test_the_varlen_lse_layout_is_read_from_the_builds_shape_rule():
    """aten_flash hands the backward the varlen lse layout this torch's forward returns, read from the
    op's meta rule (no GPU needed): this torch returns (h, total_q)."""
    aten_flash.varlen_lse_padded.cache_clear()
    assert aten_flash.varlen_lse_padded() is False


def test_dispatch_by_device_and_dtype(stand_in, monkeypatch):
    """The registry picks the fastest proven backend: flash_attn (installed, here its stand-in; never run
    on a GPU) only when named, with a warning; cuDNN (proven on an H200) on sm90+ for head dims it
    takes; aten's flash otherwise, aten's efficient op without it; FlexAttention only for softcap; a
    backend not proven is never picked (cuDNN as it was before its GPU run)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernel_spec, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(cudnn, "available", lambda: True)
    monkeypatch.setattr(aten_flash, "available", lambda: True)  # torch's own flash kernel (sm80+)
    assert kernels.select_kernel(torch.device("cpu"), torch.bfloat16) is kernels.cpu_flash
    assert kernels.select_kernel(cuda, torch.bfloat16) is cudnn  # flash_attn is unproven
    assert kernels.select_kernel(cuda, torch.float32) is cuda_sdpa  # flex only where asked (compiled: recompiles)
    assert kernels.select_kernel(cuda, torch.float64) is kernels.reference
    assert kernels.select_kernel(cuda, torch.bfloat16, softcap=30.0).kernel is flex  # aten's flash has no softcap
    monkeypatch.setenv(kernels.KERNEL_ENV, "flash_attn")
    with pytest.warns(UserWarning, match="not yet checked on a GPU"):
        assert kernels.select_kernel(cuda, torch.bfloat16) is cuda_flash_attn
    monkeypatch.delenv(kernels.KERNEL_ENV)
    with monkeypatch.context() as unproven:
        unproven.setattr(cudnn, "SPEC", dataclasses.replace(cudnn.SPEC, proven=False))
        assert kernels.select_kernel(cuda, torch.bfloat16) is aten_flash
    assert kernels.select_kernel(cuda, torch.float16, head_dim=128, v_head_dim=128) is cudnn
    assert kernels.select_kernel(cuda, torch.bfloat16, head_dim=192, v_head_dim=192) is aten_flash  # over 128
    assert kernels.select_kernel(cuda, torch.bfloat16, head_dim=64, v_head_dim=32) is cuda_sdpa  # unequal v
    assert kernels.select_kernel(cuda, torch.bfloat16, head_dim=264, v_head_dim=264) is cuda_sdpa  # over FA2's 256
    monkeypatch.setenv(kernels.KERNEL_ENV, "aten_flash")
    with pytest.raises(ValueError, match="multiples of 8 up to 256, not 264"):
        kernels.select_kernel(cuda, torch.bfloat16, head_dim=264, v_head_dim=264)
    monkeypatch.delenv(kernels.KERNEL_ENV)
    monkeypatch.setattr(kernel_spec, "_capability", lambda device: (8, 0))  # an A100: FA2 is as fast there
    assert kernels.select_kernel(cuda, torch.bfloat16) is aten_flash
    monkeypatch.setattr(aten_flash, "available", lambda: False)  # an older GPU or torch
    assert kernels.select_kernel(cuda, torch.bfloat16) is cuda_sdpa
    assert kernels.select_kernel(cuda, torch.bfloat16, softcap=30.0).kernel is flex  # the fused path with softcap
    monkeypatch.setattr(flex, "available", lambda: False)  # an older torch
    assert kernels.select_kernel(cuda, torch.bfloat16) is cuda_sdpa
    assert kernels.select_kernel(cuda, torch.float32) is cuda_sdpa
    assert kernels.select_kernel(cuda, torch.bfloat16, softcap=30.0).kernel is kernels.reference


def test_named_kernel_says_why_it_cannot_run(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(cudnn, "available", lambda: False)
    for name, device, dtype, words in (
        ("cudnn", cpu, torch.bfloat16, "needs CUDA tensors"),
        ("cudnn", cuda, torch.bfloat16, "no cuDNN attention"),
        ("cpu_flash", cuda, torch.float32, "needs CPU tensors"),
        ("sdpa", cuda, torch.float64, "takes float16, bfloat16, float32, not float64"),
        ("nonsense", cpu, torch.float32, "is not one of auto, cpu_flash, cudnn"),
    ):
        with pytest.raises(ValueError, match=words):
            kernels.named_kernel(name, device, dtype)
    monkeypatch.setenv(kernels.KERNEL_ENV, "cpu_flash")
    with pytest.raises(ValueError, match="takes no softcap .those that do: flash_attn, flex, reference"):
        kernels.select_kernel(cpu, torch.float32, softcap=30.0)


# --- cuDNN's ops: full and causal tiles itself, masked ones through aten's flash -----------------------


def test_cudnn_runs_full_and_causal_tiles_of_any_shape_itself(cudnn_ops):
    """Rectangular tiles, causal top-left (burst's convention, what cuDNN's is_causal means), GQA without
    repeats, forward and backward from the global out and lse: every call cuDNN's (the stand-in's)."""
    torch.manual_seed(4)
    for sq, sk, heads, kv_heads, causal in (
        (48, 32, 4, 2, True),
        (32, 48, 8, 1, True),
        (40, 40, 4, 4, False),
        (24, 64, 6, 3, False),
    ):
        q64, dout64 = (torch.randn(2, sq, heads, 16, dtype=torch.float64) for _ in range(2))
        k64, v64 = (torch.randn(2, sk, kv_heads, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
        q64.requires_grad_()
        ref_out, ref_lse = reference_attention(q64, k64, v64, 0.3, causal=causal)
        ref_out.backward(dout64)
        q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
        cudnn_ops.clear()
        out, lse = cudnn.forward(q, k, v, 0.3, causal)
        assert out.shape == q.shape and lse.shape == (2, heads, sq) and lse.dtype == torch.float32
        assert rel_err(out, ref_out) < 2e-2 and lse_error(lse, ref_lse) < 5e-2, (sq, sk, causal)
        grads = cudnn.backward(dout, q, k, v, ref_out.detach().to(q.dtype), ref_lse.float(), 0.3, causal)
        for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
            assert got.shape == want.shape and got.dtype == torch.bfloat16 and rel_err(got, want) < 3e-2
        assert cudnn_ops == [("forward", causal, sq, sk), ("backward", causal, sq, sk)]


def test_cudnn_hands_masked_and_unfit_tiles_to_aten_flash(cudnn_ops, aten_stand_in, monkeypatch):
    """Every mask case through the tiles planned for cudnn, exact: unmasked and diagonal tiles run on
    cuDNN, band and document tiles on aten's flash (windows and varlen as arguments), only block-sparse
    tiles as a dense bias (aten's efficient kernel, its stand-in); tiles cuDNN does not take (head dim
    over 128, fp32, one query) go to aten_flash as well."""
    sdpa_stand_in.install(monkeypatch)
    seen, cudnn_ran = set(), False
    for name, spec, _, dense_masks, calls in _mask_cases_through(cudnn, seed=5):
        assert (dense_masks > 0) == (spec.block_sparse is not None), name
        seen |= calls
        cudnn_ran |= bool(cudnn_ops)
        cudnn_ops.clear()
    assert WINDOWED_AND_VARLEN <= seen and cudnn_ran, seen
    handed = []
    monkeypatch.setattr(aten_flash, "forward", lambda *a: handed.append("forward") or "aten")
    monkeypatch.setattr(aten_flash, "backward", lambda *a: handed.append("backward") or "aten")
    wide, narrow = torch.randn(1, 8, 2, 192, dtype=torch.bfloat16), torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    single = narrow[:, :1]  # one query by one key: cuDNN's frontend refuses it (found at 4 ranks on an H200)
    one_query = (single, narrow, narrow)  # a "decode" tile, which newer torch refuses with some cuDNN on sm100
    unfit = ((wide, wide, wide), (narrow.float(),) * 3, (narrow, narrow, narrow[..., :8]), (single,) * 3, one_query)
    for q, k, v in unfit:
        assert cudnn.forward(q, k, v, 1.0, False) == "aten"
        assert cudnn.backward(q, q, k, v, q, None, 1.0, False) == "aten"
    assert handed == ["forward", "backward"] * len(unfit) and not cudnn_ops
    assert cudnn.handles(narrow, single, single, True, None)  # one key, several queries: cuDNN's


def test_cudnn_runs_windows_and_documents_as_its_triangles(cudnn_ops, aten_stand_in, monkeypatch):
    """A causal window that divides the tile, and documents, planned for cudnn with its TRIANGLE_ROWS (here
    small): every call is cuDNN's causal path (a reversed triangle as the causal tile of both runs
    reversed), none FlashAttention-2's; forward and backward exact against float64 on the dense mask."""
    from burst.call import AttentionCall
    from burst.layout import Segment
    from burst.masks import MaskSpec

    monkeypatch.setattr(cudnn, "TRIANGLE_ROWS", 8)
    torch.manual_seed(11)
    whole = [Segment(0, 48, 0)]
    for spec in (MaskSpec(causal=True, window=(8, 0)), MaskSpec(causal=True, cu_seqlens=(0, 8, 30, 48))):
        tiles = AttentionCall(None, 0, 1, "contiguous", 0, spec, 0.25, cudnn).plan(whole, whole)
        q64, k64, v64, dout64, ref_out, ref_lse = _float64_case(whole, whole, spec, 0.25)
        q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
        flash_stand_in.CALLS.clear()
        cudnn_ops.clear()
        out, lse, grads = _through_tiles(cudnn, tiles, q, k, v, dout, ref_out, ref_lse, 0.25)
        assert rel_err(out, ref_out) < 2e-2 and lse_error(lse, ref_lse) < 5e-2, spec
        for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
            assert rel_err(got, want) < 3e-2, spec
        assert not flash_stand_in.CALLS and cudnn_ops and all(causal for _, causal, _, _ in cudnn_ops), cudnn_ops
        assert len(cudnn_ops) == 2 * len(tiles) == 2 * (11 if spec.window else 3), (spec, cudnn_ops)


@pytest.mark.parametrize(
    "broken", ["lse_without_its_last_dim", "dout_in_other_strides", "no_lengths", "sequence_as_heads"]
)
def test_the_cudnn_stand_in_fails_a_broken_adapter(cudnn_ops, monkeypatch, broken):
    """The stand-in is a check, not a mirror: each rule the adapter keeps, broken, fails the call (or,
    for a layout the ops cannot tell from the right one, the result)."""
    q, k, dout = (torch.randn(1, 32, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    out, lse = cudnn.forward(q, k, k, 0.25, True)
    real = cudnn._backward_op
    if broken == "lse_without_its_last_dim":
        monkeypatch.setattr(cudnn, "_backward_op", lambda *a, **kw: real(*a[:5], a[5].squeeze(-1), *a[6:], **kw))
    elif broken == "dout_in_other_strides":
        monkeypatch.setattr(cudnn, "_backward_op", lambda *a, **kw: real(a[0].contiguous(), *a[1:], **kw))
    elif broken == "no_lengths":
        monkeypatch.setattr(cudnn, "_backward_op", lambda *a, **kw: real(*a[:11], None, None, *a[13:], **kw))
    else:  # burst's (b, s, h, d) handed on as if it were (b, h, s, d): the ops cannot tell, the result can
        monkeypatch.setattr(cudnn, "_heads_first", lambda x: x.contiguous())
        try:
            wrong, _ = cudnn.forward(q, k, k, 0.25, True)
        except RuntimeError as err:  # the lse, (b, s, h, 1) here, does not fit (b, h, s): the call fails
            assert "shape" in str(err)
            return
        want, _ = reference_attention(q.double(), k.double(), k.double(), 0.25, causal=True)
        assert wrong.shape != want.shape or rel_err(wrong, want) > 0.1
        return
    with pytest.raises(AssertionError):
        cudnn.backward(dout, q, k, k, out, lse, 0.25, True)


# --- masks as kernel arguments: the planner's band and varlen tiles through the adapter --------------


def _mask_cases():
    """(name, query runs, key runs, spec): causal off the diagonal, windows, documents, striped runs."""
    from burst.layout import Segment
    from burst.masks import BlockSparseMask, MaskSpec

    docs = (0, 40, 52, 90, 128)
    layout = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    return [
        (
            "causal, keys before and across the queries",
            [Segment(0, 64, 64)],
            [Segment(0, 96, 16)],
            MaskSpec(causal=True),
        ),
        ("causal, queries shorter than keys", [Segment(0, 24, 40)], [Segment(0, 64, 0)], MaskSpec(causal=True)),
        ("sliding window", [Segment(0, 64, 64)], [Segment(0, 128, 0)], MaskSpec(causal=True, window=(20, 0))),
        ("two-sided window", [Segment(0, 64, 32)], [Segment(0, 128, 0)], MaskSpec(window=(9, 13))),
        ("documents, causal", [Segment(0, 64, 32)], [Segment(0, 96, 0)], MaskSpec(causal=True, cu_seqlens=docs)),
        (
            "documents, window",
            [Segment(0, 96, 32)],
            [Segment(0, 128, 0)],
            MaskSpec(causal=True, window=(7, 0), cu_seqlens=docs),
        ),
        ("documents, full", [Segment(0, 64, 40)], [Segment(0, 128, 0)], MaskSpec(cu_seqlens=docs)),
        ("striped causal", [Segment(0, 32, 1, 4)], [Segment(0, 32, 3, 4)], MaskSpec(causal=True)),
        (
            "striped window and documents",
            [Segment(0, 32, 2, 4)],
            [Segment(0, 32, 0, 4)],
            MaskSpec(causal=True, window=(17, 0), cu_seqlens=docs),
        ),
        (
            "block-sparse",
            [Segment(0, 64, 64)],
            [Segment(0, 128, 0)],
            MaskSpec(block_sparse=BlockSparseMask(32, layout)),
        ),
    ]


def _float64_case(q_segs, k_segs, spec, scale, batch=2, heads=4, kv_heads=2, dim=16, softcap=0.0):
    """q, k, v, dout of a tile case in float64 and float64 attention on the dense mask of their positions:
    (q, k, v, dout, ref_out, ref_lse), with the reference gradients in q.grad, k.grad, v.grad."""
    sq, sk = sum(s.length for s in q_segs), sum(s.length for s in k_segs)
    q = torch.randn(batch, sq, heads, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, sk, kv_heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(batch, sq, heads, dim, dtype=torch.float64)
    allowed = spec.allowed(torch.cat([s.positions() for s in q_segs]), torch.cat([s.positions() for s in k_segs]))
    ref_out, ref_lse = reference_attention(q, k, v, scale, mask=allowed, softcap=softcap)
    ref_out.backward(dout)
    return q, k, v, dout, ref_out.detach(), ref_lse.detach()


def _through_tiles(kernel, tiles, q, k, v, dout, ref_out, ref_lse, scale):
    """The tiles through attend_forward (merged into float32 accumulators) and attend_backward (with
    the reference's global out and lse, as a ring step has them): out, lse, [dq, dk, dv]."""
    from burst.kernels.accumulators import empty_accumulators, lse_for_backward
    from burst.kernels.attend import attend_backward, attend_forward

    out_acc, lse_acc = empty_accumulators(q)
    attend_forward(kernel, q, k, v, tiles, out_acc, lse_acc, scale)
    grads = [torch.zeros(t.shape, dtype=out_acc.dtype) for t in (q, k, v)]
    attend_backward(
        kernel, dout, q, k, v, ref_out.to(q.dtype), lse_for_backward(ref_lse.to(lse_acc.dtype)), tiles, *grads, scale
    )
    return out_acc, lse_acc, grads


def _mask_cases_through(kernel, seed: int):
    """Every mask case of _mask_cases through the tiles planned for `kernel`, asserted exact against float64
    attention on the dense mask of the same positions; per case: (name, spec, tiles, dense masks built,
    the flash stand-in's calls as (function, windowed, sequences > 1))."""
    from burst.call import AttentionCall
    from burst.comm.stats import CommStats

    torch.manual_seed(seed)
    scale = 0.25
    for name, q_segs, k_segs, spec in _mask_cases():
        tiles = AttentionCall(None, 0, 1, "contiguous", 0, spec, scale, kernel).plan(q_segs, k_segs)
        q64, k64, v64, dout64, ref_out, ref_lse = _float64_case(q_segs, k_segs, spec, scale)
        q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
        flash_stand_in.CALLS.clear()
        with CommStats() as stats:
            out_acc, lse_acc, grads = _through_tiles(kernel, tiles, q, k, v, dout, ref_out, ref_lse, scale)
        assert rel_err(out_acc, ref_out) < 2e-2 and lse_error(lse_acc, ref_lse) < 5e-2, (
            name
        )  # bf16 lse near 5: ulp 0.03
        for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
            assert rel_err(got, want) < 3e-2, name
        calls = {(kind, n > 1, (wl, wr) != (-1, -1)) for kind, wl, wr, n in flash_stand_in.CALLS}
        yield name, spec, tiles, stats.dense_masks(), calls


# The cases reach the window arguments and the varlen interface with several sequences, forward and backward.
WINDOWED_AND_VARLEN = {
    ("forward", False, True),
    ("varlen_forward", True, True),
    ("backward", False, True),
    ("varlen_backward", True, True),
}


def test_band_and_varlen_tiles_are_exact_and_build_no_dense_mask(stand_in, flex_stand_in):
    """Every mask burst plans, through the tiles planned for flash_attn, exact; block-sparse tiles go
    whole, as rules, to FlexAttention (the stand-in), and nothing builds a dense bias."""
    from burst.masks import Cover

    seen = set()
    flex_stand_in.CALLS.clear()
    for name, spec, tiles, dense_masks, calls in _mask_cases_through(cuda_flash_attn, seed=1):
        assert dense_masks == 0 and all(t.cover is not Cover.PARTIAL for t in tiles), name
        if spec.block_sparse is None:
            assert calls, name
        else:
            assert any(t.cover is Cover.RULE for t in tiles) and flex_stand_in.CALLS, name
        seen |= calls
        flex_stand_in.CALLS.clear()  # the next case's calls only
    assert WINDOWED_AND_VARLEN <= seen, seen


@pytest.mark.parametrize("padded_lse", [False, True], ids=["lse_h_total", "lse_padded"])
def test_aten_flash_takes_band_and_varlen_tiles_as_arguments(aten_stand_in, monkeypatch, padded_lse):
    """The same masks through aten's flash ops (the stand-in): exact, windows and documents as
    arguments, only a block-sparse tile as a dense bias for aten's efficient kernel (its stand-in),
    whichever varlen lse layout the build returns."""
    aten_stand_in(padded_lse)
    sdpa_stand_in.install(monkeypatch)
    seen = set()
    for name, spec, _, dense_masks, calls in _mask_cases_through(aten_flash, seed=2):
        assert (dense_masks > 0) == (spec.block_sparse is not None), name
        seen |= calls
    assert WINDOWED_AND_VARLEN <= seen, seen


def test_bands_flash_attn_would_misread_run_as_calls_it_reads_right():
    """FlashAttention-2 makes a window size >= max_seqlen_k unbounded, then one unbounded side beside a
    bound max_seqlen_k wide (the stand-in's _fa2_windows). Where that changes a band's mask
    (flash_misreads), flash_parts gives calls it reads as meant (one per sequence, in row pieces of at
    most sk + 1 rows): their masks as flash reads them, put in place, are the bands' own mask."""
    from burst.masks import Bands

    cases = [
        ((0, 96), (0, 32), 0, -1, True),  # the H200's failure: row 0 would see no key instead of all
        ((0, 64), (0, 32), -1, 32, True),  # right 32 read as unbounded, but it bounds rows 0..30
        ((0, 64), (0, 32), -1, 63, False),  # every row sees every key anyway
        ((0, 32), (0, 32), 0, -1, False),  # square: max_seqlen_k wide is unbounded
        ((0, 33), (0, 32), 5, -1, False),  # one more query than keys: still as meant
        ((0, 200), (0, 17), 3, 190, True),  # 12 pieces; row 0 sees keys 0..7
        ((0, 20, 100), (0, 10, 40), 2, -1, True),  # varlen: the second document, 80 x 30, misread
        ((0, 20, 50), (0, 30, 60), 2, -1, False),
    ]  # varlen: fewer queries than keys in each
    for cu_q, cu_k, left, right, misread in cases:
        bands = Bands(cu_q, cu_k, left, right)
        assert bands.flash_misreads() == misread, (cu_q, cu_k, left, right)
        max_q, max_k = bands.max_rows
        as_read_whole = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
        for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
            as_read_whole[q0:q1, k0:k1] = flash_stand_in._band(q1 - q0, k1 - k0, False, left, right, max_k)
        assert torch.equal(as_read_whole, bands.allowed()) != misread, (cu_q, cu_k, left, right)
        parts = bands.flash_parts()
        if not misread:  # one call, as it is
            assert parts == [(0, cu_q[-1], 0, cu_k[-1], bands)]
            continue
        as_read = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
        for a, b, c, d, part in parts:
            assert part.sequences == 1 and not part.flash_misreads()
            as_read[a:b, c:d] = flash_stand_in._band(b - a, d - c, False, part.left, part.right)
        assert torch.equal(as_read, bands.allowed()) and len(parts) > 1, (cu_q, cu_k, left, right)


def test_misread_bands_are_exact_through_both_flash_libraries(stand_in, aten_stand_in):
    """Bands flash would misread (one sequence, several), forward and backward through cuda_flash_attn
    and aten_flash, against float64 attention on the bands' own mask; GQA; flash ran every part."""
    from burst.masks import Bands

    torch.manual_seed(3)
    for cu_q, cu_k, left, right in (
        ((0, 96), (0, 32), 0, -1),
        ((0, 64), (0, 32), -1, 32),
        ((0, 70), (0, 20), 4, 60),
        ((0, 20, 100), (0, 10, 40), 2, -1),
    ):
        bands = Bands(cu_q, cu_k, left, right)
        q64, dout64 = (torch.randn(2, cu_q[-1], 4, 16, dtype=torch.float64) for _ in range(2))
        k64, v64 = (torch.randn(2, cu_k[-1], 2, 16, dtype=torch.float64) for _ in range(2))
        for t in (q64, k64, v64):
            t.requires_grad_()
        ref_out, ref_lse = reference_attention(q64, k64, v64, 0.25, mask=bands.allowed())
        ref_out.backward(dout64)
        q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
        for kernel in (cuda_flash_attn, aten_flash):
            flash_stand_in.CALLS.clear()
            out, lse = kernel.forward(q, k, v, 0.25, False, bands)
            assert rel_err(out, ref_out) < 2e-2 and lse_error(lse, ref_lse) < 5e-2, (kernel.__name__, cu_q, left, right)
            grads = kernel.backward(dout, q, k, v, ref_out.detach().to(q.dtype), ref_lse.float(), 0.25, False, bands)
            for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
                assert got.shape == want.shape and rel_err(got, want) < 3e-2, (kernel.__name__, cu_q, left, right)
            assert len(flash_stand_in.CALLS) == 2 * len(bands.flash_parts()) > 2  # flash ran every part


def test_band_window_sizes_follow_flash_attns_corner():
    """The window of a band tile in flash_attn's convention (bottom-right corner), from positions."""
    from burst.layout import Segment
    from burst.masks import Cover, MaskSpec, TileSizes, plan_tiles

    sizes = TileSizes(max_rows=4096, bands=True)
    # Queries 100..163 against keys 0..127, causal: the corner pairs query 163 with key 127, and that
    # query sees 36 keys past the corner's diagonal (it would see up to 163): window right 36.
    (tile,) = plan_tiles([Segment(0, 64, 100)], [Segment(0, 128, 0)], MaskSpec(causal=True), sizes)
    assert tile.cover is Cover.BAND and (tile.bands.left, tile.bands.right) == (-1, 36)
    (tile,) = plan_tiles([Segment(0, 64, 64)], [Segment(0, 128, 0)], MaskSpec(causal=True), sizes)
    assert tile.cover is Cover.BAND and (tile.q.length, tile.k.length) == (64, 128)
    assert (tile.bands.left, tile.bands.right) == (-1, 0)  # non-square causal: the corner is the diagonal
    # Keys 0..127 against queries 0..63: keys 64.. are never seen and are trimmed off; square causal.
    (tile,) = plan_tiles([Segment(0, 64, 0)], [Segment(0, 128, 0)], MaskSpec(causal=True), sizes)
    assert tile.cover is Cover.DIAG and tile.k.length == 64
    # A window of 20 back from each query: left 20, right 0.
    (tile,) = plan_tiles([Segment(0, 64, 64)], [Segment(0, 128, 0)], MaskSpec(causal=True, window=(20, 0)), sizes)
    assert tile.cover is Cover.BAND and (tile.bands.left, tile.bands.right) == (20, 0)
    assert (tile.q.length, tile.k.length, tile.k.first) == (64, 84, 44)  # keys before 44 are trimmed off


# --- FlexAttention (kernels/flex.py): any mask as a rule, the backward from the global out and lse -----


def _flex_call(spec, max_rows, bands=False):
    """An AttentionCall whose kernel is flex with small calls (a row's tiles merge); bands: planned as
    for flash_attn too, so that flex gets band and varlen tiles (flash_attn's fallback hands it those)."""
    from burst.call import AttentionCall

    class Kernel:
        MAX_ROWS, RULES, BANDS = max_rows, True, bands
        forward, backward = staticmethod(flex.forward), staticmethod(flex.backward)

    return AttentionCall(None, 0, 1, "contiguous", 0, spec, 0.25, Kernel)


def test_flex_backward_from_the_global_out_and_lse_is_exact(flex_stand_in):
    """In float64 the weighted-gradient backward equals autograd through attention on the whole mask
    (1e-10), for every mask kind, tiles merging across several kernel calls per row, GQA."""
    from burst.comm.stats import CommStats
    from burst.masks import Cover

    torch.manual_seed(2)
    rules, bands = 0, 0
    for (name, q_segs, k_segs, spec), with_bands in itertools.product(_mask_cases(), (False, True)):
        call = _flex_call(spec, max_rows=32, bands=with_bands)
        tiles = call.plan(q_segs, k_segs)
        q, k, v, dout, ref_out, ref_lse = _float64_case(q_segs, k_segs, spec, 0.25)
        with CommStats() as stats:
            out, lse, grads = _through_tiles(
                call.kernel, tiles, *(t.detach() for t in (q, k, v)), dout, ref_out, ref_lse, 0.25
            )
        assert rel_err(out, ref_out) < 1e-10 and lse_error(lse, ref_lse) < 1e-10, name
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            assert rel_err(got, want) < 1e-10, name
        assert stats.dense_masks() == 0 and all(t.cover is not Cover.PARTIAL for t in tiles), name
        rules += sum(t.cover is Cover.RULE for t in tiles)
        bands += sum(t.cover is Cover.BAND and t.bands.sequences > 1 for t in tiles)
    assert rules > 10 and bands > 2  # the masks reached the kernel as rules, and as varlen bands


def test_flex_forward_matches_float64_with_torchs_own_flex_attention():
    """The real flex_attention (eager, on the CPU: forward only) with the rules' mask_mods and block masks."""
    flex._compiled.cache_clear()
    flex._BLOCK_MASKS.clear()
    torch.manual_seed(3)
    b, h, hk, d = 1, 4, 2, 16
    for (name, q_segs, k_segs, spec), with_bands in itertools.product(_mask_cases(), (False, True)):
        call = _flex_call(spec, max_rows=64, bands=with_bands)
        tiles = call.plan(q_segs, k_segs)
        sq, sk = sum(s.length for s in q_segs), sum(s.length for s in k_segs)
        q = torch.randn(b, sq, h, d)
        k, v = (torch.randn(b, sk, hk, d) for _ in range(2))
        allowed = spec.allowed(torch.cat([s.positions() for s in q_segs]), torch.cat([s.positions() for s in k_segs]))
        ref_out, ref_lse = reference_attention(q, k, v, 0.25, mask=allowed)
        from burst.kernels.accumulators import empty_accumulators
        from burst.kernels.attend import attend_forward

        out, lse = empty_accumulators(q)
        attend_forward(call.kernel, q, k, v, tiles, out, lse, 0.25)
        assert rel_err(out, ref_out) < 1e-5 and lse_error(lse, ref_lse) < 1e-5, name


def test_compiled_flex_traces_one_graph_a_grad_mode_for_every_tile_kind(monkeypatch):
    """torch.compile'd flex_attention as kernels/flex.py compiles it on CUDA, here with dynamo's eager
    backend (the CPU has no compiled FlexAttention with lse) and FlexAttention's CPU backward unlocked.
    Dynamo's guards, which decide when it traces again, are the backend's choice of none of it. Every
    mask kind's tiles (rules, bands, causal triangles, whole tiles), with and without softcap, forward
    and backward: exact against float64, and at most two graphs each for the forward (no grad) and the
    backward's recompute (grad): the first shape, then one for all shapes (dynamo's automatic dynamic
    shapes). On an H200 a mask_mod per tile kind, with Python ints for its windows, retraced until
    dynamo's recompile limit (8) sent flex_attention to its unfused path, 30-50x slower."""
    import torch._dynamo
    from burst.kernels.softcap import Softcapped
    from torch._dynamo.utils import counters
    from torch.nn.attention import flex_attention as flex_module

    compiled = flex._compile(backend="eager")
    monkeypatch.setattr(flex, "_compiled", lambda device_type: compiled)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)
    flex._BLOCK_MASKS.clear()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(4)
    for softcap in (0.0, 3.0):
        for (name, q_segs, k_segs, spec), with_bands in itertools.product(_mask_cases(), (False, True)):
            call = _flex_call(spec, max_rows=32, bands=with_bands)
            kernel = call.kernel
            if softcap:
                kernel = Softcapped(type("Capped", (kernel,), {"SOFTCAP": True}), softcap)
            q, k, v, dout, ref_out, ref_lse = _float64_case(q_segs, k_segs, spec, 0.25, softcap=softcap)
            out, lse, grads = _through_tiles(
                kernel, call.plan(q_segs, k_segs), *(t.detach() for t in (q, k, v)), dout, ref_out, ref_lse, 0.25
            )
            assert rel_err(out, ref_out) < 1e-10 and lse_error(lse, ref_lse) < 1e-10, (name, softcap)
            for got, want in zip(grads, (q.grad, k.grad, v.grad)):
                assert rel_err(got, want) < 1e-10, (name, softcap)
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 2 * 2 * 2, graphs  # (forward, backward) x (first shape, dynamic) x (softcap or not): 6 here
    flex._BLOCK_MASKS.clear()


def test_a_one_rank_call_that_fits_one_tile_is_one_kernel_call(monkeypatch):
    """One rank, the shard one tile of its kernel: the kernel's out, lse and gradients are the call's,
    with no float32 accumulator or merge (strategies/ring.one_call); exact against float64."""
    import burst
    from burst.strategies import ring

    def no_accumulators(*args):
        raise AssertionError("a one-call shard allocated float32 accumulators")

    monkeypatch.setattr(ring, "empty_accumulators", no_accumulators)
    monkeypatch.setattr(ring, "accumulator_zeros_like", no_accumulators)
    torch.manual_seed(6)
    for strategy, kv_heads in (("burst", 2), ("ring", 4), ("burst", 4)):
        q, dout = (torch.randn(2, 96, 4, 16, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, 96, kv_heads, 16, dtype=torch.float64) for _ in range(2))
        q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = reference_attention(q64, k64, v64, 0.25)
        ref_out.backward(dout)
        qq, kk, vv = (t.clone().float().requires_grad_() for t in (q, k, v))
        out, lse = burst.attention(qq, kk, vv, strategy=strategy, softmax_scale=0.25, return_lse=True)
        out.backward(dout.float())
        assert out.is_contiguous() and out.dtype == torch.float32 and lse.dtype == torch.float32
        assert rel_err(out, ref_out) < 1e-5 and lse_error(lse, ref_lse) < 1e-5
        for got, want in zip((qq.grad, kk.grad, vv.grad), (q64.grad, k64.grad, v64.grad)):
            assert rel_err(got, want) < 1e-5, strategy


@pytest.mark.parametrize("native", [True, False], ids=["gqa_native", "kv_heads_repeated"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cpu_flash_grouped_heads_match_float64(monkeypatch, native, kv_heads):
    """cpu_flash on grouped heads, through the op's own GQA (torch from cpu_flash.GQA_FROM) and through
    the KV heads repeated for an older op (which would read past fewer heads' storage): out, lse and
    dq, dk, dv against float64 attention, causal and under a dense mask, the gradients from the rows'
    global out and lse as a ring step hands them."""
    from burst.kernels import cpu_flash

    monkeypatch.setattr(cpu_flash, "GQA_NATIVE", native and cpu_flash.GQA_NATIVE)
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 20, kv_heads, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(24, 20, generator=g) < 0.7
    for causal, tile_mask in ((True, None), (False, mask)):
        allowed = torch.ones(24, 20, dtype=torch.bool).tril() if causal else tile_mask
        ref_out, ref_lse = reference_attention(q, k, v, 0.3, mask=allowed)
        want = torch.autograd.grad(ref_out, (q, k, v), dout)
        out, lse = cpu_flash.forward(q.detach(), k.detach(), v.detach(), 0.3, causal, tile_mask)
        got = cpu_flash.backward(
            dout, q.detach(), k.detach(), v.detach(), ref_out.detach(), ref_lse.detach(), 0.3, causal, tile_mask
        )
        assert rel_err(out, ref_out) < 1e-10 and lse_error(lse, ref_lse) < 1e-10
        for grad, ref in zip(got, want):
            assert grad.shape == ref.shape and rel_err(grad, ref) < 1e-10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_rebuilt_from_delta_gives_the_kernels_delta_to_float32s_precision(dtype):
    """The queries-side backward hands kernels a stand-in for out built from D = rowsum(dO * O) alone: the
    rowsum the kernel takes of it (float32 sums of half-precision products) must be D to float32's precision,
    not to dtype's: with very large scores dS = P * (dP - D) cancels, and D off by 2^-9 of itself made the
    gradients several times further from float64 than the real out does. Its entries stay within a few
    times out's largest (no overflow in fp16), also for a D that is not a rowsum of dtype's numbers."""
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(2, 64, 4, 32, generator=g).to(dtype)
    dout[0, 0, 0] = 0  # a row with no gradient
    dout[0, 1, 0, 1:] = 0  # one nonzero entry
    dout[0, 2, 0, 1:] = 1e-6  # the second largest entry far smaller than the first
    out = torch.randn(2, 64, 4, 32, generator=g) * 8
    for out_in in (out.to(dtype), out):  # the strategies' D comes from out in dtype
        stand_in = kernels.out_from_delta(dout, kernels.row_delta(dout, out_in))
        assert stand_in.dtype == dtype and torch.isfinite(stand_in).all()
        assert stand_in.abs().amax() <= 4 * out.abs().amax()
    out_in = out.to(dtype)
    delta = kernels.row_delta(dout, out_in)
    rebuilt = kernels.row_delta(dout, kernels.out_from_delta(dout, delta))
    # float32's rounding of a 32-term sum, against the norms (D itself may be small by cancellation)
    norms = (dout.float().norm(dim=-1) * out_in.float().norm(dim=-1)).transpose(1, 2)
    assert ((rebuilt - delta).abs() <= 1e-5 * norms).all()


def test_large_scores_backward_from_delta_matches_the_real_out():
    """One bf16 tile at scores ~1e3 (queries and keys of norm ~60): cpu_flash's gradients from the stand-in
    are as far from float64 as those from the real out (they were 1.2-1.5x further before the stand-in
    carried D exactly)."""
    from burst.kernels import cpu_flash

    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(1, 256, 4, 16, generator=g) * 15).bfloat16() for _ in range(2))
    v, dout = (torch.randn(1, 256, 4, 16, generator=g).bfloat16() for _ in range(2))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    exact = torch.autograd.grad(reference_attention(*leaves, scale=0.25, causal=True)[0], leaves, dout.double())
    out, lse = cpu_flash.forward(q, k, v, 0.25, True)
    delta = kernels.row_delta(dout, out)
    real = cpu_flash.backward(dout, q, k, v, out, lse, 0.25, True)
    rebuilt = cpu_flash.backward(dout, q, k, v, kernels.out_from_delta(dout, delta), lse, 0.25, True)
    for a, b, x in zip(real, rebuilt, exact):
        assert (b.double() - x).abs().amax() <= 1.05 * (a.double() - x).abs().amax()


def test_cpu_flash_runs_a_float16_tile_in_float32_and_hands_back_float16(monkeypatch):
    """aten's CPU op has no half arithmetic on most CPUs (~12x float32's time): cpu_flash computes a float16 tile
    in float32. Its results are float16, within float16's rounding of float64 attention, and the op is never
    handed float16."""
    from burst.kernels import cpu_flash

    seen = []
    for name in ("_forward_op", "_backward_op"):
        op = getattr(cpu_flash, name)
        monkeypatch.setattr(cpu_flash, name, lambda *a, _op=op, **kw: seen.append(a[0].dtype) or _op(*a, **kw))
    torch.manual_seed(0)
    q64, dout64 = (torch.randn(1, 40, 4, 16, dtype=torch.float64) for _ in range(2))
    k64, v64 = (torch.randn(1, 40, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    q64.requires_grad_()
    ref_out, ref_lse = reference_attention(q64, k64, v64, causal=True)
    ref_out.backward(dout64)
    q, k, v, dout = (t.detach().half() for t in (q64, k64, v64, dout64))
    out, lse = cpu_flash.forward(q, k, v, 16**-0.5, True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < 2e-3 and rel_err(lse, ref_lse) < 1e-3
    grads = cpu_flash.backward(dout, q, k, v, out, lse, 16**-0.5, True)
    for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert got.dtype == torch.float16 and got.shape == want.shape and rel_err(got, want) < 5e-3
    assert seen == [torch.float32, torch.float32]


def test_half_precision_chunks_keep_the_kernels_floor():
    """The chunk stream's default chunk is an eighth of the shard within [MIN_CHUNK_ROWS, the kernel's calls],
    raised to the kernel's floor for the dtype (cpu_flash's bf16: 2048 rows, two of its calls): small bf16
    chunks ran 1.1-1.4x ring's backward (benchmarks/small_shards.md)."""
    from burst.kernels import cpu_flash
    from burst.schedules.chunk_stream import default_chunk_rows

    floor = cpu_flash.MIN_CHUNK_ROWS_BY_DTYPE
    assert default_chunk_rows(4096, cpu_flash.MAX_ROWS, floor.get(torch.float32, 0)) == 512
    assert default_chunk_rows(4096, cpu_flash.MAX_ROWS, floor.get(torch.bfloat16, 0)) == 2048
    assert default_chunk_rows(1 << 16, cpu_flash.MAX_ROWS, floor.get(torch.bfloat16, 0)) == 2048
    assert default_chunk_rows(1 << 16, cpu_flash.MAX_ROWS) == cpu_flash.MAX_ROWS
