"""benchmarks/cqs.md: CQS-Attention's Table 2 at our scale (simulated workers on the real schedule)
and the bytes per rank of cqs against the ring as W grows (from the schedule: the volumes that
tests/test_cqs.py asserts CommStats measures).

    .venv/bin/python benchmarks/cqs_report.py      # ~2 minutes; run alone
"""

import os
import subprocess

import torch

from burst.bench.cqs_sim import table2
from burst.cqs import interest_set, schedule

torch.set_num_threads(2)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
lines = [
    "# CQS-Attention",
    "",
    "## Table 2 at our scale: W workers simulated one after another on one process (2 threads)",
    "",
    'Forward, fp32, 8 heads of 64, full mask. Each worker runs exactly the plan `strategy="cqs"` runs',
    '(strategies/cqs.py: call_schedule, worker_forward); "straggler" is the slowest worker; MiB are the',
    "tensors a worker holds (its materials and partial results) against one process's q, k, v, out.",
    f"Commit {commit}.",
    "",
]
for n in (4096, 16384):
    lines += [f"### {n} tokens", "", table2(workers=(2, 3, 4, 7, 8, 13, 16), seq_lens=(n,)), ""]
lines += [
    "## Bytes sent per rank, forward, in shards (one rank's Q, K or V)",
    "",
    "cqs: Q and K, V to the workers whose quorum lists the rank's group, (out, lse) partials back (max over",
    "ranks); ring/burst: G - 1 K, V blocks. From the distilled schedule, as CommStats measures it.",
    "",
    "| W | interest set size | cqs (max over ranks) | ring / burst |",
    "|---|---|---|---|",
]
for w in (2, 3, 4, 5, 7, 8, 13, 16, 31, 64):
    s = schedule(w)
    per_rank = []
    for r in range(w):
        q_out = sum(r in s.q_materials[x] for x in range(w) if x != r)
        kv_out = sum(r in s.kv_materials[x] for x in range(w) if x != r)
        back = sum(1 for x in s.q_materials[r] if x != r)
        per_rank.append(q_out + 2 * kv_out + back * (1 + 1 / 64))  # partial out and lse (d = 64) per group
    lines.append(f"| {w} | {len(interest_set(w))} | {max(per_rank):.1f} | {2 * (w - 1)} |")
lines += [
    "",
    "cqs moves about 3(|I| - 1) + (|I| - 1) shards where the ring moves 2(G - 1): fewer from W = 7 on,",
    "and in one exchange instead of G - 1 steps, but it holds |I| groups at once (the MiB column above).",
    "",
    "Command: `.venv/bin/python benchmarks/cqs_report.py`",
]
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cqs.md")
measured = ""  # the section benchmarks/cqs_memory.py --write keeps there
if os.path.exists(path):
    marker = "## Measured on real ranks"
    text = open(path).read()
    measured = "\n" + marker + text.partition(marker)[2] if marker in text else ""
with open(path, "w") as f:
    f.write("\n".join(lines) + "\n" + measured)
print("\n".join(lines))
