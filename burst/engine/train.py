"""`burst train`: sequence-parallel training of the LLaMA-style model on a local world or torchrun's.

Every rank holds the whole model and 1/G of each sequence (by the layout); attention runs through
burst over the group; the loss is the fused LM head + cross-entropy over the global tokens; the
ranks' gradients are summed once per step (each holds its tokens' share). AdamW with linear warm-up
then cosine decay. One JSON line per step with step, loss, tokens_per_s_per_device, mfu and
peak_mem_bytes.

Built here: data (synthetic, a uint16/uint32 token file, or a text file read as bytes), the model
presets, the loop, metrics. Not yet: checkpointing modes, FSDP2, checkpoints and resume (issue 15).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..layout import local_multiple, shard, shard_indices
from .loss import fused_linear_cross_entropy
from .model import PRESETS, Transformer, parallelize


@dataclass
class TrainConfig:
    model: str = "tiny"
    seq_len: int = 1024
    batch: int = 1
    steps: int = 4
    seed: int = 0
    data: str = "synthetic"
    strategy: str = "burst"
    layout: str = "zigzag"
    lr: float = 3e-3
    warmup: int = 2
    weight_decay: float = 0.1
    metrics: str | None = None
    peak_flops: float = 0.0  # per device, for MFU; 0 = measure nothing, report mfu as 0

    def check(self, world: int) -> None:
        """Errors a run would otherwise hit only after starting (every rank raises alike)."""
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; presets: {tuple(PRESETS)}")
        need = world * local_multiple(self.layout)
        if self.seq_len <= 0 or self.seq_len % need:
            raise ValueError(f"--seq-len {self.seq_len} must be a positive multiple of {need} "
                             f"(layout {self.layout!r} on {world} ranks)")
        if self.data != "synthetic" and not os.path.exists(self.data):
            raise ValueError(f"--data {self.data!r}: no such file (or use 'synthetic')")
        if self.steps < 1:
            raise ValueError("--steps must be at least 1")


class TokenSource:
    """Batches of seq_len + 1 tokens, the same on every rank (each keeps its shard)."""

    def __init__(self, cfg: TrainConfig, vocab: int):
        self.cfg, self.vocab = cfg, vocab
        if cfg.data == "synthetic":
            self.tokens = None
        elif cfg.data.endswith(".bin"):
            dtype = np.uint32 if os.path.getsize(cfg.data) % 4 == 0 and cfg.data.endswith(".u32.bin") else np.uint16
            self.tokens = torch.from_numpy(np.fromfile(cfg.data, dtype=dtype).astype(np.int64))
        else:  # a text file, byte-level
            with open(cfg.data, "rb") as f:
                self.tokens = torch.tensor(list(f.read()), dtype=torch.long)
        if self.tokens is not None and self.tokens.numel() < cfg.seq_len + 1:
            raise ValueError(f"--data {cfg.data!r} holds {self.tokens.numel()} tokens, fewer than seq_len + 1")
        if self.tokens is not None and int(self.tokens.max()) >= vocab:
            raise ValueError(f"--data {cfg.data!r} has token ids up to {int(self.tokens.max())}, "
                             f"beyond the model's vocabulary of {vocab}")

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 100003 + step)
        n = self.cfg.seq_len + 1
        if self.tokens is None:
            return torch.randint(0, self.vocab, (self.cfg.batch, n), generator=g)
        starts = torch.randint(0, self.tokens.numel() - n + 1, (self.cfg.batch,), generator=g)
        return torch.stack([self.tokens[s:s + n] for s in starts.tolist()])


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _world(group, world: int | None) -> int:
    if world is not None:
        return world
    return dist.get_world_size(group) if dist.is_initialized() else 1


def build(cfg: TrainConfig, group=None, world: int | None = None) -> Transformer:
    """The model, the same weights on every rank; sequence-parallel over `group` when its world
    (or `world`, 1 for a single-process reference inside a distributed program) exceeds one."""
    torch.manual_seed(cfg.seed)
    model = Transformer(PRESETS[cfg.model])
    if _world(group, world) > 1:
        parallelize(model, group=group, strategy=cfg.strategy, layout=cfg.layout)
    return model


def sum_gradients(model, group=None) -> None:
    """Each rank's gradients hold its tokens' share: one all-reduce makes them the whole batch's."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def train_step(model, optimizer, tokens: torch.Tensor, cfg: TrainConfig, group=None, world: int | None = None) -> float:
    """One step on the full batch `tokens` (batch, seq_len + 1); returns the global mean loss."""
    world = _world(group, world)
    rank = dist.get_rank(group) if world > 1 else 0
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = shard_indices(cfg.layout, rank, world, cfg.seq_len).expand(tokens.shape[0], -1)
    if world > 1:
        inputs, targets = (shard(t, group=group, layout=cfg.layout) for t in (inputs, targets))
    hidden = model(inputs, positions)
    loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, targets,
                                      group=(group or dist.group.WORLD) if world > 1 else None)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if world > 1:
        sum_gradients(model, group)
    optimizer.step()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total, group=group)
    return total.item()


def train(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    """The training loop on this rank; returns (and on rank 0 writes) the per-step metrics."""
    cfg.check(world)
    model = build(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = TokenSource(cfg, model.cfg.vocab_size)
    flops_per_token = 6 * model.cfg.parameters() + 6 * model.cfg.layers * model.cfg.dim * cfg.seq_len  # causal attn
    rows = []
    out = open(cfg.metrics, "w") if cfg.metrics and rank == 0 else None
    for step in range(cfg.steps):
        for group_ in optimizer.param_groups:
            group_["lr"] = learning_rate(cfg, step)
        start = time.perf_counter()
        loss = train_step(model, optimizer, data.batch(step), cfg)
        elapsed = time.perf_counter() - start
        tokens_per_device = cfg.batch * cfg.seq_len / world
        row = {"step": step, "loss": loss, "lr": learning_rate(cfg, step), "step_s": elapsed,
               "tokens_per_s_per_device": tokens_per_device / elapsed,
               "mfu": flops_per_token * tokens_per_device / elapsed / cfg.peak_flops if cfg.peak_flops else 0.0,
               "peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        rows.append(row)
        if rank == 0:
            print(f"step {step} loss {loss:.4f} {row['tokens_per_s_per_device']:.0f} tok/s/device "
                  f"peak {row['peak_mem_bytes'] / 2**20:.0f} MiB", flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    if out:
        out.close()
    return rows


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
