"""`burst bench --report DIR`: a sweep, a Markdown report and PNG plots, with the planner's predictions.

The sweep (each point a fresh local world, as `burst bench` runs it):
- time vs sequence length per strategy, on `nproc` ranks;
- peak memory per rank vs world size, at the middle sequence length;
- bytes sent per rank per strategy;
- the planner's predicted wall time (burst.plan, `local` profile calibrated first on this machine)
  against the measured one, and how close it came.

Writes DIR/report.md, DIR/results.json and DIR/*.png (matplotlib; `pip install matplotlib`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

from .calibrate import calibrate
from .harness import BenchConfig, run_bench


def _progress(total: int):
    """A progress callback: tqdm when installed, else one line per point on stderr."""
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="burst bench --report", unit="run")
        return lambda label: (bar.set_postfix_str(label), bar.update(1))
    except ImportError:
        count = [0]
        start = time.perf_counter()

        def step(label):
            count[0] += 1
            print(f"[{count[0]}/{total}] {label} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

        return step


def predicted_wall(profile, cfg: BenchConfig, strategy: str, world: int) -> float:
    """The planner's forward + backward time for one bench point."""
    from ..plan import Cluster, Workload, estimate

    cluster = Cluster(gpus=world, gpus_per_node=world, profile=profile)
    workload = Workload(
        seq_len=cfg.seq_len,
        heads=cfg.heads,
        head_dim=cfg.head_dim,
        kv_heads=cfg.kv_heads,
        batch=cfg.batch,
        causal=cfg.causal,
        dtype_bytes=4 if cfg.dtype == "float32" else 2,
        layout=cfg.layout,
    )
    return estimate(strategy, cluster, workload).wall_s


def run_report(
    outdir: str,
    seq_lens=(2048, 4096, 8192),
    strategies=("burst", "ring", "allgather"),
    worlds=(1, 2, 4),
    nproc: int = 2,
    causal: bool = True,
    layout: str = "zigzag",
    heads: int = 8,
    head_dim: int = 64,
    repeats: int = 1,
) -> dict:
    """Run the sweep and write the report; returns what results.json holds."""
    from ..plan.profiles import PROFILES

    os.makedirs(outdir, exist_ok=True)
    total = 1 + len(seq_lens) + len(worlds)
    step = _progress(total)
    calibration = calibrate(threads=1, path=None)  # the report uses it; `--calibrate` saves one
    step("calibrated")
    profile = replace(
        PROFILES["local"],
        flops=calibration["flops"],
        intra_bw=calibration["bandwidth"],
        inter_bw=calibration["bandwidth"],
        intra_latency=calibration["latency"],
        inter_latency=calibration["latency"],
    )
    base = BenchConfig(
        heads=heads,
        head_dim=head_dim,
        causal=causal,
        layout=layout,
        nproc=nproc,
        threads=1,
        repeats=repeats,
        strategies=list(strategies),
        baseline=False,
    )
    timing = []
    for n in seq_lens:
        cfg = replace(base, seq_len=n)
        for row in run_bench(cfg)["strategies"]:
            timing.append(
                {
                    "seq_len": n,
                    "strategy": row["strategy"],
                    "measured_s": row["fwd_s"] + row["bwd_s"],
                    "predicted_s": predicted_wall(profile, cfg, row["strategy"], nproc),
                    "sent_per_rank": row["sent_fwd_per_rank"] + row["sent_bwd_per_rank"],
                    "peak_mem_per_rank": row["peak_mem_per_rank"],
                }
            )
        step(f"{n} tokens")
    memory = []
    mid = seq_lens[len(seq_lens) // 2]
    for g in worlds:
        cfg = replace(base, seq_len=mid, nproc=g, layout=layout if mid % (2 * g) == 0 else "contiguous")
        for row in run_bench(cfg)["strategies"]:
            memory.append({"world": g, "strategy": row["strategy"], "peak_mem_per_rank": row["peak_mem_per_rank"]})
        step(f"world {g}")
    command = "burst bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    results = {
        "calibration": calibration,
        "timing": timing,
        "memory": memory,
        "command": command,
        "config": {
            "heads": heads,
            "head_dim": head_dim,
            "causal": causal,
            "layout": layout,
            "nproc": nproc,
            "dtype": base.dtype,
            "device": _device_name(),
            "memory_seq_len": mid,
        },
    }
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plots = _plots(outdir, results, strategies)
    with open(os.path.join(outdir, "report.md"), "w") as f:
        f.write(_markdown(results, plots))
    return results


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _what(cfg: dict) -> str:
    """The measured setting, for plot titles: ranks, dtype, device, shape, mask."""
    return (
        f"{cfg.get('dtype', 'float32')}, {cfg.get('device', 'CPU')}, {cfg['heads']} heads x {cfg['head_dim']}, "
        f"{'causal' if cfg['causal'] else 'full'}, {cfg['layout']}"
    )


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _label_ticks(ax) -> None:
    """Every axis gets labelled ticks: on a log axis at 1, 2, 5 x 10^k (a range narrower than a
    decade would otherwise show none), written plainly."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale != "log":
            continue
        axis.set_minor_formatter(NullFormatter())
        if not isinstance(axis.get_major_locator(), FixedLocator):  # ticks placed by set_xticks stay
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _plots(outdir: str, results: dict, strategies) -> list[str]:
    """The report's PNGs; [] when matplotlib is missing (the report says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []

    def save(fig, name):
        for ax in fig.axes:
            _label_ticks(ax)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, name), dpi=110)
        plt.close(fig)
        made.append(name)

    timing, memory, cfg = results["timing"], results["memory"], results["config"]
    what = _what(cfg)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for s in strategies:
        pts = [(r["seq_len"], r["measured_s"]) for r in timing if r["strategy"] == s]
        ax.plot(*zip(*pts), marker="o", label=s)
    lengths = sorted({r["seq_len"] for r in timing})
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="global sequence length (tokens)",
        ylabel="forward + backward (s)",
        title=f"time vs sequence length, {cfg['nproc']} ranks\n{what}",
    )
    ax.set_xticks(lengths, [_tokens(n) for n in lengths])
    ax.legend()
    save(fig, "time_vs_seq.png")

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for s in strategies:
        pts = [(r["world"], r["peak_mem_per_rank"] / 2**20) for r in memory if r["strategy"] == s]
        ax.plot(*zip(*pts), marker="o", label=s)
    worlds = sorted({r["world"] for r in memory})
    ax.set_xticks(worlds, [str(g) for g in worlds])  # world sizes are whole ranks
    ax.set(
        xlabel="world size (ranks)",
        ylabel="peak memory per rank (MiB)",
        title=f"memory per rank vs world size, {_tokens(cfg.get('memory_seq_len', 0))} tokens\n{what}",
    )
    ax.legend()
    save(fig, "memory_vs_world.png")

    fig, ax = plt.subplots(figsize=(6, 4.2))
    longest = max(r["seq_len"] for r in timing)
    rows = [r for r in timing if r["seq_len"] == longest]
    ax.bar([r["strategy"] for r in rows], [r["sent_per_rank"] / 2**20 for r in rows])
    ax.set(
        xlabel="strategy",
        ylabel="sent per rank, forward + backward (MiB)",
        title=f"bytes sent per rank, {_tokens(longest)} tokens, {cfg['nproc']} ranks\n{what}",
    )
    save(fig, "bytes_per_rank.png")

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for s in strategies:
        pts = [(r["predicted_s"], r["measured_s"]) for r in timing if r["strategy"] == s]
        ax.scatter(*zip(*pts), label=s)
    lo = min(min(r["predicted_s"], r["measured_s"]) for r in timing)
    hi = max(max(r["predicted_s"], r["measured_s"]) for r in timing)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="grey", alpha=0.2, label="±25%")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="predicted forward + backward (s)",
        ylabel="measured forward + backward (s)",
        title=f"planner vs measurement, {cfg['nproc']} ranks, {_tokens(lengths[0])}-{_tokens(lengths[-1])} "
        f"tokens\n{what}",
    )
    ax.legend()
    save(fig, "predicted_vs_measured.png")
    return made


