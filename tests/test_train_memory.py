"""`burst train`'s memory options and the llama3-8b preset (issue 70), on the CPU.

The host offloads (engine/offload.py) change where tensors live, never the numbers: every step's loss
and every parameter's gradient equal, bit for bit, the same run with them off, for each checkpointing
mode; with every memory option on (checkpointing, blockwise feedforward, fused loss, both offloads)
they equal the plain run to float32 rounding. The llama3-8b preset is checked by its shapes, built on
the meta device (no 8B parameters allocated here), and trained scaled down. Running out of memory is
one line from `burst train` (a simulated torch.OutOfMemoryError), exit status 1, nothing left in /dev/shm.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sys

import pytest
import torch
from burst.engine.model import PRESETS, Transformer
from burst.engine.train import TokenSource, TrainConfig, build, make_optimizer, train_step

STEPS = 3


def _run(cfg: TrainConfig, par=None):
    """Each step's loss and every parameter's gradient (captured as it completes in the backward,
    before an optimizer that steps inside the backward takes it)."""
    model = build(cfg, par)
    grads: dict = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    optimizer = make_optimizer(model, cfg)
    data = TokenSource(cfg, model.cfg.vocab_size)
    losses, per_step = [], []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * (step + 1) / STEPS
        timings = {}
        losses.append(train_step(model, optimizer, data.batch(step), cfg, par, timings=timings))
        assert timings["optimizer_s"] >= 0
        per_step.append(dict(grads))
        grads.clear()
    return losses, per_step


def _config(**options):
    return TrainConfig(model="tiny", seq_len=64, batch=2, steps=STEPS, lr=1e-2, warmup=1, **options)


@pytest.mark.parametrize("mode", ["full", "remat", "selective"])
def test_host_offloads_leave_every_loss_and_gradient_unchanged(mode):
    kept = _run(_config(checkpointing=mode, ffn_chunk=16))
    offloaded = _run(_config(checkpointing=mode, ffn_chunk=16, offload_activations=True, offload_optimizer=True))
    assert kept[0] == offloaded[0], (kept[0], offloaded[0])  # losses, every step, bit for bit
    for step, (a, b) in enumerate(zip(kept[1], offloaded[1])):
        assert a.keys() == b.keys() and len(a) == len(list(build(_config()).parameters()))
        for name in a:
            assert torch.equal(a[name], b[name]), (mode, step, name)
    # every option on against none of them (fused loss off, no checkpointing, no chunks): float32 rounding
    plain = _run(_config(fused_loss=False))
    for a, b in zip(plain[0], offloaded[0]):
        assert abs(a - b) < 1e-6 * abs(a), (mode, plain[0], offloaded[0])
    for step, (a, b) in enumerate(zip(plain[1], offloaded[1])):
        for name in a:
            assert (a[name] - b[name]).abs().max() <= 1e-5 * a[name].abs().max(), (mode, step, name)


def test_host_activations_on_the_first_layers_only(monkeypatch):
    """--offload-layers 1 of the tiny model's 2: the first layer's checkpoint goes to the host (one copy a
    step), the second's stays; every loss and gradient bit for bit those of the run without offload."""
    from burst.engine import offload

    copies = []
    monkeypatch.setattr(offload, "to_host", lambda t, real=offload.to_host: copies.append(t.shape) or real(t))
    kept = _run(_config(checkpointing="full"))
    assert not copies
    moved = _run(_config(checkpointing="full", offload_activations=True, offload_layers=1))
    assert len(copies) == STEPS, copies  # one layer's input a step (every layer's would be 2 a step)
    assert kept[0] == moved[0]
    for a, b in zip(kept[1], moved[1]):
        assert all(torch.equal(a[name], b[name]) for name in a)
    copies.clear()
    _run(_config(checkpointing="full", offload_activations=True))
    assert len(copies) == 2 * STEPS
    for options, message in (
        (dict(offload_layers=1), "--offload-layers: how many layers --offload-activations moves"),
        (
            dict(checkpointing="full", offload_activations=True, offload_layers=3),
            "exceeds the 2 layers of model 'tiny'",
        ),
        (dict(checkpointing="full", offload_activations=True, offload_layers=-1), "--offload-layers: must be 0"),
    ):
        with pytest.raises(ValueError, match=message):
            _config(**options).check(1)


