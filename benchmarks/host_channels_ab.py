"""Shared-memory channels on and off (BURST_HOST_CHANNELS_MB=0), interleaved: `burst bench` and
`burst train` on 2 local ranks x 1 thread. Prints a Markdown table of medians over the pairs.

    .venv/bin/python benchmarks/host_channels_ab.py [PAIRS]

Each pair runs the job with the channels off, then on, so the machine's drift reaches both alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

BURST = os.path.join(os.path.dirname(sys.executable), "burst")
BENCH = [
    BURST,
    "bench",
    "--heads",
    "8",
    "--head-dim",
    "64",
    "--dtype",
    "float32",
    "--nproc",
    "2",
    "--threads",
    "1",
    "--repeats",
    "3",
    "--no-baseline",
]
JOBS = {  # label -> command (the output file is added per run)
    "bench 4K tokens, full (2K-row shards)": BENCH + ["--seq-len", "4096", "--strategies", "burst,ring"],
    "bench 8K tokens, causal zigzag": BENCH
    + ["--seq-len", "8192", "--causal", "--layout", "zigzag", "--strategies", "burst,ring"],
    "bench 8K tokens, 8 documents, doc_zigzag": BENCH
    + ["--seq-len", "8192", "--causal", "--documents", "8", "--layout", "doc_zigzag", "--strategies", "burst"],
    "train tiny, 4K tokens (step s)": [
        BURST,
        "train",
        "--model",
        "tiny",
        "--seq-len",
        "4096",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--no-progress",
    ],
    "train small, 8K tokens (step s)": [
        BURST,
        "train",
        "--model",
        "small",
        "--seq-len",
        "8192",
        "--nproc",
        "2",
        "--steps",
        "4",
        "--no-progress",
    ],
}


def _seconds(label: str, command: list[str], channels_mb: int) -> dict[str, float]:
    """{name: seconds} for one run: fwd+bwd per strategy (bench), median step after the first (train)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        extra = ["--json", out] if command[1] == "bench" else ["--metrics", out]
        env = {**os.environ, "BURST_HOST_CHANNELS_MB": str(channels_mb)}
        subprocess.run(command + extra, check=True, env=env, capture_output=True)
        if command[1] == "bench":
            rows = json.load(open(out))["strategies"]
            return {r["strategy"]: r["fwd_s"] + r["bwd_s"] for r in rows}
        steps = [json.loads(line) for line in open(out)]
        return {"burst": statistics.median(s["step_s"] for s in steps[1:])}


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print("| job | strategy | gloo s (median) | channels s (median) | channels / gloo (median of pairs) | pairs |")
    print("|---|---|---|---|---|---|")
    for label, command in JOBS.items():
        runs = [(_seconds(label, command, 0), _seconds(label, command, 4)) for _ in range(pairs)]
        for name in runs[0][0]:
            off = [a[name] for a, _ in runs]
            on = [b[name] for _, b in runs]
            ratio = statistics.median(b / a for a, b in zip(off, on))
            print(
                f"| {label} | {name} | {statistics.median(off):.3f} | {statistics.median(on):.3f} | "
                f"{ratio:.3f} | {pairs} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
