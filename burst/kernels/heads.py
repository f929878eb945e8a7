"""Grouped heads for an op that takes only as many KV heads as query heads (aten's efficient op; the CPU
flash op before torch 2.10): each KV head repeated for its group of query heads, and the repeated
heads' gradients summed back."""

from __future__ import annotations

import torch


def repeated_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, s, hk, d) k and v as (b, s, heads, d): KV head j serves query heads j*g .. j*g + g - 1."""
    group = heads // k.shape[2]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def summed_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A repeated KV head's gradient, (b, s, heads, d) -> (b, s, kv_heads, d): the sum over its group
    (torch's sum of half-precision tensors accumulates in float32 and rounds once)."""
    if grad.shape[2] == kv_heads:
        return grad
    return grad.unflatten(2, (kv_heads, grad.shape[2] // kv_heads)).sum(3)
