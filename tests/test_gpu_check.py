"""scripts/gpu_check.sh in its CPU mode, end to end, and the checks it relies on (issue 27).

The GPU run itself needs a CUDA machine; here the same code paths run at tiny sizes on the CPU
(BURST_DEVICE=cpu), so the script cannot rot, and the CUDA SDPA adapter runs against stand-ins
for aten's efficient-attention ops that enforce the CUDA kernels' alignment rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import types

import burst
import pytest
import torch
from burst.bench import gpu_check
from burst.kernels import cpu_flash, cuda_sdpa
from burst.kernels.reference import BOUNDS

import sdpa_stand_in
from world import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "BURST_DEVICE": "cpu", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "report.json") as f:
        data = json.load(f)
    return data, (out / "report.md").read_text(), (out / "log.txt").read_text()


def _section(data, sid):
    return next(s for s in data["sections"] if s["id"] == sid)


def _table(section, name_start):
    return next(t for t in section["tables"] if t["name"].startswith(name_start))


def test_cpu_mode_writes_every_section_and_all_pass(cpu_report):
    data, md, log = cpu_report
    assert data["mode"] == "cpu" and data["ok"], [(s["id"], s["status"], s["notes"]) for s in data["sections"]]
    assert [s["id"] for s in data["sections"]] == ["1", "2", "3", "4", "5", "6"]
    for s in data["sections"]:
        assert s["status"] == "ok" and not s["error"], s
        assert f"## {s['id']}. {s['title']}" in md
    assert "all sections ok" in log


def test_cpu_mode_kernel_rows_cover_every_mask_and_dtype_within_bounds(cpu_report):
    rows = _table(_section(cpu_report[0], "1"), "block step")["rows"]
    covered = {(r["kernel"], r["dtype"], r["mask"]) for r in rows}
    for kernel, dtypes in (("cpu_flash", ("float32", "bfloat16")), ("reference", ("float64",))):
        for dtype in dtypes:
            assert {(kernel, dtype, m) for m in gpu_check.KERNEL_CASES} <= covered
    for r in rows:
        assert r["status"] == "ok", r
        assert all(r[q] <= BOUNDS[r["dtype"]] for q in gpu_check.QUANTITIES), r
        assert "->" in r["tiles"]  # which kernel served which tile is reported
    causal = next(r for r in rows if r["mask"] == "causal" and r["kernel"] == "cpu_flash")
    assert "DIAG" in causal["tiles"] and "FULL" in causal["tiles"]  # split: diagonal and off-diagonal tiles
    striped = next(r for r in rows if r["mask"] == "causal_striped" and r["kernel"] == "cpu_flash")
    n = gpu_check.CPU_SIZES.kernel_len // 2
    assert f"DIAG {n - 1}x{n - 1}" in striped["tiles"]  # j < i: one causal tile one row short
    sdpa = _table(_section(cpu_report[0], "1"), "torch SDPA")["rows"]
    assert any(r["backend"] == "MATH" and r["status"] == "ok" for r in sdpa)


def test_cpu_mode_worlds_check_every_strategy_and_layout(cpu_report):
    section = _section(cpu_report[0], "2")
    for label in ("1 rank (gloo)", "2 ranks (gloo)"):
        checked = _table(section, f"{label}: burst.check")["rows"]
        masks = _table(section, f"{label}: masks")["rows"]
        assert not [r for r in checked + masks if r["status"] == "FAIL"]
        ran = {(r["strategy"], r["layout"]) for r in checked if r["status"] == "ok"}
        assert {s for s, _ in ran} == set(burst.api.STRATEGIES)
        assert {m for m in ("window", "documents", "documents_window", "block_sparse")} == {
            r["mask"] for r in masks if r["status"] == "ok"
        }
    probes = _table(section, "several ranks")["rows"]
    assert probes[0]["backend"] == "gloo" and probes[0]["exchange"] is True


def test_cpu_mode_speed_memory_and_features(cpu_report):
    data = cpu_report[0]
    speed = _table(_section(data, "3"), "one device")["rows"]
    assert len(speed) == 2 * len(gpu_check.CPU_SIZES.speed_lens)
    assert all(isinstance(r["block_step TFLOP/s"], float) and r["block_step TFLOP/s"] > 0 for r in speed)
    assert all(isinstance(r["burst.attention x SDPA"], float) for r in speed)
    memory = _section(data, "4")
    longest = _table(memory, "longest sequence")["rows"]
    assert {r["what"] for r in longest} == {"sdpa at one rank", "burst.attention at one rank"}
    assert all(r["fits"] for r in longest)
    trained = _table(memory, "engine")["rows"]
    assert [r["checkpointing"] for r in trained] == ["none", "full", "remat", "selective"]
    assert all(r["longest trained"] for r in trained)
    features = {r["feature"]: r for r in _table(_section(data, "5"), "features")["rows"]}
    assert features["burst.attention under torch.autocast(bf16)"]["status"] == "ok"
    assert next(r for f, r in features.items() if f.startswith("MLA: burst.attention(latent=)"))["status"] == "ok"
    assert next(r for f, r in features.items() if "burst check" in f)["status"] == "ok"


def test_compare_catches_a_perturbed_output():
    g = torch.Generator().manual_seed(0)
    ref = [
        torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64),
        torch.randn(1, 2, 8, generator=g, dtype=torch.float64),
    ]
    ref += [torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    mine = [t.float() for t in ref]
    assert gpu_check.compare(mine, ref, "float32")[1]
    wrong = list(mine)
    wrong[0] = wrong[0].clone()
    wrong[0][0, 3, 1, 2] += 1e-2 * ref[0].abs().max()  # one entry off by 1% of the largest
    errors, ok = gpu_check.compare(wrong, ref, "float32")
    assert not ok and errors["out"] > BOUNDS["float32"]
    nan = list(mine)
    nan[2] = torch.full_like(mine[2], float("nan"))
    assert not gpu_check.compare(nan, ref, "float32")[1]
    empty_row = list(mine)
    empty_row[1] = mine[1].clone()
    empty_row[1][0, 0, 0] = float("-inf")  # a row called empty that is not
    assert not gpu_check.compare(empty_row, ref, "float32")[1]


def _planted(forward_scale=1.0, grad_scale=1.0):
    """cpu_flash with its output or its dq scaled: a wrong kernel the check must catch."""

    def forward(*args):
        out, lse = cpu_flash.forward(*args)
        return out * forward_scale, lse

    def backward(*args):
        dq, dk, dv = cpu_flash.backward(*args)
        return dq * grad_scale, dk, dv

    return types.SimpleNamespace(__name__="planted", forward=forward, backward=backward, MAX_ROWS=cpu_flash.MAX_ROWS)


@pytest.mark.parametrize("planted", [_planted(forward_scale=1.01), _planted(grad_scale=1.01)], ids=["out", "dq"])
def test_a_planted_wrong_kernel_fails_its_rows(planted):
    sec = gpu_check.Section("1", "planted", time.monotonic() + 60)
    rows = gpu_check.kernel_rows(
        sec, torch.device("cpu"), gpu_check.CPU_SIZES, [("planted", planted, (torch.float32,))]
    )
    assert len(rows) == len(gpu_check.KERNEL_CASES)
    assert all(r["status"] == "FAIL" for r in rows), rows
    assert sec.status == "FAIL"


# --- the CUDA SDPA adapter against stand-ins for aten's efficient-attention ops ----------------------


def test_cuda_sdpa_adapter_is_exact_through_the_block_step(monkeypatch):
    sdpa_stand_in.install(monkeypatch)
    sizes = gpu_check.CPU_SIZES
    sizes = type(sizes)(**{**dataclasses.asdict(sizes), "kernel_len": 120})  # rows not a multiple of 8
    sec = gpu_check.Section("1", "stand-in", time.monotonic() + 60)
    rows = gpu_check.kernel_rows(sec, torch.device("cpu"), sizes, [("cuda_sdpa", cuda_sdpa, (torch.float32,))])
    assert len(rows) == len(gpu_check.KERNEL_CASES)
    assert all(r["status"] == "ok" for r in rows), rows
    assert any("cuda_sdpa(efficient)+mask" in r["tiles"] for r in rows)  # partial tiles took the bias path


def test_cuda_sdpa_bias_is_padded_and_lse_aligned():
    q = torch.zeros(1, 5, 3, 8)
    mask = torch.rand(5, 13) > 0.5
    bias = cuda_sdpa._bias(mask, q)
    assert bias.shape == (1, 3, 5, 13) and bias.stride(2) == 16
    assert torch.equal(bias[0, 2] == 0, mask)
    lse = torch.randn(2, 3, 13)
    padded = cuda_sdpa._padded_lse(lse)
    assert padded.shape == (2, 3, 32) and torch.equal(padded[..., :13], lse)


# --- several ranks on one GPU: gloo with device tensors goes through host copies (comm/p2p.py) --------


def _check_through_host(rank, world):
    """burst.check with every exchange forced through host copies, as gloo does with CUDA tensors."""
    from burst.comm import p2p

    staged = []
    p2p.through_host = lambda group, tensors: staged.append(len(tensors)) or True
    report = burst.check(
        strategies=("burst", "ring", "distflash", "cqs", "usp"),
        seq_len=32,
        heads=2,
        head_dim=8,
        dtype=("float32", "bfloat16"),
    )
    return report.ok, [r.status for r in report.rows], len(staged)


def test_exchange_through_host_copies_is_exact_on_two_ranks():
    for ok, statuses, staged in run_world(2, _check_through_host, timeout=300):
        assert ok and "FAIL" not in statuses and staged > 0, statuses


# --- the longest-length search and its out-of-memory handling ----------------------------------------


def test_longest_doubles_then_bisects_to_the_granularity():
    notes = []
    got = gpu_check.longest(lambda n: n <= 5000, 256, 1 << 20, 128, time.monotonic() + 60, notes.append, "x")
    assert (got["fits"], got["does not fit"], got["stopped by"]) == (4992, 5120, "memory")
    assert "longest that ran 4992" in notes[0]
    assert (
        gpu_check.longest(lambda n: True, 256, 1024, 128, time.monotonic() + 60, notes.append, "x")["stopped by"]
        == "limit"
    )


def test_longest_stops_for_time_and_records_errors():
    got = gpu_check.longest(lambda n: True, 256, 1 << 20, 128, time.monotonic() - 1, lambda _: None, "x")
    assert got["fits"] is None and got["stopped by"] == "time"

    def broken(n):
        if n > 512:
            raise ValueError("not a memory problem")
        return True

    got = gpu_check.longest(broken, 256, 1 << 20, 128, time.monotonic() + 60, lambda _: None, "x")
    assert got["fits"] == 512 and got["stopped by"].startswith("error at 1024: ValueError")


def test_memory_trial_counts_a_cuda_oom_as_does_not_fit(monkeypatch):
    for name, value in (
        ("reset_peak_memory_stats", None),
        ("memory_allocated", 0),
        ("max_memory_allocated", 7),
        ("synchronize", None),
        ("empty_cache", None),
    ):
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value: value)
    cuda = torch.device("cuda")

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert gpu_check.memory_trial(cuda, None, oom) == (False, -1)
    assert gpu_check.memory_trial(cuda, None, lambda: None) == (True, 7)
    with pytest.raises(ValueError):
        gpu_check.memory_trial(cuda, None, lambda: (_ for _ in ()).throw(ValueError("a bug, not memory")))


def test_the_gpu_run_fits_a_lent_machines_ten_minutes():
    """Budgets plus start-up and one overrunning trial stay under the script's hard stop, which stays
    under the 600 s a lent machine gives one command."""
    script = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    hard_stop = int(script.split("BURST_GPU_CHECK_TIMEOUT:-")[1].split("}")[0])
    from burst.bench.gpu_check.launch import DEFAULT_SECTIONS

    assert sum(gpu_check.CUDA_SIZES.budgets[s] for s in DEFAULT_SECTIONS) + 45 <= hard_stop <= 590
    assert gpu_check.CUDA_SIZES.budgets["7"] + 45 <= hard_stop  # section 7 alone fits one command too


def test_sections_runs_only_the_sections_named(tmp_path):
    """`--sections 1`: one section in the report; an unknown number is refused before any runs."""
    from burst.bench.gpu_check.launch import main, run

    with pytest.raises(ValueError, match="no section 8"):
        run(str(tmp_path), device=torch.device("cpu"), sections=("1", "8"))
    assert not (tmp_path / "report.md").exists()
    main([str(tmp_path), "--sections", "1"])  # the shortest section
    ran = [s["id"] for s in json.load(open(tmp_path / "report.json"))["sections"]]
    assert ran == ["1"], ran


def test_section_7_times_burst_beside_torchs_kernels(tmp_path):
    """`--sections 7` (issue 66's measurements, run alone on a lent GPU): on the CPU at tiny sizes, burst
    beside SDPA (its cuDNN backend refused on the CPU, noted in the row), the masks, the ring's tiles."""
    from burst.bench.gpu_check.launch import main

    main([str(tmp_path), "--sections", "7"])
    section = _section(json.load(open(tmp_path / "report.json")), "7")
    assert section["status"] == "ok", section["notes"]
    rows = _table(section, "one rank, full and causal")["rows"]
    assert {(r["work"], r["heads"]) for r in rows} == {(w, h) for w in ("full", "causal") for h in ("4/1", "4/4")}
    assert all(isinstance(r["burst ms"], float) and r["burst x best"] > 0 for r in rows)
    assert all(r["SDPA cuDNN ms"] == "RuntimeError" for r in rows)  # a CUDA backend, refused on the CPU
    masks = _table(section, "masks at")["rows"]
    assert [r["work"] for r in masks] == ["window, causal", "16 documents, causal", "softcap 50, causal"]
    assert isinstance(masks[-1]["burst ms"], float)  # softcap on the CPU: burst's reference kernel
    ring = _table(section, "the block steps of a G-rank ring")["rows"]
    assert [(r["work"], r["G"]) for r in ring] == [(w, g) for w in ("full", "causal") for g in (2, 4, 8)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 4])  # grouped: the keys travel; multi-head: foreign out rebuilt from D
def test_ring_tiles_runner_is_the_exact_attention(causal, kv_heads):
    """The block steps section 7 times for a 4-rank ring put together give attention on the whole
    sequence (float64 reference): the figure times the ring's real work, merges included."""
    from burst.bench.gpu_check.references import ring_tiles_runner
    from burst.kernels.reference import attention
    from burst.masks import MaskSpec

    torch.manual_seed(0)
    q = torch.randn(1, 64, 4, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 64, kv_heads, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    forward, backward, _ = ring_tiles_runner(q.detach(), k.detach(), v.detach(), dout, MaskSpec(causal=causal), 4)
    state = forward()
    rows, dq, dk, dv = backward(state)
    out_ref, _ = attention(q, k, v, causal=causal)
    out_ref.backward(dout)
    for r, idx in enumerate(rows):
        torch.testing.assert_close(state[r][0], out_ref.detach()[:, idx], rtol=0, atol=1e-10)
        for got, ref in ((dq[r], q.grad), (dk[r], k.grad), (dv[r], v.grad)):
            torch.testing.assert_close(got, ref[:, idx], rtol=0, atol=1e-10)
