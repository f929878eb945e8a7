"""`burst train`: sequence-parallel training of the LLaMA-style model on a local world or torchrun's.

The world is dp replicas x sp ranks (engine/parallel.py): each sp rank holds 1/sp of each sequence
(by the layout) and attention runs through burst over its sp group; parameters are replicated or
sharded by FSDP2. The loss is the fused LM head + cross-entropy over the global tokens; gradients
are reduced once per step. Activation checkpointing (engine/checkpointing.py: none, full, remat,
selective) and the blockwise feedforward are settings. AdamW with linear warm-up then cosine
decay. A progress bar (tqdm) and one JSON line per step (step, loss, tokens_per_s_per_device, mfu,
peak_mem_bytes); checkpoints with torch.distributed.checkpoint and exact resume (engine/resume.py).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..layout import local_multiple, shard, shard_indices
from .checkpointing import check_settings
from .model import PRESETS, Transformer, parallelize
from .parallel import Parallel, check_sharding, reduce_gradients, setup, shard_parameters


@dataclass
class TrainConfig:
    model: str = "tiny"
    seq_len: int = 1024
    batch: int = 1  # sequences per data-parallel replica per step
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
    dp: int = 1  # data-parallel replicas; sequence-parallel ranks = world / dp
    fsdp: str = "none"  # none | dp | mesh (engine/parallel.py)
    cpu_offload: bool = False
    checkpointing: str = "none"  # none | full | remat | selective (engine/checkpointing.py)
    checkpoint_split: float = 0.5  # the fraction of the sequence `selective` recomputes
    ffn_chunk: int = 0  # blockwise feedforward: tokens per chunk, 0 = off
    fused_loss: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume_step: int | None = None
    progress: bool = True

    def check(self, world: int) -> None:
        """Errors a run would otherwise hit only after starting (every rank raises alike)."""
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; presets: {tuple(PRESETS)}")
        if self.dp < 1 or world % self.dp:
            raise ValueError(f"--dp {self.dp} must divide the world size {world}")
        sp = world // self.dp
        need = sp * local_multiple(self.layout)
        if self.seq_len <= 0 or self.seq_len % need:
            raise ValueError(f"--seq-len {self.seq_len} must be a positive multiple of {need} "
                             f"(layout {self.layout!r} on {sp} sequence-parallel ranks)")
        if self.seq_len > PRESETS[self.model].max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds model {self.model!r}'s "
                             f"{PRESETS[self.model].max_seq_len} positions")
        if self.data != "synthetic" and not os.path.exists(self.data):
            raise ValueError(f"--data {self.data!r}: no such file (or use 'synthetic')")
        if self.steps < 1 or self.batch < 1:
            raise ValueError("--steps and --batch must be at least 1")
        check_sharding(self.fsdp, self.cpu_offload)
        check_settings(self.checkpointing, self.checkpoint_split, self.ffn_chunk)
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise ValueError("--checkpoint-every needs --checkpoint-dir (and must be >= 0)")
        if self.resume_step is not None:
            from .resume import check_resumable

            check_resumable(self)


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

    def batch(self, step: int, replica: int = 0) -> torch.Tensor:
        """Replica `replica`'s rows (batch, seq_len + 1) of step `step`'s global batch (batch x dp
        rows drawn from the seed and the step alone: the data position is the step)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 100003 + step)
        n, rows = self.cfg.seq_len + 1, self.cfg.batch * self.cfg.dp
        if self.tokens is None:
            full = torch.randint(0, self.vocab, (rows, n), generator=g)
        else:
            starts = torch.randint(0, self.tokens.numel() - n + 1, (rows,), generator=g)
            full = torch.stack([self.tokens[s:s + n] for s in starts.tolist()])
        return full[replica * self.cfg.batch:(replica + 1) * self.cfg.batch]


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build(cfg: TrainConfig, par: Parallel | None = None) -> Transformer:
    """The model, the same initial weights on every rank (seeded), with cfg's checkpointing and
    blockwise feedforward; sequence-parallel over par's sp group, FSDP2-sharded as par says.
    par None: a single process (the reference)."""
    par = par or Parallel()
    torch.manual_seed(cfg.seed)
    model = Transformer(PRESETS[cfg.model])
    model.set_checkpointing(cfg.checkpointing, cfg.checkpoint_split, cfg.ffn_chunk)
    if par.sp > 1:
        parallelize(model, group=par.sp_group, strategy=cfg.strategy, layout=cfg.layout)
    return shard_parameters(model, par, cfg.cpu_offload)


