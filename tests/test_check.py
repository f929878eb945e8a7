"""burst.check / `burst check`: every strategy passes on worlds 2-4, and a planted defect fails.

One world per size runs burst.check over every strategy, layout, causal, fp32 and bf16; the planted
defect (dq 0.1% off on one rank's kernel) runs in the world of 2 and, through the CLI, under torchrun.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import burst
from world import results_by_world

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _checks(rank, world):
    report = burst.check(seq_len=48, heads=4, kv_heads=2, head_dim=16, dtype=("float32", "bfloat16"))
    planted = None
    if world == 2:
        import burst.kernels.cpu_flash as cpu_flash

        honest = cpu_flash.backward
        if rank == 1:
            cpu_flash.backward = lambda *a, **k: (lambda g: (g[0] * 1.001, g[1], g[2]))(honest(*a, **k))
        try:
            planted = burst.check(strategies=("burst", "ring"), layouts=("zigzag",), seq_len=48, heads=4, head_dim=16)
        finally:
            cpu_flash.backward = honest
    return report.as_dict(), planted.as_dict() if planted else None


_results = results_by_world(_checks, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_strategy_passes_and_report_is_identical_on_every_rank(world):
    reports = [report for report, _ in _results(world)]
    assert all(r == reports[0] for r in reports)
    report = reports[0]
    assert report["ok"], [row for row in report["rows"] if row["status"] == "FAIL"]
    ran = {(row["strategy"], row["layout"]) for row in report["rows"] if row["status"] == "ok"}
    for strategy in ("burst", "ring", "allgather"):
        assert {(strategy, lay) for lay in ("contiguous", "zigzag", "striped")} <= ran
    assert ("distflash", "contiguous") in ran
    # Unsupported combinations are reported as skipped, never as passing.
    assert all(
        row["status"] == "skipped"
        for row in report["rows"]
        if row["strategy"] == "distflash" and row["layout"] != "contiguous"
    )


def test_planted_defect_is_caught():
    planted = [p for _, p in _results(2)]
    assert planted[0] == planted[1]
    assert not planted[0]["ok"]
    failed = [row for row in planted[0]["rows"] if row["status"] == "FAIL"]
    assert failed and all(row["errors"]["dq"] > row["bound"] for row in failed)
    # Only dq is wrong; the check must not blame the rest.
    assert all(row["errors"]["out"] < row["bound"] and row["errors"]["dk"] < row["bound"] for row in failed)


def _cli(args, torchrun_nproc=None, script=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if torchrun_nproc:
        cmd = [
            str(pathlib.Path(sys.executable).parent / "torchrun"),
            "--standalone",
            f"--nproc-per-node={torchrun_nproc}",
            str(script),
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "burst", "check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_cli_passes_and_fails_on_planted_defect_under_torchrun():
    args = ["--seq-len", "32", "--heads", "2", "--head-dim", "16", "--strategies", "burst,ring", "--layouts", "zigzag"]
    clean = _cli([*args, "--nproc", "2"])
    assert clean.returncode == 0, clean.stdout + clean.stderr[-2000:]
    assert "all cases within their bounds" in clean.stdout
    bad = _cli(args, torchrun_nproc=2, script=ROOT / "tests" / "clients" / "planted_defect_check.py")
    assert bad.returncode == 1, bad.stdout + bad.stderr[-2000:]
    assert "FAIL: burst layout=zigzag" in bad.stdout and "FAIL: ring layout=zigzag" in bad.stdout
