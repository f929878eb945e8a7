"""--device / --dtype and binding each rank to its GPU (burst/devices.py), on a CPU-only machine.

What a GPU box would see is played by monkeypatching torch.cuda's queries; what runs for real here
is the CPU side: the verbs refuse a device or dtype they cannot run before any rank starts, and
bf16 training (autocast) follows fp32 training closely.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from burst import devices, launch


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this process sees n CUDA devices; set_device calls are recorded in the returned list."""
    calls = []

    def make(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
        return calls

    return make


def test_auto_takes_cuda_only_when_every_local_rank_has_a_gpu(gpus):
    gpus(8)
    assert devices.resolve_device("auto", 8) == "cuda" and devices.resolve_device("cuda", 8) == "cuda"
    assert devices.resolve_device("auto", 16) == "cpu"  # 16 ranks would share 8 GPUs: not by default
    with pytest.raises(ValueError, match=r"^--device: cuda needs a GPU per rank: 16 ranks on this machine, 8 GPU"):
        devices.resolve_device("cuda", 16)
    gpus(0)
    assert devices.resolve_device("auto", 1) == "cpu" and devices.resolve_device("cpu", 4) == "cpu"
    with pytest.raises(ValueError, match=r"^--device: cuda, but this machine has no CUDA device"):
        devices.resolve_device("cuda", 1)
    assert devices.backend_for("cuda") == "nccl" and devices.backend_for("cpu") == "gloo"


def test_each_rank_binds_cuda_local_rank(gpus, monkeypatch):
    calls = gpus(4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.bind("cuda") == torch.device("cuda", 3) and calls == [("set_device", 3)]
    assert devices.bind("cpu") == torch.device("cpu") and len(calls) == 1
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(RuntimeError, match="LOCAL_RANK 4 but 4 GPU"):
        devices.bind("cuda")


def test_under_torchrun_the_gpu_is_bound_before_nccl_starts(gpus, monkeypatch):
    """NCCL takes the current device when its group starts: bound after, every rank would meet on GPU 0."""
    events = gpus(2)
    for name, value in dict(LOCAL_RANK="1", RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(launch, "_close_world", lambda: events.append(("close",)))
    assert launch._in_torchrun_world(lambda rank, world: (rank, world), (), None) == (1, 2)
    assert events == [("set_device", 1), ("init", "nccl"), ("close",)]
    events.clear()  # --device cpu on a GPU box: gloo, no GPU bound
    launch._in_torchrun_world(lambda rank, world: None, (), None, backend="gloo")
    assert events == [("init", "gloo"), ("close",)]


def _burst(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "burst", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture
def no_world(monkeypatch):
    """Starting any rank fails the test: a refusal must come before that."""

    def refuse(*args, **kwargs):
        raise AssertionError("a world was started for a value the verb cannot run")

    import burst.bench.harness

    for module in (launch, burst.bench.harness):
        monkeypatch.setattr(module, "spawn_world", refuse)
        monkeypatch.setattr(module, "run_world", refuse)


def _refusal(capsys, *argv) -> str:
    """`burst ARGV` in this process: exit status 2 and its one line on stderr, returned."""
    from burst.cli import main

    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and "\n" not in err, (argv, err)
    return err


def test_verbs_refuse_a_device_or_dtype_they_cannot_run_before_any_rank_starts(gpus, capsys, no_world):
    """Each verb in this process (no rank may start), on a machine with no GPU; the installed command
    once, as a user runs it, to show the exit status and the line reach the shell."""
    gpus(0)
    for verb in ("train", "generate", "bench", "check"):
        err = _refusal(capsys, verb, "--device", "cuda", "--nproc", "2")
        assert "--device: cuda, but this machine has no CUDA device" in err, (verb, err)
    assert "--dtype" in _refusal(capsys, "train", "--dtype", "fp16")
    done = _burst("train", "--device", "cuda", "--nproc", "2")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--device: cuda, but this machine has no CUDA device" in done.stderr, done.stderr


def test_one_table_reads_every_dtype_name():
    """devices.DTYPE_ALIASES is the one reading of a --dtype name: torch's names and the short ones, in
    any case, to torch's name, the one kernels.reference, burst.check and the benchmarks look up."""
    from burst.engine.train import TrainConfig
    from burst.kernels import reference

    assert devices.DTYPES == reference.DTYPES
    for name, dtype in devices.DTYPES.items():
        assert str(dtype) == f"torch.{name}" and devices.parse_dtype(name) is dtype
    assert devices.canonical_dtype("BF16") == "bfloat16" and devices.parse_dtype("fp16") is torch.float16
    with pytest.raises(ValueError, match=r"^--dtype: 'half' is not one of float32 \(fp32\), bfloat16 \(bf16\)$"):
        devices.canonical_dtype("half", ("float32", "bfloat16"))
    TrainConfig(seq_len=64, dtype="bf16", device="cpu").check(2)  # the library takes either spelling too
    with pytest.raises(ValueError, match=r"^--dtype: training takes float32 \(fp32\), bfloat16 \(bf16\) .*loss"):
        TrainConfig(seq_len=64, dtype="fp16", device="cpu").check(2)


def test_bf16_training_follows_fp32(tmp_path):
    """burst train --dtype bf16 (autocast; fp32 weights, gradients and optimizer state) on 2 ranks."""
    from burst.cli import main

    losses = {}
    for dtype in ("fp32", "bf16"):  # in this process: the command's path, without a second interpreter
        metrics = tmp_path / f"{dtype}.jsonl"
        argv = ["train", "--nproc", "2", "--device", "cpu", "--dtype", dtype, "--steps", "3", "--seq-len", "128"]
        assert main([*argv, "--no-progress", "--metrics", str(metrics)]) == 0
        losses[dtype] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["bf16"]) == 3 and losses["bf16"] != losses["fp32"]  # it did run in bf16
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) < 2e-2 * abs(a), losses


def test_kernel_by_name_or_a_clear_error(monkeypatch, capsys, no_world):
    """BURST_KERNEL (what --kernel sets) picks a backend; one that cannot run here is a ValueError from
    burst.attention's validation (raised on every rank before any collective), not a crash inside."""
    import burst
    from burst import kernels

    cpu = torch.device("cpu")
    monkeypatch.setenv("BURST_KERNEL", "reference")
    assert kernels.select_kernel(cpu, torch.float32) is kernels.reference
    q = torch.randn(1, 8, 2, 8)
    ref = burst.attention(q, q, q, causal=True)  # one process, through the reference kernel
    monkeypatch.delenv("BURST_KERNEL")
    assert torch.allclose(ref, burst.attention(q, q, q, causal=True), atol=1e-6)
    for name, words in (
        ("flash_attn", "needs CUDA tensors"),
        ("sdpa", "needs CUDA tensors"),
        ("nonsense", "is not one of auto"),
    ):
        monkeypatch.setenv("BURST_KERNEL", name)
        with pytest.raises(ValueError, match=words):
            burst.attention(q, q, q, causal=True)
    monkeypatch.delenv("BURST_KERNEL")
    err = _refusal(capsys, "check", "--kernel", "flash_attn", "--nproc", "2")
    assert "--kernel: BURST_KERNEL=flash_attn: needs CUDA tensors" in err, err


def test_a_bad_burst_kernel_in_the_environment_is_named_as_such(monkeypatch, capsys, no_world):
    """BURST_KERNEL=bogus with --kernel auto had been reported as every case refused under --strategies."""
    monkeypatch.setenv("BURST_KERNEL", "bogus")
    err = _refusal(capsys, "check", "--nproc", "2", "--seq-len", "64")
    assert "environment: BURST_KERNEL='bogus' is not one of" in err and "--strategies" not in err, err
