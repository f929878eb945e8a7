"""A torchtitan-style recipe: a LLaMA of torch's own building blocks, trained sequence-parallel by burst.

    torchrun --nproc-per-node 2 examples/titan_llama.py                     # 1 replica x 2 sequence ranks
    torchrun --nproc-per-node 4 examples/titan_llama.py --dp 2              # 2 replicas x 2 sequence ranks
    python examples/titan_llama.py                                           # one process: the reference
    torchrun --nproc-per-node 8 examples/titan_llama.py --device cuda       # 8 GPUs, NCCL (docs/launch.md)

What torchtitan does for context parallelism, with burst as the engine: a (dp, sp) DeviceMesh; the
model calls F.scaled_dot_product_attention as usual and `burst.context_parallel` routes each call
through burst.attention over the mesh's "sp" group while cutting the token, label and RoPE buffers
along the sequence (zigzag: every rank the same causal work); per block activation checkpointing
and torch.compile, then FSDP2 over the whole mesh (`--fsdp mesh`: burst.engine.parallel, divide
factor dp so the reduce-scatter sums the sequence ranks' shares and averages the replicas).
Rank 0 prints each step's loss, the mean over every token of the global batch; one process prints
the same losses. --out DIR saves each step's loss and gradients and the final weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import burst
from burst.devices import backend_for, bind
from burst.engine.parallel import FSDP_MODES, reduce_gradients, setup, shard_parameters
from burst.launch import end_rank


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        """x: (batch, seq, dim); cos, sin: (seq, head_dim / 2), the rows of x's positions."""
        b, n, _ = x.shape
        q = rotate(self.wq(x).view(b, n, self.heads, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(b, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, n, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


def rotate(x, cos, sin):
    """RoPE on x (batch, seq, heads, head_dim), pairs (even, odd) rotated by their position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0):
    angles = torch.outer(
        torch.arange(seq_len, dtype=torch.float32),
        theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
    )
    return angles.cos(), angles.sin()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cos, sin):
        x = self.tok_embeddings(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))


def apply_checkpointing_and_compile(model: Llama, checkpointing: bool, compile_blocks: bool) -> None:
    """torchtitan's order: each block wrapped for activation checkpointing, then compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        if checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if compile_blocks:
            block.compile()
        model.blocks[i] = block


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="replicas; each sequence is split over world / dp ranks")
    parser.add_argument(
        "--fsdp", default="mesh", choices=FSDP_MODES, help="FSDP2 over the dp dim, the whole mesh, or off"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="rows per replica and step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--optim", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank (cuda:LOCAL_RANK) and NCCL; cpu: gloo",
    )
    parser.add_argument("--out", default=None, help="save losses, gradients and weights here (rank 0)")
    args = parser.parse_args()
    distributed = "RANK" in os.environ  # under torchrun; else one process runs the whole global batch
    device = bind(args.device)  # cuda:LOCAL_RANK made current before NCCL starts, or the CPU
    if distributed:
        dist.init_process_group(backend_for(args.device), device_id=device if device.type == "cuda" else None)
    par = setup(args.dp, args.fsdp, device=args.device) if distributed else setup(1, "none")
    vocab, dim, heads, kv_heads = 128, 64, 4, 2

    torch.manual_seed(0)  # the same weights on every rank and in the reference
    model = Llama(vocab, dim, layers=2, heads=heads, kv_heads=kv_heads, hidden=128).to(device)
    apply_checkpointing_and_compile(model, not args.no_checkpointing, not args.no_compile)
    model = shard_parameters(model, par)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2) if args.optim == "adamw" else torch.optim.SGD(params, lr=0.5)
    data = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for step in range(args.steps):
        # The global batch: `batch` rows per replica, the same on every rank; each replica takes its rows.
        rows = torch.randint(0, vocab, (args.batch * args.dp, args.seq_len + 1), generator=data)
        if distributed:
            rows = rows[par.dp_rank * args.batch : (par.dp_rank + 1) * args.batch]
        tokens, labels = rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)
        cos, sin = (t.to(device) for t in rope_tables(args.seq_len, dim // heads))
        count = labels.numel()  # this replica's tokens: each rank's loss is its share of their mean
        with (
            burst.context_parallel(
                buffers=[tokens, labels, cos, sin],
                buffer_seq_dims=[1, 1, 0, 0],
                no_restore_buffers={tokens, labels, cos, sin},
                group=par.sp_group,
                layout=args.layout,
            )
            if distributed
            else contextlib.nullcontext()
        ):
            logits = model(tokens, cos, sin)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / count
            loss.backward()
        reduce_gradients(model, par)
        if args.out:  # gathering FSDP's shards is a collective: only when they are saved
            grads.append({n: _whole(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
            total /= par.dp
        losses.append(total.item())
        if not distributed or dist.get_rank() == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    weights = {n: _whole(p) for n, p in model.named_parameters()} if args.out else None
    if args.out and (not distributed or dist.get_rank() == 0):
        os.makedirs(args.out, exist_ok=True)
        torch.save({"losses": losses, "grads": grads, "weights": weights}, os.path.join(args.out, "result.pt"))
    if torch.distributed.is_initialized():
        end_rank()  # past every peer's last collective, then no interpreter finalization (gloo can abort there)


def _whole(t):
    """A parameter or gradient as one plain tensor (FSDP's DTensor shards gathered: a collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


if __name__ == "__main__":
    main()
