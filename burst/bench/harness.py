"""`burst bench`: time each strategy's forward and backward on a local world, against one process.

For each strategy a fresh world of `nproc` processes (gloo on CPU, NCCL when every rank has a GPU)
runs `repeats` timed forward+backward passes after a warm-up, so each strategy's peak memory is its
own. The yardstick is one process with all the world's threads running PyTorch's
scaled_dot_product_attention on the whole sequence. Under torchrun, the given world runs every
strategy in turn and the yardstick is skipped. The settings (BenchConfig) are bench/config.py's.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import burst
from burst.bench.config import BenchConfig
from burst.bench.memory import held_bytes, peak_bytes, reset_peak
from burst.devices import backend_for, bind
from burst.kernels.reference import BOUNDS, DTYPES, absolute_error
from burst.kernels.reference import attention as reference_attention
from burst.launch import run_world, spawn_world, under_torchrun
from burst.layout import shard_indices
from burst.masks import MaskSpec
from burst.plan.cost import pair_flops
from burst.strategies import split_variant


def attention_flops(cfg: BenchConfig, pairs: int | None = None) -> tuple[float, float]:
    """Useful FLOPs of forward and backward (plan.cost.pair_flops) of the attended (query, key) pairs
    the strategies counted; without them, the whole sequence's (causal: half)."""
    if pairs is None:
        pairs = cfg.seq_len**2 / (2 if cfg.causal else 1)
    return pair_flops(pairs, cfg.batch, cfg.heads, cfg.head_dim)


def _device(cfg: "BenchConfig") -> torch.device:
    """This rank's device by cfg.device (cuda:LOCAL_RANK, bound before its group started, or cpu)."""
    return bind(cfg.resolved_device())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


CHUNK = 1024  # tokens per independently seeded piece of the inputs


