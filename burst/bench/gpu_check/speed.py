"""Section 3: the block step and burst.attention fwd+bwd against torch SDPA's flash path."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

import burst
from burst.bench.harness import BenchConfig, attention_flops, run_strategy
from burst.kernels import lse_for_backward, row_delta, select_kernel
from burst.kernels.accumulators import accumulator_zeros_like, empty_accumulators
from burst.kernels.attend import attend_backward, attend_forward
from burst.launch import spawn_world
from burst.layout import Segment
from burst.masks import MaskSpec, TileSizes, plan_tiles

from .cases import is_oom, random_inputs, rank_device, release_memory
from .report import Report, first_line


def time_fwd_bwd(device, repeats: int, forward, backward, reset) -> tuple[float, float]:
    """Best forward and backward seconds over `repeats` passes after one warm-up pass (the bench's
    own timing loop)."""
    from ..harness import _time_passes

    fwd_s, bwd_s, _ = _time_passes(repeats, device, forward, backward, reset)
    return fwd_s, bwd_s


def sdpa_runner(q, k, v, dout, causal: bool, device):
    """torch SDPA on (batch, seq, heads, dim) tensors, pinned to its flash backend on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2)
    backends = [SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def forward():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def reset():
        qt.grad = kt.grad = vt.grad = None

    return forward, lambda out: out.backward(dt), reset


def block_step_runner(q, k, v, dout, causal: bool, device):
    """The whole sequence as one block pair through the block step, tiles of the kernel's call size."""
    kernel = select_kernel(device, q.dtype)
    segs = [Segment(0, q.shape[1], 0)]
    tiles = plan_tiles(segs, segs, MaskSpec(causal=causal), TileSizes.for_kernel(kernel))
    scale = q.shape[-1] ** -0.5
    state = {}

    def forward():
        out_acc, lse = empty_accumulators(q)
        attend_forward(kernel, q, k, v, tiles, out_acc, lse, scale)
        state["lse"] = lse
        return out_acc.to(q.dtype)

    def backward(out):
        grads = [accumulator_zeros_like(t) for t in (q, k, v)]
        attend_backward(
            kernel,
            dout,
            q,
            k,
            v,
            None,
            lse_for_backward(state.pop("lse")),
            tiles,
            *grads,
            scale,
            delta=row_delta(dout, out),
        )

    return forward, backward, lambda: None


def attention_runner(q, k, v, dout, causal: bool, device):
    """burst.attention on one process (no group): the strategy, its autograd and the block step."""
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    def reset():
        qq.grad = kk.grad = vv.grad = None

    return lambda: burst.attention(qq, kk, vv, causal=causal), lambda out: out.backward(dout), reset


RUNNERS = {"sdpa": sdpa_runner, "block_step": block_step_runner, "burst.attention": attention_runner}


def measure(name: str, inputs, causal: bool, device, repeats: int) -> dict:
    """Best fwd and bwd seconds of runner `name` on inputs q, k, v, dout (batch 1, MHA), and TFLOP/s."""
    q = inputs[0]
    fwd_s, bwd_s = time_fwd_bwd(device, repeats, *RUNNERS[name](*inputs, causal, device))
    fwd_flops, bwd_flops = attention_flops(
        BenchConfig(seq_len=q.shape[1], heads=q.shape[2], head_dim=q.shape[3], causal=causal)
    )
    return {"fwd_s": fwd_s, "bwd_s": bwd_s, "tflops": (fwd_flops + bwd_flops) / (fwd_s + bwd_s) / 1e12}


def bench_rank(rank, world, runs, device_kind):
    """harness.run_strategy for each (config, strategy) of `runs` on this world; this rank's results."""
    rank_device(device_kind)
    return [run_strategy(BenchConfig(**cfg), strategy, rank, world) for cfg, strategy in runs]


def section_speed(rep: Report, several: str | None) -> None:
    with rep.section("3", "Speed: block step and one-rank burst.attention vs torch SDPA") as sec:
        sizes, device = rep.sizes, rep.device
        dtype = getattr(torch, sizes.speed_dtype)
        sec.note(
            f"{sizes.speed_dtype}, batch 1, heads x head_dim = {sizes.speed_hidden}, MHA; TFLOP/s counts "
            "4*heads*dim per attended pair forward, 2.5x that backward (harness.attention_flops); "
            "'x SDPA' = SDPA's fwd+bwd time / this one's (> 1: faster than SDPA)"
            + ("; SDPA pinned to its flash backend" if device.type == "cuda" else "; SDPA on the CPU")
        )
        rows, last = [], {}
        for n in sizes.speed_lens:  # every setting at one length before any at the next: time runs out at the longest
            for dim in sizes.speed_dims:
                for causal in (False, True):
                    if sec.skip_for_time(
                        f"dim {dim} causal={causal} at {n} tokens", 4.5 * last.get((dim, causal), 0) + 1
                    ):
                        continue
                    began = time.monotonic()
                    heads = max(1, sizes.speed_hidden // dim)
                    row = {"head_dim": dim, "heads": heads, "causal": causal, "tokens": n}
                    inputs = random_inputs(1, n, heads, heads, dim, dtype, device, on_device=True)
                    for name in RUNNERS:
                        try:
                            got = measure(name, inputs, causal, device, sizes.speed_repeats)
                            row[f"{name} TFLOP/s"] = got["tflops"]
                            row[f"{name} s"] = got["fwd_s"] + got["bwd_s"]
                        except Exception as err:  # noqa: BLE001 - OOM or a kernel error: noted, the rest runs
                            row[f"{name} s"] = "OOM" if is_oom(err) else type(err).__name__
                            if not is_oom(err):
                                sec.fail(f"{name} at {n} tokens dim {dim}: {first_line(err)}")
                        release_memory(device)
                    del inputs
                    for name in ("block_step", "burst.attention"):
                        if isinstance(row.get(f"{name} s"), float) and isinstance(row.get("sdpa s"), float):
                            row[f"{name} x SDPA"] = row["sdpa s"] / row[f"{name} s"]
                    rows.append(row)
                    last[(dim, causal)] = time.monotonic() - began
        rows.sort(key=lambda r: (r["head_dim"], r["causal"], r["tokens"]))
        cols = ["head_dim", "heads", "causal", "tokens"]
        for name in RUNNERS:
            cols += [f"{name} s", f"{name} TFLOP/s"] + ([f"{name} x SDPA"] if name != "sdpa" else [])
        sec.table("one device, fwd+bwd (s = forward + backward seconds)", cols, rows)
        if several is None:
            sec.note("no several-rank world ran on this device (section 2), so no several-rank timing")
            return
        if sec.skip_for_time("the several-rank timing", 30):
            return
        ranks = sizes.world_ranks[0]
        runs = []
        for causal in (False, True):
            cfg = BenchConfig(
                seq_len=sizes.world_speed_len,
                heads=max(1, sizes.speed_hidden // 128),
                head_dim=min(128, sizes.speed_hidden),
                dtype=sizes.speed_dtype,
                causal=causal,
                layout="zigzag" if causal else "contiguous",
                nproc=ranks,
                repeats=sizes.speed_repeats,
            )
            runs += [(dataclasses.asdict(cfg), strategy) for strategy in ("burst", "ring")]
        limit = max(10.0, min(sec.left(), sizes.spawn_timeout))
        try:
            per_rank = spawn_world(
                bench_rank, runs, device.type, nproc=ranks, backend=several, threads=sizes.threads, timeout=limit
            )
        except TimeoutError:  # ranks sharing one device through host copies: slow, not hung (section 2 ran them)
            sec.note(f"could not finish the several-rank timing in the {limit:.0f} s the section had left")
            return
        world_rows = []
        for i, (cfg_dict, strategy) in enumerate(runs):
            cfg, mine = BenchConfig(**cfg_dict), [r[i] for r in per_rank]
            fwd_flops, bwd_flops = attention_flops(cfg)
            secs = max(r["fwd_s"] for r in mine) + max(r["bwd_s"] for r in mine)
            world_rows.append(
                {
                    "strategy": strategy,
                    "ranks": ranks,
                    "causal": cfg.causal,
                    "layout": cfg.layout,
                    "tokens": cfg.seq_len,
                    "s": secs,
                    "TFLOP/s (all ranks)": (fwd_flops + bwd_flops) / secs / 1e12,
                    "peak MiB/rank": max(r["peak_mem_bytes"] for r in mine) / 2**20,
                    "max err": max(r["max_err"] for r in mine),
                }
            )
        sec.note(
            f"{ranks} ranks share one device over {several}: their communication is copies on one device "
            "(through host memory with gloo) and they share its compute: not a multi-GPU number"
        )
        sec.table(
            f"{ranks} ranks on one device (harness.run_strategy)",
            ["strategy", "ranks", "causal", "layout", "tokens", "s", "TFLOP/s (all ranks)", "peak MiB/rank", "max err"],
            world_rows,
        )
