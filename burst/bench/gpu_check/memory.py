"""Section 4: the longest sequence whose fwd+bwd fits (burst vs SDPA), peak memory per rank, and
the engine trained at the longest length each checkpointing mode reaches.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from burst.bench.harness import BenchConfig, run_strategy
from burst.bench.harness import _sync as sync
from burst.launch import spawn_world

from .cases import Sizes, is_oom, random_inputs, release_memory
from .report import Report, Section, first_line
from .speed import RUNNERS, bench_rank


def longest(fits, start: int, limit: int, granularity: int, deadline: float, note, label: str) -> dict:
    """The longest length (a multiple of `granularity`) for which fits(n) is True: doubling from
    `start`, then bisecting, each trial only while the deadline allows (a trial at twice the length
    is taken to cost 4.5x the last one). fits(n): True, or False for out of memory; an error raised
    ends the search and is recorded. Returns the bracket and what stopped the search."""
    good, bad, last_s, why, n = None, None, 0.0, "limit", start

    def trial(n):
        nonlocal last_s
        began = time.monotonic()
        ok = fits(n)
        if ok:
            last_s = time.monotonic() - began
        return ok

    try:
        while n <= limit:
            if deadline - time.monotonic() < 4.5 * last_s + 2:
                why = "time"
                break
            if not trial(n):
                bad, why = n, "memory"
                break
            good, n = n, n * 2
        while why == "memory" and good is not None and bad - good > granularity:
            mid = (good + bad) // 2 // granularity * granularity
            if mid <= good:
                break
            if deadline - time.monotonic() < 2.5 * last_s + 2:
                why = "memory, bisection cut by time"
                break
            if trial(mid):
                good = mid
            else:
                bad = mid
    except Exception as err:  # noqa: BLE001 - a failure that is not out-of-memory: recorded, search over
        why = f"error at {n}: {first_line(err)[:150]}"
    note(f"{label}: longest that ran {good}, shortest that did not {bad} (search stopped by {why})")
    return {"what": label, "fits": good, "does not fit": bad, "stopped by": why}


def memory_trial(device: torch.device, cap: int | None, run) -> tuple[bool, int]:
    """Run `run()` once; (fit, peak bytes above what was allocated before). On CUDA fit = no
    torch.cuda.OutOfMemoryError; on the CPU fit = peak RSS growth under `cap` (no OOM to hit)."""
    from burst.bench.memory import held_bytes, peak_bytes, reset_peak

    release_memory(device)
    reset_peak(device)
    base = held_bytes(device)
    out_of_memory = False
    try:
        run()
        sync(device)
    except Exception as err:  # noqa: BLE001
        if not is_oom(err):
            raise
        out_of_memory = True  # freed below, once the exception (and the tensors its frames hold) is gone
    if out_of_memory:
        release_memory(device)
        return False, -1
    peak = peak_bytes(device) - base
    release_memory(device)
    return (cap is None or peak <= cap), peak


def fwd_bwd_once(name: str, n: int, sizes: Sizes, device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, dout = random_inputs(
        sizes.mem_batch, n, sizes.mem_heads, sizes.mem_heads, sizes.mem_dim, dtype, device, on_device=True
    )
    forward, backward, _ = RUNNERS[name](q, k, v, dout, True, device)
    backward(forward())


def train_steps(sizes: Sizes, device, mode: str, n: int, steps: int = 2, model=None) -> dict:
    """The engine's model (engine/train.build, or `model` as given: FSDP2-sharded) on this device under
    bf16 autocast, `steps` AdamW steps at n tokens with checkpointing `mode`. `burst train` itself
    places nothing on a device (the model stays on the CPU), so the steps are driven here as
    engine/train.train_step does."""
    from burst.engine.train import TokenSource, TrainConfig, build

    cfg = TrainConfig(model=sizes.train_model, seq_len=n, steps=steps, checkpointing=mode, progress=False)
    model = build(cfg).to(device) if model is None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    data = TokenSource(cfg, model.cfg.vocab_size)
    positions = torch.arange(n, device=device).expand(cfg.batch, -1)
    losses, began = [], time.perf_counter()
    for step in range(steps):
        tokens = data.batch(step).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], positions, targets=tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    sync(device)
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss {losses} at {n} tokens, checkpointing {mode}")
    return {"losses": losses, "s_per_step": (time.perf_counter() - began) / steps}


def section_memory(rep: Report, several: str | None) -> None:
    with rep.section("4", "Memory: longest fwd+bwd, peak per rank, training length per checkpointing mode") as sec:
        sizes, device = rep.sizes, rep.device
        shape = f"batch {sizes.mem_batch} x {sizes.mem_heads} heads x dim {sizes.mem_dim}, causal, " + (
            "bf16" if device.type == "cuda" else "float32"
        )
        sec.note(
            f"longest fwd+bwd at {shape}; "
            + (
                "ran = no torch.cuda.OutOfMemoryError on the whole GPU"
                if device.type == "cuda"
                else f"CPU mode: ran = peak RSS growth under {sizes.mem_cap_bytes >> 20} MiB"
            )
        )
        found, peaks = [], {}
        for i, name in enumerate(("sdpa", "burst.attention")):

            def fits(n, name=name):
                ok, peak = memory_trial(device, sizes.mem_cap_bytes, lambda: fwd_bwd_once(name, n, sizes, device))
                if ok:
                    peaks[(name, n)] = peak
                return ok

            deadline = time.monotonic() + sec.left() * (0.3 if i == 0 else 0.45)
            found.append(
                longest(
                    fits,
                    sizes.mem_start,
                    sizes.mem_limit,
                    max(sizes.mem_start // 2, 1),
                    deadline,
                    sec.note,
                    f"{name} at one rank",
                )
            )
        sec.table(
            f"longest sequence, fwd+bwd, one rank ({shape})", ["what", "fits", "does not fit", "stopped by"], found
        )
        common = [n for (name, n) in peaks if name == "sdpa" and ("burst.attention", n) in peaks]
        if common and device.type == "cuda":  # RSS growth at the CPU's tiny sizes says nothing
            n = max(common)
            sec.note(
                f"peak above the inputs at {n} tokens: burst.attention {peaks[('burst.attention', n)] / 2**20:.0f} "
                f"MiB, SDPA {peaks[('sdpa', n)] / 2**20:.0f} MiB "
                f"({peaks[('burst.attention', n)] / max(peaks[('sdpa', n)], 1):.2f}x)"
            )
        _peak_per_rank(sec, sizes, device, several)
        _train_lengths(sec, sizes, device)


def _peak_per_rank(sec: Section, sizes: Sizes, device, several: str | None) -> None:
    """burst's peak per rank on G ranks sharing the device against 1/G of its peak on one rank."""
    if several is None:
        sec.note("peak per rank vs the 1/G share: no several-rank world ran on this device (section 2)")
        return
    if sec.skip_for_time("peak per rank vs the 1/G share", 40):
        return
    cfg = BenchConfig(
        seq_len=sizes.world_speed_len,
        heads=sizes.mem_heads,
        head_dim=sizes.mem_dim,
        dtype=sizes.speed_dtype,
        causal=True,
        layout="zigzag",
        repeats=0,
        check_rows=8,
    )
    one = run_strategy(cfg, "burst", 0, 1)["peak_mem_bytes"]  # this process, no group
    rows = [
        {"ranks": 1, "tokens": cfg.seq_len, "peak MiB/rank": one / 2**20, "1/G share MiB": one / 2**20, "x share": 1.0}
    ]
    for ranks in sizes.world_ranks:
        if sec.skip_for_time(f"peak per rank at {ranks} ranks", 20):
            break
        per_rank = spawn_world(
            bench_rank,
            [(dataclasses.asdict(dataclasses.replace(cfg, nproc=ranks)), "burst")],
            device.type,
            nproc=ranks,
            backend=several,
            threads=sizes.threads,
            timeout=max(10.0, min(sec.left(), sizes.spawn_timeout)),
        )
        peak = max(r[0]["peak_mem_bytes"] for r in per_rank)
        rows.append(
            {
                "ranks": ranks,
                "tokens": cfg.seq_len,
                "peak MiB/rank": peak / 2**20,
                "1/G share MiB": one / ranks / 2**20,
                "x share": peak / (one / ranks),
            }
        )
    sec.table(
        "burst.attention peak memory per rank vs the 1/G share of one rank's (inputs included)",
        ["ranks", "tokens", "peak MiB/rank", "1/G share MiB", "x share"],
        rows,
    )


