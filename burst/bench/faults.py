"""Fault stress: local worlds that fail in each way a long run can, started and torn down in a row.

    python -m burst.bench.faults --worlds 30 [--seed 0] [--out benchmarks/faults.md]

Each faulty world runs burst.attention (zigzag, causal; on a CPU host its shared-memory channels open)
and one rank fails: it raises after the forward ("raise"), is killed with SIGKILL between the forward
and the backward while its peers wait in the ring ("kill"), never makes the call its peers are in
("stall": they wait in the agreement check, whose timeout is set to STALL_S), or stops itself with
SIGSTOP there ("freeze": alive, so only the wait's check of its state names it, after STALL_S). Every faulty world is
followed by a clean one. Each world must end within BOUND_S with the right error (WorldError naming
the failed rank, or the rank whose wait timed out), leave no process and no /dev/shm/burst-* file, and
the clean worlds must succeed. tests/test_faults.py runs a short form; `--worlds 30` the long one.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import random
import signal
import time

import torch

FAULTS = ("raise", "kill", "stall", "freeze")
STALL_S = 3.0  # the agreement timeout the stalled world's waiting ranks run with
BOUND_S = 45.0  # a world, from start to its error, start-up included (2 cores)


def faulty_rank(rank: int, world: int, fault: str, victim: int) -> float:
    import burst

    burst.set_agreement_timeout(STALL_S)
    q = torch.randn(1, 64, 2, 16, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    if fault == "stall" and rank == victim:
        time.sleep(10 * BOUND_S)  # alive, but never calls: its peers must not wait for it forever
    out = burst.attention(q, q, q, causal=True, layout="zigzag")
    if rank == victim and fault == "raise":
        raise RuntimeError(f"planted fault on rank {rank}")
    if rank == victim and fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == victim and fault == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but frozen, inside the call's ring: its peers must name it
    out.sum().backward()
    return float(q.grad.abs().sum())


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/burst-*"))


def run_one(fault: str | None, victim: int, world: int) -> dict:
    """One world with `fault` on rank `victim` (None: a clean world); what happened, and whether it
    was right."""
    from ..launch import WorldError, spawn_world

    before, start = _shm_files(), time.monotonic()
    error, failed_rank = None, None
    try:
        spawn_world(faulty_rank, fault or "none", victim, nproc=world, threads=1, timeout=2 * BOUND_S)
    except WorldError as err:
        error, failed_rank = f"rank {err.rank}: {err.summary}", err.rank
    except TimeoutError as err:  # the launcher's own limit: a world that hung
        error = f"TimeoutError: {err}"
    elapsed = time.monotonic() - start
    left_files = sorted(_shm_files() - before)
    left_processes = [p.pid for p in mp.active_children()]
    if fault is None:
        right = error is None
    elif fault == "raise":
        right = failed_rank == victim and "planted fault" in (error or "")
    elif fault == "kill":  # the killed rank named, as killed (its peers' broken connections come after)
        right = failed_rank == victim and f"killed by signal {int(signal.SIGKILL)}" in (error or "")
    elif fault == "stall":  # a waiting rank's agreement timeout, naming the call
        right = failed_rank is not None and failed_rank != victim and "TimeoutError" in (error or "")
    else:  # freeze: a waiting rank names the stopped one after the agreement timeout
        right = failed_rank not in (None, victim) and f"rank {victim}" in (error or "") and "stopped" in (error or "")
    ok = right and elapsed < BOUND_S and not left_files and not left_processes
    return {
        "fault": fault or "none",
        "victim": victim,
        "seconds": elapsed,
        "error": error,
        "failed_rank": failed_rank,
        "left_files": left_files,
        "left_processes": left_processes,
        "ok": ok,
    }


def plan(worlds: int, seed: int, world: int) -> list[tuple[str | None, int]]:
    """`worlds` worlds: faults (each kind at least once when there is room) each followed by a clean world."""
    rng = random.Random(seed)
    faults = [FAULTS[i % len(FAULTS)] for i in range(worlds // 2)]
    rng.shuffle(faults)
    out = []
    for fault in faults:
        out += [(fault, rng.randrange(world)), (None, 0)]
    return out + [(None, 0)] * (worlds - len(out))


def stress(worlds: int = 30, seed: int = 0, world: int = 2) -> list[dict]:
    return [run_one(fault, victim, world) for fault, victim in plan(worlds, seed, world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/faults.md")
    args = parser.parse_args()
    start = time.time()
    rows = stress(args.worlds, args.seed, args.nproc)
    lines = [
        "# Fault stress: worlds that fail, one after another",
        "",
        f"Made by `python -m burst.bench.faults --worlds {args.worlds} --seed {args.seed} --nproc {args.nproc}` "
        f"in {time.time() - start:.0f} s (torch {torch.__version__}, 2-core CPU). What each fault is and what "
        "counts as right: `burst/bench/faults.py`.",
        "",
        f"- worlds: {len(rows)}, right: {sum(r['ok'] for r in rows)}; longest: "
        f"{max(r['seconds'] for r in rows):.1f} s (bound {BOUND_S:.0f} s)",
        "",
        "| # | fault | victim | seconds | error | files left | processes left | right |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        error = (r["error"] or "").replace("|", "/")[:110]
        lines.append(
            f"| {i} | {r['fault']} | {r['victim']} | {r['seconds']:.1f} | {error} | {len(r['left_files'])} | "
            f"{len(r['left_processes'])} | {'yes' if r['ok'] else 'NO'} |"
        )
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}: {sum(r['ok'] for r in rows)} of {len(rows)} right")


if __name__ == "__main__":
    main()