def _sequence_parallel_offload(rank, world):
    """On 2 sp ranks (burst, zigzag): offloaded activations against kept ones, per mode (this rank's
    gradients before the all-reduce of train_step's reduce_gradients are what the hooks see)."""
    from burst.engine.parallel import setup

    out = {}
    for mode in ("full", "remat", "selective"):
        kept = _run(_config(checkpointing=mode, ffn_chunk=16), setup(1))
        moved = _run(_config(checkpointing=mode, ffn_chunk=16, offload_activations=True), setup(1))
        out[mode] = (kept[0] == moved[0], all(torch.equal(a[n], b[n]) for a, b in zip(kept[1], moved[1]) for n in a))
    return out


def test_offloaded_activations_on_two_sequence_parallel_ranks():
    from world import run_world

    for rank, out in enumerate(run_world(2, _sequence_parallel_offload, timeout=300)):
        assert all(losses and grads for losses, grads in out.values()), (rank, out)


def test_memory_options_are_checked_and_recorded(tmp_path):
    assert _config(checkpointing="full", offload_activations=True).memory_options()["offload_activations"]
    for options, message in (
        (dict(offload_activations=True), "--offload-activations: moves what checkpointing"),
        (dict(offload_optimizer=True, fsdp="dp"), "--offload-optimizer: one rank"),
        (dict(offload_optimizer=True, checkpoint_dir=str(tmp_path)), "host state"),
    ):
        with pytest.raises(ValueError, match=message):
            _config(**options).check(1)
    with pytest.raises(ValueError, match="--offload-optimizer: one rank"):
        _config(offload_optimizer=True).check(2)
    from burst.engine.train import train

    rows = train(
        0,
        1,
        _config(
            checkpointing="full",
            ffn_chunk=16,
            offload_activations=True,
            offload_optimizer=True,
            metrics=str(tmp_path / "m.jsonl"),
            progress=False,
        ),
    )
    assert len(rows) == STEPS
    for row in rows:
        assert row["memory_options"] == {
            "checkpointing": "full",
            "ffn_chunk": 16,
            "fused_loss": True,
            "offload_activations": True,
            "offload_layers": 0,
            "offload_optimizer": True,
            "fsdp": "none",
            "fsdp_cpu_offload": False,
        }
        assert 0 <= row["optimizer_s"] <= row["step_s"] and row["host_peak_bytes"] > 0
    assert (tmp_path / "m.jsonl").read_text().count("memory_options") == STEPS


def test_llama3_8b_preset_shapes_without_allocating_them():
    m = PRESETS["llama3-8b"]
    assert (m.dim, m.layers, m.heads, m.kv_heads, m.ffn_dim, m.vocab_size, m.head_dim) == (
        4096,
        32,
        32,
        8,
        14336,
        128256,
        128,
    )
    assert m.rope_theta == 500000.0 and m.rope_scaling.factor == 8.0
    assert m.parameters() == 8_030_261_248  # Llama-3.1-8B's published count
    model = Transformer(m, device="meta")  # shapes only
    assert sum(p.numel() for p in model.parameters()) == m.parameters()
    assert all(p.device.type == "meta" for p in model.parameters())
    TrainConfig(model="llama3-8b", seq_len=131072, device="cpu").check(1)  # the config checks, nothing built


def test_llama3_rotary_frequencies_are_transformers_llama3():
    transformers = pytest.importorskip("transformers")
    from burst.engine.model import llama3_frequencies
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = PRESETS["llama3-8b"]
    config = transformers.LlamaConfig(
        hidden_size=m.dim,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": m.rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    theirs = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double()
    plain = m.rope_theta ** (-torch.arange(0, m.head_dim, 2, dtype=torch.float64) / m.head_dim)
    ours = llama3_frequencies(plain, m.rope_scaling)
    assert ((ours - theirs).abs() / theirs).max() < 1e-6  # theirs is float32
    assert not torch.allclose(ours, plain)  # the scaling changed the low frequencies


def test_llama3_8b_scaled_down_trains_and_large_models_are_drawn_on_the_device(monkeypatch):
    """The preset's kind (GQA 4:1, llama3 rope) at a CPU's size; and the path an 8B model takes (built on
    meta, weights drawn where they will live) gives the same weights for the same seed."""
    import burst.engine.train as train_module

    small = dataclasses.replace(
        PRESETS["llama3-8b"], dim=64, layers=2, heads=4, kv_heads=1, ffn_dim=224, vocab_size=512
    )
    monkeypatch.setitem(PRESETS, "llama3-8b-small", small)
    cfg = TrainConfig(
        model="llama3-8b-small",
        seq_len=128,
        steps=2,
        lr=1e-3,
        warmup=1,
        checkpointing="full",
        ffn_chunk=32,
        offload_activations=True,
        offload_optimizer=True,
    )
    losses = _run(cfg)[0]
    assert abs(losses[0] - math.log(512)) < 1.0 and all(math.isfinite(x) for x in losses)
    monkeypatch.setattr(train_module, "BUILT_ON_HOST_BYTES", 0)  # every model takes the large path
    a, b = build(cfg), build(cfg)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), name
    assert all(torch.equal(blk.attention_norm.weight, torch.ones(64)) for blk in a.blocks)


