"""The engine's activation memory with a ruler that sees tensors, and the longest sequence in 4 GiB.

    .venv/bin/python benchmarks/engine_memory.py --modes full,remat,selective --ffn-chunk 2048  # 8K, 16K, 32K tokens
    .venv/bin/python benchmarks/engine_memory.py --lengths 262144 --modes selective --ffn-chunk 2048  # one length
    .venv/bin/python benchmarks/engine_memory.py --report      # the tables of benchmarks/engine_memory.md
    .venv/bin/python benchmarks/engine_memory.py --lengths 417792 --modes remat --ffn-chunk 2048 --interval 20
    .venv/bin/python benchmarks/engine_memory.py --keep-partial benchmarks/engine/partial-remat-417792.json --commit C
        # a step too long for a session: stopped once its top layer's backward has passed (the step's peak,
        # see the timeline table), its partial row kept

Each point is a fresh 2-rank world (1 thread per rank) training `burst train --model small`'s model
(burst zigzag, fused loss, fp32): one warm-up step at 256 tokens (it creates the gradients and AdamW's
state), then one step at the length under bench.memory.HeapPeak, which reads glibc's live heap after
every tensor op. Rank 0's numbers, in MiB: `start` (weights, gradients, optimizer state, process
heap), `kept` (what the forward leaves for the backward: the live heap at the backward's first op,
minus start), `forward_peak` and `backward_peak` (the peaks of the step's forward and backward ops,
minus start) and the ops they came after, and peak RSS. Appends one JSON line per point to
benchmarks/engine/heap.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "engine", "heap.jsonl")
MIB = 2**20
BUDGET_MIB = 4096  # the live heap a rank may hold: weights, gradients, AdamW state, activations


def _row(ruler, model: str, mode: str, ffn_chunk: int, seq_len: int, world: int) -> dict:
    """What the ruler has measured, in MiB above the step's start (totals where named so)."""
    return {
        "model": model,
        "mode": mode,
        "ffn_chunk": ffn_chunk,
        "seq_len": seq_len,
        "world": world,
        "start_mib": ruler.start / MIB,
        "kept_mib": None if ruler.at_backward is None else (ruler.at_backward - ruler.start) / MIB,
        **{f"{phase}_peak_mib": (ruler.peak[phase] - ruler.start) / MIB for phase in ruler.peak},
        **{f"{phase}_peak_op": ruler.peak_op[phase] for phase in ruler.peak},
        **{f"{phase}_peak_s": ruler.peak_s[phase] for phase in ruler.peak},
        "total_peak_mib": max(ruler.peak.values()) / MIB,
        "timeline": [(round(t, 1), phase, round(live / MIB, 1)) for t, phase, live in ruler.timeline],
    }


def _write_partial(path: str, row: dict) -> None:
    """Replace `path` with the row so far (a run stopped before the step ends leaves this)."""
    with open(path + ".tmp", "w") as f:
        json.dump(row, f)
    os.replace(path + ".tmp", path)


