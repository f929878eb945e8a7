"""Sequence-parallel generation with the engine's model: prefill through burst, decode on a sharded cache.

Prefill: the prompts (right-padded to one length the layout can split) are sharded by the layout;
each layer's attention runs through burst.attention over the group, and each rank keeps the K, V
of its own prompt tokens in a ShardedKVCache (padding is marked invalid). The hidden state of each
prompt's last real token is shared with one all-reduce, so every rank computes the same logits.
Decode: the new token's query is on every rank; its K, V go to one rank in turn; decode_attention
merges the ranks' partial results exactly. Greedy or sampled (temperature, top-p, a seeded
generator identical on every rank), so all ranks emit the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import api
from ..comm.membership import group_size
from ..engine.model import Transformer, rotary
from ..layout import local_multiple, shard
from .cache import ShardedKVCache
from .decode import agree_on_decoding, decode_attention, decode_exchange


@dataclass
class Generated:
    tokens: list[list[int]]  # the new tokens of each prompt
    prefill_s: float  # time to the first token
    decode_s_per_token: float
    cache_bytes_per_rank: int


def check_request(prompts, new_tokens: int, max_seq_len: int) -> None:
    """Raise ValueError for a request no rank can serve (before any collective)."""
    if new_tokens <= 0:
        raise ValueError(f"new tokens must be positive, got {new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > max_seq_len:
        raise ValueError(
            f"a prompt of {longest} tokens plus {new_tokens} new ones exceeds the model's "
            f"{max_seq_len} positions (max_seq_len)"
        )


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """(batch, vocab) float32 logits -> (batch,) tokens: argmax, or a seeded top-p sample."""
    if temperature <= 0 or gen is None:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest set whose mass reaches top_p
    sorted_p = sorted_p * keep
    weights = (sorted_p / sorted_p.sum(-1, keepdim=True)).cpu()  # the seeded generator is a CPU one, on any device
    choice = torch.multinomial(weights, 1, generator=gen).squeeze(-1).to(logits.device)
    return order.gather(-1, choice[:, None]).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    new_tokens: int,
    group=None,
    strategy: str = "burst",
    layout: str = "contiguous",
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Generated:
    """Generate `new_tokens` tokens after each prompt, with the KV cache sharded over `group`."""
    check_request(prompts, new_tokens, model.cfg.max_seq_len)
    world = group_size(group)
    lengths = [len(p) for p in prompts]
    multiple = world * local_multiple(layout)
    padded_len = -(-max(lengths) // multiple) * multiple
    device = next(model.parameters()).device
    full = torch.zeros(len(prompts), padded_len, dtype=torch.long)
    for row, p in enumerate(prompts):
        full[row, : len(p)] = torch.tensor(p)
    full = full.to(device)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    cache = ShardedKVCache(layers=len(model.blocks), group=group, layout=layout)

    start = time.perf_counter()
    positions = cache.prefill_positions(lengths, padded_len, device)
    hidden = _prefill(model, shard(full, group=group, layout=layout), positions, cache, group, strategy, layout)
    last = last_hidden(hidden, positions, lengths, group)
    token = _next_token(model.lm_head(last).float(), temperature, top_p, gen)
    prefill_s = time.perf_counter() - start
    out = [[int(t)] for t in token]

    start = time.perf_counter()
    cfg = model.cfg
    # One check for the whole decode (its shapes do not change between tokens): each layer of each
    # token is then one collective, the merge's all-gather (through shared memory on one host).
    q_shape = (len(prompts), 1, cfg.heads, cfg.head_dim)
    agree_on_decoding(q_shape, last.dtype, cfg.kv_heads, cfg.head_dim**-0.5, group)
    exchange = decode_exchange(q_shape, last.dtype, last.device, group) if new_tokens > 1 else None
    first_new = torch.tensor(lengths, device=device)  # once: each step adds to it on the device
    for step in range(1, new_tokens):
        pos = first_new + step - 1  # the position of the token just produced
        hidden = _decode_step(model, token, pos, cache, group, exchange)
        token = _next_token(model.lm_head(hidden).float(), temperature, top_p, gen)
        for row, t in enumerate(token.tolist()):
            out[row].append(t)
    decode_s = (time.perf_counter() - start) / max(1, new_tokens - 1)
    return Generated(out, prefill_s, decode_s, cache.bytes())


def _prefill(model, tokens, positions, cache, group, strategy, layout):
    """The model over this rank's prompt shard, storing each layer's K, V in the cache."""
    cos, sin = rotary(positions, model.cfg.head_dim, model.cfg.rope_theta, model.cfg.rope_scaling)
    x = model.embed(tokens)
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attention.project(block.attention_norm(x), cos, sin)
        cache.store_prefill(layer, k, v)
        o = api.attention(q, k, v, group=group, strategy=strategy, layout=layout, causal=True)
        x = x + block.attention.wo(o.flatten(2))
        x = x + block.feed_forward(block.ffn_norm(x))
    return model.norm(x)


def last_hidden(hidden, positions, lengths, group) -> torch.Tensor:
    """(batch, dim): each prompt's last real token's hidden state, on every rank (one all-reduce:
    the rank holding it contributes it, the others zeros, so the sum is exact in any dtype).

    hidden: (batch, local_len, dim) this rank's shard; positions: (batch, local_len) their global
    positions; lengths: each row's prompt length. Also serves transformers' generate()
    (burst.integrations.transformers.generate).
    """
    mine = hidden.new_zeros(hidden.shape[0], hidden.shape[2])
    for row, n in enumerate(lengths):
        at = (positions[row] == n - 1).nonzero()
        if at.numel():
            mine[row] = hidden[row, at[0, 0]]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(mine, group=group)
    return mine


def _decode_step(model, token, positions, cache, group, exchange=None) -> torch.Tensor:
    """One new token per prompt through every layer; returns its hidden state (batch, dim)."""
    cos, sin = rotary(positions[:, None], model.cfg.head_dim, model.cfg.rope_theta, model.cfg.rope_scaling)
    x = model.embed(token[:, None])
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attention.project(block.attention_norm(x), cos, sin)
        cache.append(layer, k, v, positions)  # on the rank whose turn it is; attended from this layer on
        o = decode_attention(q, *cache.keys_values(layer), group=group, agreed=True, exchange=exchange)
        x = x + block.attention.wo(o.flatten(2))
        x = x + block.feed_forward(block.ffn_norm(x))
    cache.advance()
    return model.norm(x)[:, 0]