def _markdown(results: dict, plots: list[str]) -> str:
    cal, cfg = results["calibration"], results["config"]
    ratios = [r["measured_s"] / r["predicted_s"] for r in results["timing"]]
    within = sum(0.75 <= x <= 1.25 for x in ratios)
    lines = [
        "# burst bench report",
        "",
        f"{cfg['nproc']} local ranks x 1 thread, fp32, {cfg['heads']} heads of {cfg['head_dim']}, "
        f"{'causal' if cfg['causal'] else 'full'}, layout {cfg['layout']}.",
        f"Calibration (at 4096 tokens, burst, full mask): {cal['flops'] / 1e9:.0f} GFLOP/s per rank through the "
        f"whole loop ({cal.get('kernel_flops', cal['flops']) / 1e9:.0f} for the kernel alone), "
        f"{cal['bandwidth'] / 1e9:.2f} GB/s and {cal['latency'] * 1e6:.0f} us between ranks.",
        "",
        f"Planner vs measurement: {within} of {len(ratios)} points within ±25% "
        f"(measured / predicted from {min(ratios):.2f} to {max(ratios):.2f}).",
        "",
        "| tokens | strategy | measured s | predicted s | measured / predicted | MiB sent per rank "
        "| peak MiB per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["timing"]:
        lines.append(
            f"| {r['seq_len']} | {r['strategy']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{r['measured_s'] / r['predicted_s']:.2f} | {r['sent_per_rank'] / 2**20:.1f} | "
            f"{r['peak_mem_per_rank'] / 2**20:.0f} |"
        )
    lines += ["", "| ranks | strategy | peak MiB per rank |", "|---|---|---|"]
    for r in results["memory"]:
        lines.append(f"| {r['world']} | {r['strategy']} | {r['peak_mem_per_rank'] / 2**20:.0f} |")
    lines.append("")
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    if plots:
        lines += [f"![{p[:-4]}]({p})" for p in plots]
    else:
        lines.append("(no plots: matplotlib is not installed; `pip install matplotlib`)")
    return "\n".join(lines) + "\n"