def train_step(model, optimizer, tokens: torch.Tensor, cfg: TrainConfig, par: Parallel | None = None) -> float:
    """One step on this replica's rows `tokens` (batch, seq_len + 1); returns the global mean loss."""
    par = par or Parallel()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = shard_indices(cfg.layout, par.sp_rank, par.sp, cfg.seq_len).expand(tokens.shape[0], -1)
    if par.sp > 1:
        inputs, targets = (shard(t, group=par.sp_group, layout=cfg.layout) for t in (inputs, targets))
    loss = model(inputs, positions, targets=targets, loss_group=par.loss_group, fused_loss=cfg.fused_loss)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    reduce_gradients(model, par)
    optimizer.step()
    total = loss.detach().clone()
    if par.world > 1:
        dist.all_reduce(total)  # the sp shares add up to a replica's mean; replicas are averaged
    return total.item() / par.dp


def train(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    """The training loop on this rank; returns (and on rank 0 writes) the per-step metrics."""
    from .resume import load_checkpoint, save_checkpoint

    cfg.check(world)
    par = setup(cfg.dp, cfg.fsdp)
    model = build(cfg, par)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    first = 0
    if cfg.resume_step is not None:
        first = load_checkpoint(cfg, model, optimizer)
    data = TokenSource(cfg, model.cfg.vocab_size)
    tokens_per_device = cfg.batch * cfg.seq_len / par.sp
    flops_per_token = 6 * model.cfg.parameters() + 6 * model.cfg.layers * model.cfg.dim * cfg.seq_len  # causal attn
    rows = []
    out = open(cfg.metrics, "a" if first else "w") if cfg.metrics and rank == 0 else None
    bar = _progress(cfg, first) if rank == 0 else None
    for step in range(first, cfg.steps):
        for group_ in optimizer.param_groups:
            group_["lr"] = learning_rate(cfg, step)
        start = time.perf_counter()
        loss = train_step(model, optimizer, data.batch(step, par.dp_rank), cfg, par)
        elapsed = time.perf_counter() - start
        row = {"step": step, "loss": loss, "lr": learning_rate(cfg, step), "step_s": elapsed,
               "tokens_per_s_per_device": tokens_per_device / elapsed,
               "mfu": flops_per_token * tokens_per_device / elapsed / cfg.peak_flops if cfg.peak_flops else 0.0,
               "peak_mem_bytes": peak_memory_bytes()}
        rows.append(row)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, step + 1, model, optimizer)
        if rank == 0:
            _report(bar, row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    if bar is not None:
        bar.close()
    if out:
        out.close()
    return rows


def peak_memory_bytes() -> int:
    """This process's peak memory: CUDA's allocator peak on a GPU, else the peak resident set."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _progress(cfg: TrainConfig, first: int):
    if not cfg.progress or not sys.stderr.isatty():
        return None  # a line per step (logs, CI) instead of a redrawn bar
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=first, desc="burst train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _report(bar, row: dict) -> None:
    facts = dict(loss=f"{row['loss']:.4f}", tok_s_dev=f"{row['tokens_per_s_per_device']:.0f}",
                 mfu=f"{row['mfu']:.1%}", peak_mem=f"{row['peak_mem_bytes'] / 2**20:.0f}MiB")
    if bar is None:
        print(f"step {row['step']} " + " ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    else:
        bar.set_postfix(facts, refresh=False)
        bar.update(1)
