"""The flash_attn adapter (kernels/cuda_flash_attn.py) and backend dispatch, in one process.

flash_attn needs a GPU, so its interface is played by a stand-in module with flash_attn 2.6+'s
signatures that computes in float64 from the values it is given (including the global out and lse
in the backward). This checks our side of the contract: layout, argument order, lse shape, GQA,
gradients written into the buffers we pass, and which tiles go to SDPA instead. It does not check
flash_attn itself (see benchmarks/README.md for what has run on a GPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from burst import kernels
from burst.kernels import cuda_flash_attn, cuda_sdpa
from burst.kernels.reference import attention as reference_attention

from cases import rel_err


def _stand_in_interface():
    def scores(q, k, scale, causal):
        group = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(group, 2)) * scale
        if causal:  # flash_attn aligns the causal mask bottom-right
            sq, sk = q.shape[1], k.shape[1]
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
        return s, group

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        assert (dropout_p, window_size_left, window_size_right, softcap, alibi_slopes) == (0.0, -1, -1, 0.0, None)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        s, group = scores(q, k, softmax_scale, causal)
        lse = torch.logsumexp(s, -1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v.double().repeat_interleave(group, 2))
        return out.to(q.dtype), lse.float(), torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state):
        assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        s, group = scores(q, k, softmax_scale, causal)
        p = torch.exp(s - softmax_lse.double()[..., None])
        vv = v.double().repeat_interleave(group, 2)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout.double(), vv)
        delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)[..., None]
        ds = p * (dp - delta) * softmax_scale
        b, sk, hk, d = k.shape
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, k.double().repeat_interleave(group, 2)))
        dk.copy_(torch.einsum("bhqk,bqhd->bkhd", ds, q.double()).reshape(b, sk, hk, group, d).sum(3))
        dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, dout.double()).reshape(b, sk, hk, group, d).sum(3))
        return torch.empty(0)

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = _flash_attn_forward
    interface._flash_attn_backward = _flash_attn_backward
    package = types.ModuleType("flash_attn")
    package.flash_attn_interface = interface
    return package, interface


@pytest.fixture
def stand_in(monkeypatch):
    package, interface = _stand_in_interface()
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    cuda_flash_attn.available.cache_clear()
    yield
    cuda_flash_attn.available.cache_clear()


def test_flash_attn_adapter_matches_float64_attention(stand_in):
    torch.manual_seed(0)
    b, s, d = 2, 48, 16
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
        for causal in (False, True):
            q64, dout64 = torch.randn(b, s, heads, d, dtype=torch.float64), torch.randn(b, s, heads, d, dtype=torch.float64)
            k64, v64 = (torch.randn(b, s, kv_heads, d, dtype=torch.float64) for _ in range(2))
            q64.requires_grad_(), k64.requires_grad_(), v64.requires_grad_()
            ref_out, ref_lse = reference_attention(q64, k64, v64, causal=causal)
            ref_out.backward(dout64)
            q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q64, k64, v64, dout64))
            out, lse = cuda_flash_attn.forward(q, k, v, d ** -0.5, causal)
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (b, heads, s)
            assert rel_err(out, ref_out) < 2e-2 and rel_err(lse, ref_lse) < 1e-2
            # The backward gets the global out and lse, as in a ring step.
            grads = cuda_flash_attn.backward(dout, q, k, v, ref_out.detach().to(q.dtype), ref_lse.float(), d ** -0.5, causal)
            for got, want in zip(grads, (q64.grad, k64.grad, v64.grad)):
                assert got.shape == want.shape and got.dtype == torch.bfloat16
                assert rel_err(got, want) < 3e-2, (heads, kv_heads, causal)


def test_flash_attn_hands_what_it_cannot_do_to_sdpa(stand_in, monkeypatch):
    handed = []
    monkeypatch.setattr(cuda_sdpa, "forward", lambda *a: handed.append("forward") or "sdpa")
    monkeypatch.setattr(cuda_sdpa, "backward", lambda *a: handed.append("backward") or "sdpa")
    q, k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16), torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    odd = torch.randn(1, 8, 2, 12, dtype=torch.bfloat16)
    cases = [(q, k, False, mask),                        # a partial tile needs a mask
             (q, k[:, :4], True, None),                  # causal but not square: alignment differs
             (odd, odd, False, None),                    # head dim not a multiple of 8
             (q.float(), k.float(), False, None)]        # float32
    for qq, kk, causal, m in cases:
        assert cuda_flash_attn.forward(qq, kk, kk, 1.0, causal, m) == "sdpa"
        assert cuda_flash_attn.backward(qq, qq, kk, kk, qq, None, 1.0, causal, m) == "sdpa"
    assert handed == ["forward", "backward"] * len(cases)
    out, _ = cuda_flash_attn.forward(q, k, k, 1.0, True, None)  # square causal, no mask: flash_attn's
    assert out.shape == q.shape


def test_dispatch_by_device_and_dtype(stand_in, monkeypatch):
    cuda = torch.device("cuda")
    assert kernels.select_kernel(torch.device("cpu"), torch.bfloat16) is kernels.cpu_flash
    assert kernels.select_kernel(cuda, torch.bfloat16) is cuda_flash_attn
    assert kernels.select_kernel(cuda, torch.float16) is cuda_flash_attn
    assert kernels.select_kernel(cuda, torch.float32) is cuda_sdpa
    assert kernels.select_kernel(cuda, torch.float64) is kernels.reference
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    cuda_flash_attn.available.cache_clear()
    assert kernels.select_kernel(cuda, torch.bfloat16) is cuda_sdpa
