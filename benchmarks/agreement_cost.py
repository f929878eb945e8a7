"""What the cross-rank agreement check costs per call, against the attention call it guards.

2 local gloo ranks x 1 thread, fp32, 8 heads, dim 64, causal zigzag, burst strategy. For each
sequence length: the check alone (burst.agreement.agree with the facts of that call, mean of many
calls), and one attention forward+backward with the check "always" vs "off" (best of a few).
Writes benchmarks/agreement.md. Run alone (it uses both cores):

    .venv/bin/python benchmarks/agreement_cost.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import burst
from burst import agreement
from burst.launch import spawn_world

LENGTHS = (4096, 16384)
HEADS, DIM = 8, 64


def _time_attention(q, k, v, dout, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # one warm-up
        dist.barrier()
        start = time.perf_counter()
        out = burst.attention(q, k, v, layout="zigzag", causal=True)
        out.backward(dout)
        best = min(best, time.perf_counter() - start)
    return best


def _rank(rank, world) -> list[tuple]:
    rows = []
    for n in LENGTHS:
        local = n // world
        q, k, v = (torch.randn(1, local, HEADS, DIM, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, local, HEADS, DIM)
        facts = {
            "batch": 1,
            "seqlen": local,
            "heads": HEADS,
            "kv_heads": HEADS,
            "head_dim": DIM,
            "dtype": "torch.float32",
            "strategy": "burst",
            "layout": "zigzag",
            "causal": True,
            "window": None,
            "softmax_scale": DIM**-0.5,
            "return_lse": False,
            "cu_seqlens": None,
            "block_sparse": None,
        }
        calls = 200
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            agreement.agree("bench", facts, None, None, world)
        check_s = (time.perf_counter() - start) / calls
        burst.set_agreement_check("always")
        with_check = _time_attention(q, k, v, dout, repeats=3)
        burst.set_agreement_check("off")
        without = _time_attention(q, k, v, dout, repeats=3)
        burst.set_agreement_check("always")
        rows.append((n, check_s, with_check, without))
    return rows


def main() -> None:
    rows = spawn_world(_rank, nproc=2, threads=1)[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Agreement check: cost per call",
        "",
        "Every `burst.attention`, `burst.shard` and `burst.unshard` call first checks that all ranks pass",
        "the same options and shard shapes (`burst/agreement.py`: one all_gather of two int64 per rank).",
        f"2 gloo ranks x 1 thread, fp32, {HEADS} heads, dim {DIM}, burst, causal zigzag; commit {commit}.",
        "",
        "| tokens | check alone (us) | attention fwd+bwd, check on (ms) | check off (ms) | check's share |",
        "|---|---|---|---|---|",
    ]
    for n, check_s, on, off in rows:
        lines.append(f"| {n} | {check_s * 1e6:.0f} | {on * 1e3:.1f} | {off * 1e3:.1f} | {check_s / on:.2%} |")
    lines += [
        "",
        '"check alone" is the mean of 200 calls of `agree` with the facts of one attention call; the',
        "attention columns are the best of 3 timed passes after a warm-up (their difference is within noise;",
        "the share uses the check's own time). On CUDA the check also syncs the host once per call",
        '(`.cpu()` on the gathered digests); `burst.set_agreement_check("first")` skips it after the first',
        "call of each signature. Not measured on a GPU (none was lent to this task). Taken while other",
        "work shared the two cores: the attention times are slower than core.md's; the share is the point.",
        "",
        "Command: `.venv/bin/python benchmarks/agreement_cost.py`",
    ]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agreement.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