def measure(
    rank: int, world: int, mode: str, seq_len: int, model: str, ffn_chunk: int, interval_s: float = 0.0
) -> dict:
    from burst.bench.memory import HeapPeak, peak_bytes, reset_peak
    from burst.engine.parallel import setup
    from burst.engine.train import TokenSource, TrainConfig, build, train_step

    cfg = TrainConfig(model=model, seq_len=seq_len, checkpointing=mode, ffn_chunk=ffn_chunk, steps=1, progress=False)
    par = setup(1)
    net = build(cfg, par)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = dataclasses.replace(cfg, seq_len=256)
    train_step(net, optimizer, TokenSource(warm, net.cfg.vocab_size).batch(0), warm, par)
    batch = TokenSource(cfg, net.cfg.vocab_size).batch(1)
    gc.collect()
    reset_peak(torch.device("cpu"))
    partial = os.path.join(os.path.dirname(OUT), f"partial-{mode}-{seq_len}.json")

    def progress(ruler):
        if rank == 0:
            _write_partial(
                partial,
                {
                    **_row(ruler, model, mode, ffn_chunk, seq_len, world),
                    "finished": False,
                    "rss_peak_mib": peak_bytes(torch.device("cpu")) / MIB,
                    "elapsed_s": time.perf_counter() - started,
                },
            )

    started = time.perf_counter()
    with HeapPeak(interval_s, progress if interval_s > 0 else None) as ruler:
        train_step(net, optimizer, batch, cfg, par)
    seconds = time.perf_counter() - started
    if rank == 0 and os.path.exists(partial):
        os.remove(partial)  # the step ended: its row goes to heap.jsonl
    return {
        **_row(ruler, model, mode, ffn_chunk, seq_len, world),
        "rss_peak_mib": peak_bytes(torch.device("cpu")) / MIB,
        "step_s": seconds,
    }


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares MiB per 1K tokens through (seq_len, MiB) points."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return 1024 * sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def report(rows: list[dict]) -> str:
    """Markdown: every measured point, then per code version and mode the growth per 1K tokens and
    the length at which the step's peak live heap reaches BUDGET_MIB (a line through the points)."""
    lines = [
        "| code | checkpointing | ffn chunk | tokens | kept | forward peak | backward peak | peak live heap "
        "(total) | peak RSS | step s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['commit']} | {r['mode']} | {r['ffn_chunk']} | {r['seq_len']} | {r['kept_mib']:.0f} | "
            f"{r['forward_peak_mib']:.0f} | {r['backward_peak_mib']:.0f} | {r['total_peak_mib']:.0f} | "
            f"{r['rss_peak_mib']:.0f} | {_step_cell(r)} |"
        )
    lines += [
        "",
        "| code | checkpointing | kept MiB per 1K tokens | backward peak MiB per 1K tokens | "
        f"tokens at {BUDGET_MIB} MiB of live heap (line through the points) | longest run |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("finished", True):  # a stopped step is not on the line (its own rows say what it reached)
            groups.setdefault((r["commit"], r["mode"]), []).append(r)
    for (commit, mode), points in groups.items():
        if len({p["seq_len"] for p in points}) < 2:
            continue
        kept = _slope([(p["seq_len"], p["kept_mib"]) for p in points])
        fits, grows = [], {}
        for phase in ("forward", "backward"):  # each phase's peak on its own line; the first to reach the budget
            line = [(p["seq_len"], p["start_mib"] + p[f"{phase}_peak_mib"]) for p in points]
            grows[phase] = _slope(line)
            last_len, last_peak = max(line)
            fits.append(last_len + (BUDGET_MIB - last_peak) / grows[phase] * 1024)
        lines.append(
            f"| {commit} | {mode} | {kept:.1f} | {grows['backward']:.1f} | {min(fits) / 1000:.0f}K | "
            f"{max(p['seq_len'] for p in points)} |"
        )
    lines += [
        "",
        "| code | checkpointing | tokens | backward under way by (s) | each layer's backward peak, live heap MiB "
        "(seconds) | step s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("timeline"):
            began = next((t for t, phase, _ in r["timeline"] if phase == "backward"), None)
            spikes = ", ".join(f"{mib:.0f} ({t:.0f})" for t, mib in layer_spikes(r["timeline"]))
            lines.append(f"| {r['commit']} | {r['mode']} | {r['seq_len']} | {began} | {spikes} | {_step_cell(r)} |")
    return "\n".join(lines)


def _step_cell(row: dict) -> str:
    """A step's seconds, or where a stopped step (--keep-partial) was stopped."""
    return f"{row['step_s']:.0f}" if row.get("finished", True) else f"stopped at {row['elapsed_s']:.0f}"


def layer_spikes(timeline: list, drop_mib: float = 16.0) -> list[tuple[float, float]]:
    """The backward's sawtooth tops: each interval whose live heap the next interval undercuts by more than
    `drop_mib` (a layer's recompute and gradients freed), as (seconds, MiB). The backward walks the
    layers top-down, so the i-th top is the i-th layer from the top."""
    back = [(t, mib) for t, phase, mib in timeline if phase == "backward"]
    return [(t, mib) for (t, mib), (_, after) in zip(back, back[1:]) if mib > after + drop_mib]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--modes", default="none,full,remat,selective")
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ffn-chunk", type=int, default=0, help="blockwise feedforward: tokens per chunk (0 = off)")
    parser.add_argument("--commit", default="", help="recorded with each row")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds per timeline interval of the live heap; > 0 also writes "
        "benchmarks/engine/partial-MODE-LEN.json as the step goes (0 = off)",
    )
    parser.add_argument("--report", action="store_true", help="print the tables from the recorded points")
    parser.add_argument(
        "--keep-partial",
        metavar="FILE",
        help="append a stopped step's partial-MODE-LEN.json to the recorded points (with --commit)",
    )
    args = parser.parse_args()
    if args.keep_partial:
        with open(args.keep_partial) as f:
            row = {**json.load(f), "commit": args.commit}
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")
        os.remove(args.keep_partial)
        return
    if args.report:
        print(report([json.loads(line) for line in open(OUT)]))
        return
    sys.path.insert(0, ROOT)
    from burst.launch import run_world

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    for seq_len in (int(n) for n in args.lengths.split(",")):
        for mode in args.modes.split(","):
            row = run_world(
                measure,
                mode,
                seq_len,
                args.model,
                args.ffn_chunk,
                args.interval,
                nproc=args.nproc,
                threads=1,
                env={"MALLOC_MMAP_THRESHOLD_": "1048576"},
            )
            row["commit"] = args.commit
            print(json.dumps(row), flush=True)
            with open(OUT, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
