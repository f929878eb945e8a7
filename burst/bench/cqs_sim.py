"""CQS-Attention's one-device simulation (cqs-attention.md §IV-B, Table 2), on the real schedule.

W workers run one after another in this process. Each worker's plan comes from the same code the
distributed strategy runs (strategies/cqs.py: call_schedule and worker_forward, with an AttentionCall
per worker), so the simulation measures the plan that `strategy="cqs"` executes. For each W it
reports the sequence-length ratio SLR (the share of the tokens a worker holds), the straggler's
time (the slowest worker's compute), and the straggler's peak memory in tensors it holds
(materials + partial results), next to one process attending the whole sequence; the Tiler's merge
of the partials is checked against that single-process result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..call import AttentionCall
from ..kernels import select_kernel
from ..masks import MaskSpec
from ..merge import merge_partial
from ..schedules.cqs import sequence_length_ratio
from ..strategies.cqs import CQSOptions, call_schedule, worker_forward


@dataclass
class SimRow:
    workers: int
    seq_len: int
    slr: float
    tasks_max: int
    straggler_s: float
    single_s: float
    straggler_mem_bytes: int
    single_mem_bytes: int
    max_err: float


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def simulate(
    workers: int, seq_len: int, heads: int = 8, head_dim: int = 64, causal: bool = False, seed: int = 0
) -> SimRow:
    """Run the W workers of the distilled CQS one after another on this process (forward)."""
    if seq_len % workers:
        raise ValueError(f"seq_len {seq_len} must be divisible by the {workers} workers")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim, generator=g) for _ in range(3))
    n = seq_len // workers
    kernel = select_kernel(q.device, q.dtype)
    spec = MaskSpec(causal=causal)

    def call_for(w: int) -> AttentionCall:
        return AttentionCall(
            group=None,
            rank=w,
            world=workers,
            layout="contiguous",
            local_len=n,
            spec=spec,
            scale=head_dim**-0.5,
            kernel=kernel,
            options=CQSOptions(),
        )

    def group(t, x):
        return t[:, x * n : (x + 1) * n]

    sched = call_schedule(call_for(0))
    out = [torch.zeros(1, n, heads, head_dim) for _ in range(workers)]
    lse = [torch.full((1, heads, n), float("-inf")) for _ in range(workers)]
    straggler_s, straggler_mem = 0.0, 0
    for w in range(workers):
        call = call_for(w)
        q_groups = {x: [group(q, x).clone()] for x in sched.q_materials[w]}  # what the exchange brings
        kv_groups = {y: [group(k, y).clone(), group(v, y).clone()] for y in sched.kv_materials[w]}
        start = time.perf_counter()
        partial = worker_forward(call, sched.tasks[w], q_groups, kv_groups)
        straggler_s = max(straggler_s, time.perf_counter() - start)
        held = [t for ts in q_groups.values() for t in ts] + [t for ts in kv_groups.values() for t in ts]
        held += [t for pair in partial.values() for t in pair]
        straggler_mem = max(straggler_mem, _bytes(*held))
        for x, (o, l) in partial.items():  # the Tiler
            merge_partial(out[x], lse[x], o, l)
    start = time.perf_counter()
    ref, _ = kernel.forward(q, k, v, head_dim**-0.5, causal)
    single_s = time.perf_counter() - start
    err = (torch.cat(out, dim=1) - ref).abs().max().item() / ref.abs().max().item()
    return SimRow(
        workers,
        seq_len,
        sequence_length_ratio(workers),
        max(sched.load()),
        straggler_s,
        single_s,
        straggler_mem,
        _bytes(q, k, v, ref),
        err,
    )


def table2(
    workers=(2, 3, 4, 7, 8, 13, 16), seq_lens=(4096, 16384), heads: int = 8, head_dim: int = 64, causal: bool = False
) -> str:
    """The shape of the paper's Table 2 at our scale, as a Markdown table."""
    lines = [
        "| W | tokens | SLR | pairs (max per worker) | straggler s | one process s | straggler MiB | one process MiB "
        "| max err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in seq_lens:
        for w in workers:
            if n % w:
                n_w = n - n % w
            else:
                n_w = n
            r = simulate(w, n_w, heads, head_dim, causal)
            lines.append(
                f"| {w} | {n_w} | {r.slr:.3f} | {r.tasks_max} | {r.straggler_s:.3f} | {r.single_s:.3f} | "
                f"{r.straggler_mem_bytes / 2**20:.1f} | {r.single_mem_bytes / 2**20:.1f} | {r.max_err:.1e} |"
            )
    return "\n".join(lines)
