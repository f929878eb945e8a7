"""BurstEngine's Table 2 ablation and Table 5's shape, at CPU scale (the 4 GiB lengths: engine_memory.py).

    .venv/bin/python benchmarks/engine_bench.py            # writes benchmarks/engine.md (+ engine/*.jsonl)

Every point is its own `burst train` run (a fresh local world, so peak RSS belongs to that point
alone), model `small` (LLaMA vocabulary, dim 256, 4 layers), burst zigzag, fp32, 1 thread per rank,
MALLOC_MMAP_THRESHOLD_=1048576 so that RSS follows the live heap (benchmarks/memory_notes.md).
Peak memory is rank 0's peak RSS over the run; "activations" subtracts the same run at 256 tokens
(weights, gradients, AdamW state and the process itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "engine")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}


def run(name: str, seq_len: int, nproc: int, steps: int, *flags: str) -> dict:
    """The last step's metrics of one `burst train` run (cached in benchmarks/engine/NAME.jsonl)."""
    path = os.path.join(OUT, f"{name}.jsonl")
    if not os.path.exists(path):
        cmd = [
            sys.executable,
            "-m",
            "burst",
            "train",
            "--model",
            "small",
            "--seq-len",
            str(seq_len),
            "--steps",
            str(steps),
            "--nproc",
            str(nproc),
            "--no-progress",
            "--metrics",
            path,
            *flags,
        ]
        start = time.time()
        subprocess.run(cmd, check=True, env=ENV, cwd=ROOT, capture_output=True, text=True)
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    rows = [json.loads(line) for line in open(path)]
    timed = rows[1:] or rows  # the first step warms up
    rate = sum(r["tokens_per_s_per_device"] for r in timed) / len(timed)
    return {**rows[-1], "tokens_per_s_per_device": rate, "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows)}


ABLATION = (  # Table 2: what each piece adds, at 8K tokens on 2 ranks
    ("logits built, no checkpointing", ["--no-fused-loss"]),
    ("+ fused LM head and loss", []),
    ("+ full checkpointing", ["--checkpointing", "full"]),
    ("+ remat-aware checkpointing (DistFlashAttn)", ["--checkpointing", "remat"]),
    ("+ sequence-level selective checkpointing", ["--checkpointing", "selective"]),
    ("+ selective + blockwise feedforward (1024)", ["--checkpointing", "selective", "--ffn-chunk", "1024"]),
)


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")[:48]


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    lines = [
        "# Engine: BurstEngine's ablation, memory as sequence and world grow, the longest sequence in 4 GiB",
        "",
        "Command: `.venv/bin/python benchmarks/engine_bench.py` (each point a fresh `burst train --model small`",
        "world: LLaMA vocabulary 32000, dim 256, 4 layers, 4 heads / 2 KV heads; burst zigzag, fp32, 1 thread",
        "per rank, `MALLOC_MMAP_THRESHOLD_=1048576`). CPU only: no GPU was lent to this task, so these are",
        "the shapes of BurstEngine's tables at CPU scale, not their numbers. Peak memory = rank 0's peak RSS;",
        "*activations* subtracts the same configuration at 256 tokens (weights, gradients, AdamW state, process).",
        "",
    ]
    base = {
        flags_key: run(f"base_{slug(flags_key)}", 256, 2, 2, *flags)
        for flags_key, flags in (("fused", []), ("unfused", ["--no-fused-loss"]))
    }
    floor_at = {g: run(f"base_g{g}", 256, g, 2)["peak_mem_bytes"] for g in (1, 2, 4, 8)}

    lines += [
        "## Table 2's ablation (8192 tokens, 2 ranks; tokens/s: mean of steps 2 and 3)",
        "",
        "| configuration | tokens/s per rank | peak MiB/rank | activations MiB/rank | vs previous row |",
        "|---|---|---|---|---|",
    ]
    previous = None
    for label, flags in ABLATION:
        m = run(f"ablation_{slug(label)}", 8192, 2, 3, *flags)
        floor = base["unfused" if "--no-fused-loss" in flags else "fused"]["peak_mem_bytes"]
        act = (m["peak_mem_bytes"] - floor) / 2**20
        change = "" if previous is None else f"{act / previous:.2f}x"
        lines.append(
            f"| {label} | {m['tokens_per_s_per_device']:.0f} | {m['peak_mem_bytes'] / 2**20:.0f} | "
            f"{act:.0f} | {change} |"
        )
        previous = act
    lines += ["", "(tokens/s: 2 ranks on 2 cores; the step includes the optimizer and the gradient all-reduce.)", ""]

    lines += [
        "## Table 5's shape: memory per rank as sequence and world grow together (2048 tokens per rank)",
        "",
        "Selective checkpointing, fused loss, 2 steps; activations against the same G at 256 tokens. G = 4 and",
        "8 share the 2 cores: their memory is meaningful, their speed is not.",
        "",
        "| ranks G | tokens | peak MiB/rank | activations MiB/rank |",
        "|---|---|---|---|",
    ]
    for g in (1, 2, 4, 8):
        m = run(f"scale_g{g}", 2048 * g, g, 2, "--checkpointing", "selective")
        lines.append(
            f"| {g} | {2048 * g} | {m['peak_mem_bytes'] / 2**20:.0f} | "
            f"{(m['peak_mem_bytes'] - floor_at[g]) / 2**20:.0f} |"
        )

    lines += [
        "",
        "## The longest sequence a rank trains on in 4 GiB",
        "",
        "Measured with a ruler that sees tensors, not peak RSS: benchmarks/engine_memory.md "
        "(`benchmarks/engine_memory.py`).",
        "",
    ]
    with open(os.path.join(ROOT, "benchmarks", "engine.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