def _input_rows(cfg: BenchConfig, rows: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v, dout at global token indices `rows`, float32 on the CPU, the same on every rank.

    The sequence is drawn in pieces of CHUNK tokens, each from its own seed, so a rank builds its
    shard without ever holding the whole sequence (which would also skew its peak memory).
    """
    kvh = cfg.kv_heads or cfg.heads
    heads = [cfg.heads, kvh, kvh, cfg.heads]
    parts = [[] for _ in heads]
    for chunk in torch.unique(rows // CHUNK).tolist():
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + chunk)
        n = min(CHUNK, cfg.seq_len - chunk * CHUNK)
        local = rows[(rows // CHUNK) == chunk] - chunk * CHUNK
        for i, h in enumerate(heads):
            parts[i].append(torch.randn(cfg.batch, n, h, cfg.head_dim, generator=g)[:, local])
    return [torch.cat(p, dim=1) for p in parts]


def _local_inputs(cfg: BenchConfig, rank: int, world: int, device):
    """This rank's shards of q, k, v, dout, and their global token indices."""
    idx = shard_indices(cfg.resolved_layout(), rank, world, cfg.seq_len)
    order = torch.argsort(idx)  # _input_rows returns rows in ascending order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(idx))
    rows = _input_rows(cfg, idx[order])
    return [t[:, inverse].to(device=device, dtype=DTYPES[cfg.dtype]).contiguous() for t in rows], idx


def _check_error(cfg, out_local, idx, rows: int) -> float:
    """Max |out - float64 attention| over `rows` sampled query rows of this shard."""
    q, k, v, _ = _input_rows(cfg, torch.arange(cfg.seq_len))
    pick = torch.linspace(0, len(idx) - 1, min(rows, len(idx))).long()
    positions = idx[pick]
    mask = MaskSpec(**cfg.mask_kwargs()).allowed(positions, torch.arange(cfg.seq_len))
    ref, _ = reference_attention(q[:, positions], k, v, mask=mask)
    return absolute_error(out_local[:, pick], ref)


def _time_passes(repeats: int, device, forward, backward, next_pass):
    """Best forward and backward seconds over `repeats` passes after one untimed warm-up pass;
    repeats=0 is a single timed pass without warm-up (runs too long to do twice, e.g. 1M tokens).

    forward() -> out; backward(out); next_pass() resets state before each pass. Returns
    (fwd_s, bwd_s, last out).
    """
    fwd, bwd = [], []
    warmups = 1 if repeats > 0 else 0
    for _ in range(max(repeats, 1) + warmups):
        next_pass()
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        backward(out)
        _sync(device)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return min(fwd[warmups:]), min(bwd[warmups:]), out


def run_strategy(cfg: BenchConfig, strategy: str, rank: int, world: int) -> dict:
    """Timed forward/backward of `strategy` on this rank; returns this rank's measurements."""
    device = _device(cfg)
    floor = held_bytes(device)  # torch loaded, no tensors yet: memory above this is the call's
    (q, k, v, dout), idx = _local_inputs(cfg, rank, world, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    reset_peak(device)
    stats = burst.CommStats()

    name, variant = split_variant(strategy)  # "burst:flat" = burst on the flat ring of a multi-node topology
    topology = burst.Topology(cfg.ranks_per_node, double_ring=variant != "flat") if cfg.ranks_per_node else None

    def forward():
        with stats:
            return burst.attention(q, k, v, strategy=name, layout=cfg.layout, topology=topology, **cfg.mask_kwargs())

    def backward(out):
        with stats:
            out.backward(dout)

    def next_pass():
        nonlocal stats
        stats = burst.CommStats()  # the last pass's counts are reported
        q.grad = k.grad = v.grad = None
        if dist.is_initialized():
            dist.barrier()  # every rank starts the timed pass together

    fwd_s, bwd_s, out = _time_passes(cfg.repeats, device, forward, backward, next_pass)
    peak = peak_bytes(device) - floor
    return {
        "fwd_s": fwd_s,
        "bwd_s": bwd_s,
        "sent_fwd": stats.sent("forward"),
        "sent_bwd": stats.sent("backward"),
        "sent_inter": stats.sent(link="inter"),
        "sent_intra": stats.sent(link="intra"),
        "pairs_fwd": stats.pairs("forward"),
        "pairs_bwd": stats.pairs("backward"),
        "compute_fwd_s": stats.compute_seconds("forward"),
        "compute_bwd_s": stats.compute_seconds("backward"),
        "peak_mem_bytes": peak,
        "max_err": _check_error_in_turn(cfg, out.detach(), idx, rank, world),
    }


def _check_error_in_turn(cfg, out_local, idx, rank: int, world: int) -> float:
    """_check_error on each rank in turn: the check draws the whole sequence's inputs (1 GiB per
    rank at 1M tokens, 1 head), which every local rank at once would not fit."""
    err = float("nan")
    for turn in range(world):
        if turn == rank:
            err = _check_error(cfg, out_local, idx, cfg.check_rows)
        if dist.is_initialized() and world > 1:
            dist.barrier()
    return err


def _strategy_on_rank(rank, world, cfg_dict, strategy):
    return run_strategy(BenchConfig(**cfg_dict), strategy, rank, world)


def _emulated_links(cfg: BenchConfig) -> dict:
    """The environment comm/emulation.py reads: emulated link bandwidths (GB/s)."""
    return {
        f"BURST_EMULATE_{link}_GBPS": str(gbps)
        for link, gbps in (("INTER", cfg.inter_node_gbps), ("INTRA", cfg.intra_node_gbps))
        if gbps
    }


def spawn_strategy(cfg: BenchConfig, strategy: str) -> list[dict]:
    """Run one strategy on a fresh local world of cfg.nproc processes (NCCL on cuda, one GPU per rank,
    gloo on cpu: cfg.device); per-rank results. A failing rank ends the world (burst.launch.WorldError)."""
    return spawn_world(
        _strategy_on_rank,
        asdict(cfg),
        strategy,
        nproc=cfg.nproc,
        threads=cfg.resolved_threads(),
        backend=backend_for(cfg.resolved_device()),
        env=_emulated_links(cfg),
    )


def _baseline_on_rank(_rank, _world, cfg_dict):
    cfg = BenchConfig(**cfg_dict)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    floor = held_bytes(device)
    q, k, v, dout = (
        t.transpose(1, 2).to(device, DTYPES[cfg.dtype]).contiguous()
        for t in _input_rows(cfg, torch.arange(cfg.seq_len))
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kvh = k.shape[1]
    mask = None
    if cfg.window or cfg.documents or cfg.block_sparse:  # one process runs the mask densely, as SDPA would
        pos = torch.arange(cfg.seq_len)
        mask = MaskSpec(**cfg.mask_kwargs()).allowed(pos, pos).to(device)
    reset_peak(device)

    def forward():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=cfg.causal and mask is None, enable_gqa=kvh != cfg.heads
        )

    def next_pass():
        q.grad = k.grad = v.grad = None

    fwd_s, bwd_s, _ = _time_passes(cfg.repeats, device, forward, lambda out: out.backward(dout), next_pass)
    peak = peak_bytes(device) - floor
    return {"fwd_s": fwd_s, "bwd_s": bwd_s, "peak_mem_bytes": peak}


def spawn_baseline(cfg: BenchConfig) -> dict:
    """One process, all the world's threads, PyTorch SDPA on the whole sequence."""
    return spawn_world(_baseline_on_rank, asdict(cfg), nproc=1, threads=cfg.resolved_threads() * cfg.nproc)[0]


def summarize(cfg: BenchConfig, strategy: str, per_rank: list[dict], baseline: dict | None) -> dict:
    fwd_flops, bwd_flops = attention_flops(cfg, sum(r["pairs_fwd"] for r in per_rank))
    compute = [r["compute_fwd_s"] + r["compute_bwd_s"] for r in per_rank]
    fwd = max(r["fwd_s"] for r in per_rank)
    bwd = max(r["bwd_s"] for r in per_rank)
    row = {
        "strategy": strategy,
        "world": len(per_rank),
        "fwd_s": fwd,
        "bwd_s": bwd,
        "fwd_tflops": fwd_flops / fwd / 1e12,
        "bwd_tflops": bwd_flops / bwd / 1e12,
        "sent_fwd_per_rank": max(r["sent_fwd"] for r in per_rank),
        "sent_inter_max_per_rank": max(r.get("sent_inter", 0) for r in per_rank),
        "compute_share": max(r["compute_fwd_s"] + r["compute_bwd_s"] for r in per_rank) / (fwd + bwd),
        "sent_bwd_per_rank": max(r["sent_bwd"] for r in per_rank),
        "peak_mem_per_rank": max(r["peak_mem_bytes"] for r in per_rank),
        "max_err": max(r["max_err"] for r in per_rank),
        "error_ok": error_within_bound(max(r["max_err"] for r in per_rank), cfg.dtype),
        "pairs_fwd_max_over_mean": max(r["pairs_fwd"] for r in per_rank)
        / (sum(r["pairs_fwd"] for r in per_rank) / len(per_rank)),
        "pairs_total": sum(r["pairs_fwd"] for r in per_rank),
        "compute_s_per_rank": compute,
        "compute_max_over_min": max(compute) / min(compute) if min(compute) > 0 else float("inf"),
    }
    if baseline:
        row["vs_sdpa"] = (baseline["fwd_s"] + baseline["bwd_s"]) / (fwd + bwd)
    return row


def run_bench(cfg: BenchConfig, on_done=None) -> dict:
    """Every strategy in cfg (spawned, or in the torchrun world) plus the yardstick; a JSON-able dict.

    on_done(label), when given, is called after the yardstick and after each strategy (progress)."""
    on_done = on_done or (lambda label: None)
    baseline = None
    rows = []
    if under_torchrun():
        rows = run_world(_every_strategy_in_this_world, cfg, on_done, threads=cfg.resolved_threads())
    else:
        if cfg.baseline:
            baseline = spawn_baseline(cfg)
            on_done(f"sdpa (1 process) {baseline['fwd_s'] + baseline['bwd_s']:.3f} s")
        for strategy in cfg.strategies:
            rows.append(summarize(cfg, strategy, spawn_strategy(cfg, strategy), baseline))
            on_done(_done_label(rows[-1]))
    fwd_flops, bwd_flops = attention_flops(cfg, rows[0]["pairs_total"] if rows else None)
    if baseline:
        baseline = {
            **baseline,
            "fwd_tflops": fwd_flops / baseline["fwd_s"] / 1e12,
            "bwd_tflops": bwd_flops / baseline["bwd_s"] / 1e12,
        }
    return {
        "config": asdict(cfg),
        "threads_per_rank": cfg.resolved_threads(),
        "sdpa_single_process": baseline,
        "strategies": rows,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
    }


def _every_strategy_in_this_world(rank: int, world: int, cfg: BenchConfig, on_done) -> list[dict]:
    """Each strategy in turn on torchrun's world; its summary row (the same on every rank)."""
    rows = []
    for strategy in cfg.strategies:
        every = [None] * world
        dist.all_gather_object(every, run_strategy(cfg, strategy, rank, world))
        rows.append(summarize(cfg, strategy, every, None))
        on_done(_done_label(rows[-1]))
    return rows


def _done_label(row: dict) -> str:
    return f"{row['strategy']} on {row['world']} ranks {row['fwd_s'] + row['bwd_s']:.3f} s"


def _git_commit() -> str | None:
    """The commit of the burst checkout that ran, when it is one (results name their code)."""
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return (
            subprocess.run(
                ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"seq {cfg['seq_len']}, batch {cfg['batch']}, heads {cfg['heads']}/{cfg['kv_heads'] or cfg['heads']}, "
        f"dim {cfg['head_dim']}, {cfg['dtype']}, causal={cfg['causal']}, window={cfg['window']}, "
        f"documents={cfg['documents']}, block_sparse={cfg['block_sparse']}, layout={cfg['layout']}, "
        f"{cfg['nproc']} ranks x {result['threads_per_rank']} threads"
        + (f", {cfg['ranks_per_node']} ranks per node" if cfg.get("ranks_per_node") else "")
        + (
            f", EMULATED links: inter {cfg.get('inter_node_gbps') or 'real'} GB/s, "
            f"intra {cfg.get('intra_node_gbps') or 'real'} GB/s"
            if cfg.get("inter_node_gbps") or cfg.get("intra_node_gbps")
            else ""
        ),
        "",
        "| strategy | fwd s | bwd s | fwd TFLOP/s | bwd TFLOP/s | vs SDPA (fwd+bwd) | sent fwd MiB/rank "
        "| sent bwd MiB/rank | peak MiB/rank | pairs max/mean | compute max/min | max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = result["sdpa_single_process"]
    if base:
        lines.append(
            f"| sdpa (1 process) | {base['fwd_s']:.3f} | {base['bwd_s']:.3f} | {base['fwd_tflops']:.3f} | "
            f"{base['bwd_tflops']:.3f} | 1.00 | - | - | {base['peak_mem_bytes'] / 2**20:.0f} | - | - | - |"
        )
    for r in result["strategies"]:
        vs = f"{r['vs_sdpa']:.2f}" if "vs_sdpa" in r else "-"
        lines.append(
            f"| {r['strategy']} | {r['fwd_s']:.3f} | {r['bwd_s']:.3f} | {r['fwd_tflops']:.3f} | "
            f"{r['bwd_tflops']:.3f} | {vs} | {r['sent_fwd_per_rank'] / 2**20:.1f} | "
            f"{r['sent_bwd_per_rank'] / 2**20:.1f} | "
            f"{r['peak_mem_per_rank'] / 2**20:.0f} | {r['pairs_fwd_max_over_mean']:.2f} | "
            f"{r['compute_max_over_min']:.2f} | {r['max_err']:.1e}{'' if r.get('error_ok', True) else ' FAIL'} |"
        )
    return "\n".join(lines)


def error_within_bound(err: float, dtype: str) -> bool:
    """A row's max error at most its dtype's bound (kernels/reference.py's BOUNDS, as burst check's), not NaN."""
    return not math.isnan(err) and err <= BOUNDS[dtype]


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
