"""scripts/gpu_train_lengths.py (issue 70's length search on a lent GPU) in its CPU mode: a tiny
llama3-kind model at tiny lengths runs every kind of trial (burst's speed points, transformers doubling,
the planner's longest for a checkpointing mode), so the script cannot rot before a GPU runs it; and the
GPU plan (a dry run) takes its lengths from the planner and keeps within its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_train_lengths.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_cpu_mode_runs_every_kind_of_trial(tmp_path):
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--cpu", "--modes", "full", "--budget", "400"],
        capture_output=True,
        text=True,
        timeout=500,  # beside another worker's tests
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["results"]
    assert all(r["ok"] for r in runs), runs
    kinds = {(r["engine"], r["purpose"]) for r in runs}
    assert kinds == {
        ("burst", "speed"),
        ("transformers", "longest"),
        ("burst", "longest"),
        ("transformers + burst", "longest"),  # LlamaForCausalLM on burst's backend, fused loss (issue 70 item 4)
    }, kinds
    assert [r["seq_len"] for r in runs if r["engine"] == "transformers"] == [64, 128]  # doubling (to 128 on the CPU)
    for r in runs:
        assert r["step_s"] >= r["optimizer_s"] >= 0 and r["peak_host_bytes"] > 0 and r["tokens_per_s"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "## Against transformers" in report and "- longest step: burst" in report
    assert "burst, full + host optimizer:" in report and "planner's longest" in report
    assert "- longest step through transformers: on burst's backend with fused_loss 64, plain 128" in report
    # `burst train` past the longest (on the CPU its step raises CUDA's error, tests/clients/oom_site): one line
    oom = results["out_of_memory"]
    assert oom["ok"] and "exit 1, 1 stderr line(s): burst train: error: rank 0: TrainOutOfMemory" in oom["why"], oom
    assert "left in /dev/shm by exited processes: nothing" in oom["why"] and "as it should be" in report


def test_gpu_plan_takes_the_planners_lengths_within_the_budget(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--profile", "H100", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    planned = json.loads((tmp_path / "results.json").read_text())["skipped"]
    lengths = {(p["engine"], p["option"], p["seq_len"]) for p in planned}
    assert ("burst", "full + host optimizer", 32768) in lengths and (
        "burst",
        "full + host optimizer",
        131072,
    ) in lengths
    assert ("transformers", "sdpa + gradient checkpointing", 8192) in lengths
    from burst.plan import Cluster, Training, profile
    from burst.plan.lengths import MEMORY_OPTIONS, longest_length
    from burst.plan.models import PRESETS

    longest = longest_length(
        "burst",
        Cluster(1, 1, profile("H100")),
        Training(
            PRESETS["llama3-8b"],
            1024,
            fsdp=False,
            host_memory_bytes=128 * 2**30,
            **MEMORY_OPTIONS["selective + host optimizer"][0],
        ),
        granule=8192,
    )
    assert ("burst", "selective + host optimizer", int(longest * 0.9) // 8192 * 8192) in lengths
