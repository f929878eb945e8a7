"""`burst bench --report` and `--calibrate` write what they promise (a small sweep, real runs)."""

from __future__ import annotations

import json
import os

import pytest

REPORT = [
    "bench",
    "--report-seq-lens",
    "256,512",
    "--report-worlds",
    "1,2",
    "--strategies",
    "burst,ring",
    "--causal",
    "--layout",
    "zigzag",
    "--heads",
    "2",
    "--head-dim",
    "16",
]


@pytest.fixture(scope="module")
def report_run(tmp_path_factory):
    """`burst bench --report DIR` once, through the verb's main in this process (its worlds start from here);
    the sweep's calibration, the module's one calibrate() (seconds of CPU), is also saved to a file on the
    way: (exit status, DIR, the file, the path the report asked calibrate to save to, what calibrate returned)."""
    import burst.bench.report as report
    from burst.bench.calibrate import calibrate
    from burst.cli import main

    tmp = tmp_path_factory.mktemp("report")
    saved, asked, returned = tmp / "calibration.json", [], []

    def calibrate_and_save(threads=1, path=None):
        asked.append(path)
        returned.append(calibrate(threads=threads, path=str(saved)))
        return returned[-1]

    patch = pytest.MonkeyPatch()
    patch.setattr(report, "calibrate", calibrate_and_save)
    try:
        status = main([REPORT[0], "--report", str(tmp / "report"), *REPORT[1:]])
    finally:
        patch.undo()
    return status, tmp / "report", saved, asked, returned


def test_report_writes_markdown_json_and_plots(report_run):
    status, out, _, _, _ = report_run
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert {(r["seq_len"], r["strategy"]) for r in results["timing"]} == {
        (n, s) for n in (256, 512) for s in ("burst", "ring")
    }
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 and r["sent_per_rank"] > 0 for r in results["timing"])
    assert {(r["world"], r["strategy"]) for r in results["memory"]} == {
        (g, s) for g in (1, 2) for s in ("burst", "ring")
    }
    report = (out / "report.md").read_text()
    assert "Planner vs measurement" in report and "| 512 | ring |" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("matplotlib is not installed (pip install matplotlib)")
    for plot in ("time_vs_seq.png", "memory_vs_world.png", "bytes_per_rank.png", "predicted_vs_measured.png"):
        assert (out / plot).stat().st_size > 1000 and f"]({plot})" in report


def test_calibration_is_saved_and_read_by_the_local_profile(report_run):
    """calibrate(path=...) writes what calibrated_local(path) reads (the report's sweep calibrates without
    saving; its calibration, saved here, is the one the report used)."""
    from burst.plan.profiles import calibrated_local

    _, out, saved, asked, (result,) = report_run
    assert asked == [None]
    assert result["flops"] > 1e8 and result["bandwidth"] > 1e6 and result["latency"] >= 0
    local = calibrated_local(str(saved))
    assert local.flops == result["flops"] and local.inter_bw == result["bandwidth"]
    assert json.loads((out / "results.json").read_text())["calibration"] == result


def test_heap_peak_sees_a_tensor_held_in_each_phase_and_keeps_a_timeline():
    """The engine's memory ruler (benchmarks/engine_memory.py): a 64 MiB tensor alive during the forward
    and a 32 MiB one made in the backward show in each phase's peak; the timeline and progress calls
    come as the region goes."""
    import torch
    from burst.bench.memory import HeapPeak

    mib = 2**20
    x = torch.ones(1024, requires_grad=True)
    calls = []
    with HeapPeak(interval_s=1e-9, on_interval=calls.append) as ruler:
        held = torch.ones(16 * mib)  # 64 MiB of float32, alive until after the backward
        y = (x * 2).sum()
        x.register_hook(lambda g: g + torch.zeros(8 * mib).sum())  # 32 MiB made inside the backward
        y.backward()
        del held
    assert ruler.peak["forward"] - ruler.start >= 64 * mib
    assert ruler.peak["backward"] - ruler.at_backward >= 32 * mib - mib
    assert ruler.at_backward - ruler.start >= 64 * mib  # what the forward left alive
    assert 0 <= ruler.peak_s["forward"] <= ruler.peak_s["backward"]
    assert calls and len(ruler.timeline) == len(calls)
    assert {phase for _, phase, _ in ruler.timeline} == {"forward", "backward"}
    assert max(live for _, _, live in ruler.timeline) == max(ruler.peak.values())
    with HeapPeak(interval_s=3600.0) as long_ruler:  # no interval ends inside: the exit keeps the last one
        kept = torch.ones(4 * mib)
    assert [(phase, live >= long_ruler.start + 16 * mib) for _, phase, live in long_ruler.timeline] == [
        ("forward", True)
    ]
    del kept
