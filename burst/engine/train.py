"""`burst train`: sequence-parallel training of the LLaMA-style model on a local world or torchrun's.

The world is dp replicas x sp ranks (engine/parallel.py): each sp rank holds 1/sp of each sequence
(by the layout) and attention runs through burst over its sp group; parameters are replicated or
sharded by FSDP2. The loss is the fused LM head + cross-entropy over the global tokens; gradients
are reduced once per step. Activation checkpointing (engine/checkpointing.py: none, full, remat,
selective), the blockwise feedforward and the host offloads (engine/offload.py: checkpointed
activations, AdamW's state and step) are settings; none of them changes the numbers in float32 (in bf16
the options that split tokens, selective checkpointing and the blockwise feedforward, round each piece's
weight gradient before the pieces add: ~1e-2 relative, bf16's own step; docs/engine.md). AdamW with
linear warm-up then cosine decay. On stderr a progress bar (tqdm) on a terminal, else a line per
step, and a line for each checkpoint saved or resumed; one JSON line per step in --metrics (step,
loss, tokens_per_s_per_device, mfu (None without peak_flops; FLOPs as torchtitan counts them:
plan.flops), optimizer_s (the optimizer's share of step_s), peak_mem_bytes, host_peak_bytes,
memory_options: which of them ran); checkpoints with torch.distributed.checkpoint and exact resume
(engine/resume.py). Running out of device memory ends the run with one line (engine/out_of_memory.py).
The settings and the checks made before any process starts (TrainConfig) are engine/train_config.py's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ..devices import parse_dtype
from ..layout import shard, shard_indices
from ..plan.flops import train_flops_per_token
from .model import PRESETS, Transformer, parallelize
from .out_of_memory import out_of_memory
from .parallel import Parallel, reduce_gradients, setup, shard_parameters
from .train_config import TRAIN_DTYPES, TrainConfig, check_token_ids, token_count, token_dtype  # noqa: F401

BUILT_ON_HOST_BYTES = 2**31  # models up to this many fp32 bytes are drawn on the CPU, larger ones on the device


class TokenSource:
    """Batches of seq_len + 1 tokens, the same on every rank (each keeps its shard)."""

    def __init__(self, cfg: TrainConfig, vocab: int):
        self.cfg, self.vocab = cfg, vocab
        if cfg.data == "synthetic":
            self.tokens = None
        else:  # a token file, or a text file as byte-level tokens
            self.tokens = torch.from_numpy(np.fromfile(cfg.data, dtype=token_dtype(cfg.data)).astype(np.int64))
        if self.tokens is not None and self.tokens.numel() < cfg.seq_len + 1:
            raise ValueError(f"--data: {cfg.data!r} holds {self.tokens.numel()} tokens, fewer than --seq-len + 1")
        if self.tokens is not None:
            check_token_ids(cfg.data, int(self.tokens.max()), vocab)

    def batch(self, step: int, replica: int = 0) -> torch.Tensor:
        """Replica `replica`'s rows (batch, seq_len + 1) of step `step`'s global batch (batch x dp
        rows drawn from the seed and the step alone: the data position is the step)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 100003 + step)
        n, rows = self.cfg.seq_len + 1, self.cfg.batch * self.cfg.dp
        if self.tokens is None:
            full = torch.randint(0, self.vocab, (rows, n), generator=g)
        else:
            starts = torch.randint(0, self.tokens.numel() - n + 1, (rows,), generator=g)
            full = torch.stack([self.tokens[s : s + n] for s in starts.tolist()])
        return full[replica * self.cfg.batch : (replica + 1) * self.cfg.batch]


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build(cfg: TrainConfig, par: Parallel | None = None, device: torch.device | None = None) -> Transformer:
    """The model, the same initial weights on every rank (seeded, made on the CPU so that every device
    starts from the same numbers), on `device` (default cpu), with cfg's checkpointing and blockwise
    feedforward; sequence-parallel over par's sp group, FSDP2-sharded as par says.
    par None: a single process (the reference)."""
    par = par or Parallel()
    torch.manual_seed(cfg.seed)
    preset, device = PRESETS[cfg.model], torch.device(device or "cpu")
    if preset.parameters() * 4 <= BUILT_ON_HOST_BYTES:
        model = Transformer(preset).to(device)
    else:  # an 8B model: shapes without memory, then weights drawn on the device itself (the same
        model = Transformer(preset, device="meta").to_empty(device=device)  # seed gives every rank the same)
        model.reset_parameters()
    model.set_checkpointing(
        cfg.checkpointing, cfg.checkpoint_split, cfg.ffn_chunk, cfg.offload_activations, cfg.offload_layers
    )
    if par.sp > 1:
        parallelize(model, group=par.sp_group, strategy=cfg.strategy, layout=cfg.layout)
    return shard_parameters(model, par, cfg.cpu_offload)


