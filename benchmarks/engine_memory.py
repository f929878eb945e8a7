"""The engine's activation memory with a ruler that sees tensors, and the longest sequence in 4 GiB.

    .venv/bin/python benchmarks/engine_memory.py --lengths 8192,16384,32768 --modes none,full,remat,selective
    .venv/bin/python benchmarks/engine_memory.py --lengths 180224 --modes selective   # one run at a length

Each point is a fresh 2-rank world (1 thread per rank) training `burst train --model small`'s model
(burst zigzag, fused loss, fp32): one warm-up step at 256 tokens (it creates the gradients and AdamW's
state), then one step at the length under bench.memory.HeapPeak, which reads glibc's live heap after
every tensor op. Rank 0's numbers, in MiB: `start` (weights, gradients, optimizer state, process
heap), `kept` (what the forward leaves for the backward: the live heap at the backward's first op,
minus start), `forward_peak` and `backward_peak` (the peaks of the step's forward and backward ops, minus
start) and the ops they came after. Appends one JSON
line per point to benchmarks/engine/heap.jsonl.
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


def measure(rank: int, world: int, mode: str, seq_len: int, model: str, ffn_chunk: int) -> dict:
    from burst.bench.memory import HeapPeak, peak_bytes, reset_peak
    from burst.engine.parallel import setup
    from burst.engine.train import TokenSource, TrainConfig, build, train_step

    cfg = TrainConfig(model=model, seq_len=seq_len, checkpointing=mode, ffn_chunk=ffn_chunk, steps=1,
                      progress=False)
    par = setup(1)
    net = build(cfg, par)
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = dataclasses.replace(cfg, seq_len=256)
    train_step(net, optimizer, TokenSource(warm, net.cfg.vocab_size).batch(0), warm, par)
    batch = TokenSource(cfg, net.cfg.vocab_size).batch(1)
    gc.collect()
    reset_peak(torch.device("cpu"))
    started = time.perf_counter()
    with HeapPeak() as ruler:
        train_step(net, optimizer, batch, cfg, par)
    seconds = time.perf_counter() - started
    return {"model": model, "mode": mode, "ffn_chunk": ffn_chunk, "seq_len": seq_len, "world": world, "start_mib": ruler.start / MIB,
            "kept_mib": (ruler.at_backward - ruler.start) / MIB,
            **{f"{phase}_peak_mib": (ruler.peak[phase] - ruler.start) / MIB for phase in ruler.peak},
            **{f"{phase}_peak_op": ruler.peak_op[phase] for phase in ruler.peak},
            "total_peak_mib": max(ruler.peak.values()) / MIB,
            "rss_peak_mib": peak_bytes(torch.device("cpu")) / MIB, "step_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--modes", default="none,full,remat,selective")
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ffn-chunk", type=int, default=0, help="blockwise feedforward: tokens per chunk (0 = off)")
    parser.add_argument("--commit", default="", help="recorded with each row")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from burst.launch import run_world

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    for seq_len in (int(n) for n in args.lengths.split(",")):
        for mode in args.modes.split(","):
            row = run_world(measure, mode, seq_len, args.model, args.ffn_chunk, nproc=args.nproc, threads=1,
                            env={"MALLOC_MMAP_THRESHOLD_": "1048576"})
            row["commit"] = args.commit
            print(json.dumps(row), flush=True)
            with open(OUT, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