def _train_lengths(sec: Section, sizes: Sizes, device) -> None:
    from burst.engine.checkpointing import MODES

    sec.note(
        "the engine on one device attends with torch SDPA (SequenceAttention at world 1); remat and "
        "selective replay the stored output through burst's single-device strategy and kernels"
    )
    rows, stats = [], {}
    for i, mode in enumerate(MODES):

        def fits(n, mode=mode):
            box = {}
            ok, peak = memory_trial(device, None, lambda: box.update(train_steps(sizes, device, mode, n)))
            if ok:
                stats[(mode, n)] = {**box, "peak": peak}
            return ok

        deadline = time.monotonic() + sec.left() / (len(MODES) - i)
        got = longest(
            fits,
            sizes.train_start,
            sizes.train_limit,
            max(sizes.train_start // 2, 1),
            deadline,
            sec.note,
            f"{sizes.train_model} model, checkpointing {mode}",
        )
        best = stats.get((mode, got["fits"]), {})
        rows.append(
            {
                "checkpointing": mode,
                "longest trained": got["fits"],
                "did not fit": got["does not fit"],
                "stopped by": got["stopped by"],
                "peak MiB": best["peak"] / 2**20 if best else None,
                "s/step": best.get("s_per_step"),
                "losses": ", ".join(f"{x:.3f}" for x in best.get("losses", [])),
            }
        )
        if got["stopped by"].startswith("error"):
            sec.fail(f"training with checkpointing {mode}: {got['stopped by']}")
    sec.table(
        f"engine '{sizes.train_model}' model, 2 AdamW steps under bf16 autocast, one device, tokens per sequence",
        ["checkpointing", "longest trained", "did not fit", "stopped by", "peak MiB", "s/step", "losses"],
        rows,
    )