OOM = "CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.19 GiB"


def test_out_of_memory_is_one_line_in_process(monkeypatch):
    import burst.engine.train as train_module
    from burst.engine.out_of_memory import TrainOutOfMemory

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(train_module, "train_step", failing)
    with pytest.raises(TrainOutOfMemory) as caught:
        train_module.train(0, 1, _config(checkpointing="full", progress=False))
    line = str(caught.value)
    assert "\n" not in line and "out of memory at --seq-len 64 on cpu" in line
    assert "the step needs about" in line and "a 3.50 GiB allocation failed" in line
    assert "full + host optimizer + host activations" in line and "burst plan --model tiny" in line


def test_burst_train_out_of_memory_exits_with_one_line_and_leaves_no_shm():
    """The real command, its rank spawned (tests/clients/oom_site patches train_step in every process)."""
    import subprocess

    from burst.comm import shm

    before = shm.names()
    site = pathlib.Path(__file__).parent / "clients" / "oom_site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "burst",
            "train",
            "--model",
            "tiny",
            "--nproc",
            "1",
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--checkpointing",
            "full",
            "--no-progress",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "burst train: error: rank 0: TrainOutOfMemory: out of memory at --seq-len 64 on cpu"
    ), done.stderr[-3000:]
    left = shm.left_by_dead() - before  # files of processes still running (other tests') are in use
    assert not left, left


def test_a_failed_host_step_is_raised_by_step_and_the_next_backward_runs():
    """HostAdamW's host steps run on a thread of their own while the backward goes on: one that fails is
    raised by step() (not lost in the thread), and the optimizer works again for the next backward."""
    from burst.engine.offload import HostAdamW

    w = torch.nn.Parameter(torch.ones(4))
    opt = HostAdamW([w], lr=0.1, weight_decay=0.0)
    real = opt.inner.step
    opt.inner.step = lambda: (_ for _ in ()).throw(ValueError("host out of memory"))
    (w * 2).sum().backward()
    with pytest.raises(RuntimeError, match="host optimizer step failed") as failed:
        opt.step()
    assert isinstance(failed.value.__cause__, ValueError)
    opt.inner.step = real
    (w * 2).sum().backward()
    opt.step()
    assert torch.all(w < 1)  # stepped against the gradient 2


def test_a_full_disk_at_a_checkpoint_names_the_cause(monkeypatch, tmp_path):
    """A checkpoint save that fails (a full disk: every write raises ENOSPC) raises one error naming the
    step, the path and the rank's own error, not DCP's "CheckpointException ranks:dict_keys([0])", and
    leaves no checkpoint marked complete (no burst.json) to resume from."""
    import errno

    from burst.engine.resume import META, resume_point
    from burst.engine.train import train
    from torch.distributed.checkpoint import FileSystemWriter

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    cfg = _config(checkpoint_dir=str(tmp_path), checkpoint_every=1, progress=False)
    with pytest.raises(RuntimeError, match=r"saving step 1's checkpoint to .*step-1.* failed: rank 0: .*No space left"):
        train(0, 1, cfg)
    assert resume_point(str(tmp_path)) is None and not list(tmp_path.rglob(META))


def test_a_failed_save_names_the_ranks_own_error_not_its_frames():
    """DCP wraps a writer thread's error with its traceback's frames, (error, frames): the line names the
    error alone (a file-size limit, here), never the frames' dump."""
    import errno

    from burst.engine.resume import named_failure
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = (OSError(errno.EFBIG, "File too large"), ["<a FrameSummary>"])
    with pytest.raises(RuntimeError) as failed:
        with named_failure("saving step 2's checkpoint to 'ckpt/step-2'"):
            raise CheckpointException("ranks: dict_keys([0])", {0: wrapped})
    assert str(failed.value) == (
        "saving step 2's checkpoint to 'ckpt/step-2' failed: rank 0: OSError: [Errno 27] File too large"
    )