def make_optimizer(model, cfg: TrainConfig):
    """AdamW on the device, or with --offload-optimizer on the host (offload.HostAdamW: the device's
    weights then in the compute dtype, the fp32 masters on the host)."""
    if cfg.offload_optimizer:
        from .offload import HostAdamW

        optimizer = HostAdamW(model.parameters(), cfg.lr, cfg.weight_decay, compute_dtype=parse_dtype(cfg.dtype))
        if optimizer.params[0].device.type == "cuda":  # the fp32 weights they were drawn as: memory back,
            torch.cuda.empty_cache()  # and let peak_mem_bytes count the steps from here
            torch.cuda.reset_peak_memory_stats()
        return optimizer
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def train_step(
    model, optimizer, tokens: torch.Tensor, cfg: TrainConfig, par: Parallel | None = None, timings: dict | None = None
) -> float:
    """One step on this replica's rows `tokens` (batch, seq_len + 1); returns the global mean loss.
    timings: filled with "optimizer_s", the seconds of the optimizer (HostAdamW's host steps inside
    the backward, or AdamW's step after it, the device synchronized around it)."""
    par = par or Parallel()
    device = next(model.parameters()).device
    tokens = tokens.to(device, non_blocking=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = shard_indices(cfg.layout, par.sp_rank, par.sp, cfg.seq_len).to(device).expand(tokens.shape[0], -1)
    if par.sp > 1:
        inputs, targets = (shard(t, group=par.sp_group, layout=cfg.layout) for t in (inputs, targets))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=parse_dtype(cfg.dtype) == torch.bfloat16):
        loss = model(inputs, positions, targets=targets, loss_group=par.loss_group, fused_loss=cfg.fused_loss)
    optimizer.zero_grad(set_to_none=True)
    host_timer = getattr(optimizer, "reset_timer", None)
    if host_timer is not None:
        host_timer()
    loss.backward()
    reduce_gradients(model, par)
    _synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    _synchronize(device)
    if timings is not None:
        timings["optimizer_s"] = time.perf_counter() - start + getattr(optimizer, "optimizer_s", 0.0)
    total = loss.detach().clone()
    if par.world > 1:
        dist.all_reduce(total)  # the sp shares add up to a replica's mean; replicas are averaged
    return total.item() / par.dp


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(rank: int, world: int, cfg: TrainConfig) -> list[dict]:
    """The training loop on this rank; returns (and on rank 0 writes) the per-step metrics."""
    from ..devices import bind, local_ranks, resolve_device
    from .resume import load_checkpoint, save_checkpoint, step_dir

    cfg.check(world)
    device = bind(resolve_device(cfg.device, local_ranks(world)))  # the launcher bound it already: the same
    par = setup(cfg.dp, cfg.fsdp, device.type)  # the mesh on the ranks' own device type (NCCL on cuda)
    model = build(cfg, par, device)
    optimizer = make_optimizer(model, cfg)
    first = 0
    if cfg.resume_step is not None:
        first = load_checkpoint(cfg, model, optimizer)
        if rank == 0:
            _say(None, f"resumed from {step_dir(cfg.checkpoint_dir, first)} ({cfg.steps - first} step(s) to go)")
    data = TokenSource(cfg, model.cfg.vocab_size)
    tokens_per_device = cfg.batch * cfg.seq_len / par.sp
    flops_per_token = train_flops_per_token(model.cfg, cfg.seq_len)  # torchtitan's count (plan/flops.py)
    rows = []
    out = _metrics_file(cfg.metrics, first) if cfg.metrics and rank == 0 else None
    bar = _progress(cfg, first) if rank == 0 else None
    for step in range(first, cfg.steps):
        for group_ in optimizer.param_groups:
            group_["lr"] = learning_rate(cfg, step)
        start, timings = time.perf_counter(), {}
        try:
            loss = train_step(model, optimizer, data.batch(step, par.dp_rank), cfg, par, timings)
        except torch.OutOfMemoryError as err:
            failure = str(err)  # leaving the except block drops the traceback and the step's tensors with it
        else:
            failure = None
        if failure is not None:
            model = optimizer = None
            raise out_of_memory(cfg, device, failure)
        elapsed = time.perf_counter() - start
        compute_s = elapsed - timings["optimizer_s"]  # forward + backward: what MFU counts
        row = {
            "step": step,
            "loss": loss,
            "lr": learning_rate(cfg, step),
            "step_s": elapsed,
            "optimizer_s": timings["optimizer_s"],
            "tokens_per_s_per_device": tokens_per_device / elapsed,
            "mfu": flops_per_token * tokens_per_device / compute_s / cfg.peak_flops if cfg.peak_flops else None,
            "peak_mem_bytes": peak_memory_bytes(),
            "host_peak_bytes": peak_host_bytes(),
            "memory_options": cfg.memory_options(),
        }
        rows.append(row)
        if rank == 0:
            _report(bar, row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        refuse_non_finite(loss, step, cfg)  # every rank: the loss was summed over all of them
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            path = save_checkpoint(cfg, step + 1, model, optimizer)
            if rank == 0:
                _say(bar, f"saved checkpoint {path}")
    if bar is not None:
        bar.close()
    if out:
        out.close()
    return rows


def refuse_non_finite(loss: float, step: int, cfg: TrainConfig) -> None:
    """FloatingPointError when a step's loss is NaN or infinite: its gradients made every weight so, and the steps
    after it would train on (and save) nothing. Raised before the step's checkpoint is written."""
    if math.isfinite(loss):
        return
    resumed = (
        f", or step {cfg.resume_step}'s checkpoint this run resumed from (one written before burst kept its files' "
        "digests is not checked)"
        if cfg.resume_step is not None
        else ""
    )
    raise FloatingPointError(
        f"step {step}: the loss is {loss}, stopping before its weights are saved. Causes: a learning rate too high "
        f"for the model (--lr, --warmup){resumed}"
    )


def peak_host_bytes() -> int:
    """This process's peak resident set (host memory), whatever the device."""
    from ..memory import peak_bytes

    return int(peak_bytes(torch.device("cpu")))


def peak_memory_bytes() -> int:
    """This process's peak memory since it started (burst/memory.py): CUDA's allocator peak on a
    GPU, else the peak resident set."""
    from ..memory import peak_bytes

    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return int(peak_bytes(torch.device("cuda" if on_gpu else "cpu")))


def _metrics_file(path: str, first: int):
    """--metrics opened for steps `first` on: a resumed run keeps the lines of the steps before its
    checkpoint and drops those after it (an interrupted run wrote them, and this run writes them again)."""
    if not first or not os.path.exists(path):
        return open(path, "w")
    with open(path) as f:
        kept = [line for line in f if _step_of(line) is not None and _step_of(line) < first]
    out = open(path, "w")
    out.writelines(kept)
    return out


def _step_of(line: str) -> int | None:
    """The step of a --metrics line (0 the first), None for a line that is not one."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _progress(cfg: TrainConfig, first: int):
    if not cfg.progress or not sys.stderr.isatty():
        return None  # a line per step (logs, CI) instead of a redrawn bar
    import threading

    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore, which a rank leaving with os._exit never
    # releases: the resource tracker then warned of a leaked semaphore after every run.
    tqdm.set_lock(threading.RLock())
    return tqdm(total=cfg.steps, initial=first, desc="burst train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _say(bar, text: str) -> None:
    """A line of news (a checkpoint saved or resumed) above the bar, or on stderr."""
    if bar is None:
        print(f"burst train: {text}", file=sys.stderr, flush=True)
    else:
        bar.write(f"burst train: {text}", file=sys.stderr)


def _report(bar, row: dict) -> None:
    mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
    facts = dict(
        loss=f"{row['loss']:.4f}",
        tok_s_dev=f"{row['tokens_per_s_per_device']:.0f}",
        mfu=mfu,
        peak_mem=f"{row['peak_mem_bytes'] / 2**20:.0f}MiB",
    )
    if bar is None:
        print(f"step {row['step']} " + " ".join(f"{k} {v}" for k, v in facts.items()), file=sys.stderr, flush=True)
    else:
        bar.set_postfix(facts, refresh=False)
        bar.update(1)
