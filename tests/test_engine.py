"""The training engine: sequence-parallel (and dp x sp, FSDP2) training equals single-process training
of the same model on the same data; every checkpointing mode and the blockwise feedforward give the
same gradients as none; rotary positions follow the layout; `burst train` runs, checkpoints and
resumes exactly. One world of 2 and one of 4."""

from __future__ import annotations

import functools
import itertools
import json
import os
import pathlib
import subprocess
import sys

import burst
import pytest
import torch
from burst.engine.model import PRESETS, Transformer, parallelize
from burst.engine.parallel import setup
from burst.engine.train import TokenSource, TrainConfig, build, train_step

from world import run_process_group, run_world, value_error_text

COMBOS = (("burst", "zigzag"), ("ring", "striped"), ("distflash", "contiguous"))
MODES = (("full", 0.5), ("remat", 0.5), ("selective", 0.5), ("selective", 0.3), ("selective", 1.0))
MESHES = (("none", "none"), ("dp", "remat"), ("mesh", "selective"))  # dp=2 x sp=2: fsdp, checkpointing


def _train(cfg: TrainConfig, par=None):
    """Losses of cfg.steps AdamW steps, the first step's gradients and the final parameters (full
    tensors: FSDP2's shards are gathered)."""
    model = build(cfg, par)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = TokenSource(cfg, model.cfg.vocab_size)
    replica = par.dp_rank if par else 0
    losses = [train_step(model, opt, data.batch(0, replica), cfg, par)]
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    losses += [train_step(model, opt, data.batch(s, replica), cfg, par) for s in range(1, cfg.steps)]
    return losses, grads, {n: _full(p.detach()) for n, p in model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _compare(got, ref):
    """(max loss difference, max relative gradient error, max relative parameter error)."""
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, ref
    rel = lambda a, b: max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)  # noqa: E731
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), rel(grads, ref_grads), rel(params, ref_params)


def _checkpointing_gradients(rank, world, strategy, layout, **options):
    """Per mode: the largest relative gradient error against mode none, and attention's forward
    bytes (CommStats) of one forward + backward. options: parallelize's (a mask)."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    if world > 1:
        parallelize(model, strategy=strategy, layout=layout, **options)
    n = 24 * world
    tokens = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(1))
    positions = burst.layout.shard_indices(layout, rank, world, n)[None].expand(2, -1)
    tokens = burst.shard(tokens, layout=layout) if world > 1 else tokens

    def grads(mode, split):
        model.set_checkpointing(mode, split)
        model.zero_grad()
        with burst.CommStats() as stats:
            model(tokens, positions).float().pow(2).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, stats.sent("forward")

    ref, ref_bytes = grads("none", 0.5)
    out = {}
    for mode, split in MODES:
        g, sent = grads(mode, split)
        out[(mode, split)] = (
            max(((g[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref),
            sent / max(ref_bytes, 1),
        )
    return out


def _parallel(rank, world, combos):
    out = {}
    for strategy, layout in combos:
        cfg = TrainConfig(seq_len=16 * world, batch=2, steps=3, strategy=strategy, layout=layout, lr=1e-2, warmup=1)
        out[(strategy, layout)] = _compare(_train(cfg, setup(1)), _train(cfg))
        if world == 2:
            out[("checkpointing", strategy, layout)] = _checkpointing_gradients(rank, world, strategy, layout)
    if world == 2:  # masks of the whole sequence: selective's prefix had replaced a block-sparse one (0.45 off)
        for layout, (name, mask) in itertools.product(("zigzag", "contiguous"), _whole_sequence_masks(48).items()):
            out[("masked checkpointing", layout, name)] = _checkpointing_gradients(rank, world, "burst", layout, **mask)
    if world == 4:  # dp = 2 replicas x sp = 2 ranks, replicated or FSDP2-sharded, against one process
        reference = _train(TrainConfig(seq_len=32, batch=4, steps=3, lr=1e-2, warmup=1))
        for fsdp, mode in MESHES:
            cfg = TrainConfig(seq_len=32, batch=2, steps=3, lr=1e-2, warmup=1, dp=2, fsdp=fsdp, checkpointing=mode)
            out[("mesh", fsdp, mode)] = _compare(_train(cfg, setup(cfg.dp, cfg.fsdp)), reference)
    # Rotary embeddings at the layout's global positions: a shard's hidden states are the whole
    # sequence's rows.
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (1, 8 * world), generator=torch.Generator().manual_seed(1))
    full = model(tokens, torch.arange(8 * world)[None])
    burst_model = parallelize(Transformer(PRESETS["tiny"]), layout="striped")
    burst_model.load_state_dict(model.state_dict())
    positions = burst.layout.shard_indices("striped", rank, world, 8 * world)[None]
    mine = burst_model(burst.shard(tokens, layout="striped"), positions)
    out["rope"] = ((mine - burst.shard(full, layout="striped")).abs().max() / full.abs().max()).item()
    # each rank's own weights (a model built without a common seed): refused at the first forward, until loaded
    own = parallelize(Transformer(PRESETS["tiny"]), layout="striped")
    with torch.no_grad():
        for p in own.parameters():
            p.add_(0.01 * rank)
    out["own weights"] = value_error_text(lambda: own(burst.shard(tokens, layout="striped"), positions))
    own.load_state_dict(model.state_dict())
    out["own weights, then loaded"] = (own(burst.shard(tokens, layout="striped"), positions) - mine).abs().max().item()
    return out


def _whole_sequence_masks(n: int) -> dict:
    """parallelize's options of a block-sparse mask (blocks of 8, each row of blocks its own and a few
    earlier) and of packed documents crossing the shards, over n tokens."""
    blocks = n // 8
    layout = torch.eye(blocks, dtype=torch.bool) | (
        torch.rand(blocks, blocks, generator=torch.Generator().manual_seed(2)) < 0.4
    )
    return {
        "block_sparse": {"block_sparse": burst.BlockSparseMask(8, layout.tril())},
        "documents": {"cu_seqlens": [0, 10, 29, n]},
    }


@functools.lru_cache(maxsize=None)
def _results(world):
    combos = COMBOS if world == 2 else COMBOS[:1]
    return run_world(world, _parallel, combos, timeout=400)


def _assert_equal_training(errors, where):
    loss_err, grad_err, param_err = errors
    # Losses over three AdamW steps, every gradient of the first step; parameters after three steps
    # only to 1e-3 (Adam's first steps turn tiny gradient differences into lr-sized moves).
    assert loss_err < 1e-5 and grad_err < 1e-4 and param_err < 1e-3, (where, errors)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_training_equals_single_process(world):
    for rank, out in enumerate(_results(world)):
        for combo in COMBOS if world == 2 else COMBOS[:1]:
            _assert_equal_training(out[combo], (rank, combo))
        assert out["rope"] < 1e-5, (rank, out["rope"])
        assert "must run one model" in out["own weights"], (rank, out["own weights"])
        assert out["own weights, then loaded"] == 0, (rank, out["own weights, then loaded"])


def test_dp_by_sp_mesh_with_fsdp2_equals_single_process():
    for rank, out in enumerate(_results(4)):
        for fsdp, mode in MESHES:
            _assert_equal_training(out[("mesh", fsdp, mode)], (rank, fsdp, mode))


def test_checkpointing_modes_give_the_gradients_of_none():
    for rank, out in enumerate(_results(2)):
        for strategy, layout in COMBOS:
            modes = out[("checkpointing", strategy, layout)]
            for mode, (grad_err, _) in modes.items():
                assert grad_err < 1e-5, (rank, strategy, layout, mode, grad_err)
            # What the backward recomputes, seen on the wire: full re-runs attention's forward (twice
            # the forward bytes), remat never does, selective re-runs the prefix only: with zigzag
            # and striped the first half's rows are a layout of their own, so half the K/V travel
            # again; contiguous on 2 ranks holds the whole first half on rank 0, whose prefix-only
            # mask needs no ring step at all.
            assert modes[("full", 0.5)][1] == pytest.approx(2.0)
            assert modes[("remat", 0.5)][1] == pytest.approx(1.0)
            assert modes[("selective", 0.5)][1] == pytest.approx(1.5 if layout != "contiguous" else 1.0), modes
            assert 1.0 <= modes[("selective", 0.3)][1] <= 2.0, modes


def test_checkpointing_modes_with_masks_give_the_gradients_of_none():
    for rank, out in enumerate(_results(2)):
        for key, modes in out.items():
            if key[0] == "masked checkpointing":
                for mode, (grad_err, _) in modes.items():
                    assert grad_err < 1e-5, (rank, key, mode, grad_err)


def test_parallelize_takes_only_options_it_applies_also_on_one_process():
    """parallelize(causal=False) made the model bidirectional at 2 ranks, causal on one; on one process every
    option was dropped (torch's SDPA ran): a window changed nothing, a misspelt option passed."""
    for bad, words in (
        ({"causal": False}, "causal: the engine's model is causal"),
        ({"return_lse": True}, "return_lse"),
        ({"bogus_option": 1}, "bogus_option"),
        ({"strategy": "bogus"}, "strategy must be one of"),
    ):
        with pytest.raises(ValueError, match=words):
            parallelize(Transformer(PRESETS["tiny"]), **bad)
    torch.manual_seed(0)
    plain = Transformer(PRESETS["tiny"])
    windowed = parallelize(Transformer(PRESETS["tiny"]), window=(3, 0))
    windowed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32)[None]
    assert (windowed(tokens, positions) - plain(tokens, positions)).abs().max() > 1e-3
    wide = parallelize(Transformer(PRESETS["tiny"]), window=(100, 0))  # a window past the sequence: none
    wide.load_state_dict(plain.state_dict())
    assert (wide(tokens, positions) - plain(tokens, positions)).abs().max() < 1e-5


def test_checkpointing_on_one_device_and_blockwise_feedforward():
    for (mode, split), (grad_err, _) in _checkpointing_gradients(0, 1, "burst", "contiguous").items():
        assert grad_err < 1e-5, (mode, split, grad_err)
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (2, 40))
    positions = torch.arange(40).expand(2, -1)
    plain = model(tokens, positions)
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) > 10
    for mode in ("none", "full", "remat", "selective"):  # each chunk checkpointed, inside the layer's own
        model.zero_grad()
        model.set_checkpointing(mode, ffn_chunk=16)
        chunked = model(tokens, positions)
        chunked.sum().backward()
        assert (chunked - plain).abs().max() < 1e-5 * plain.abs().max(), mode
        for n, p in model.named_parameters():
            if n in grads:
                assert (p.grad - grads[n]).abs().max() <= 1e-5 * grads[n].abs().max(), (mode, n)
    with pytest.raises(ValueError, match="checkpointing 'some'"):
        model.set_checkpointing("some")


def test_rotary_and_rmsnorm_backward_match_their_formulas():
    """The engine's rotary and RMSNorm save less than autograd would (engine/model.py); their
    backward against float64 finite differences, and against autograd through the formula."""
    from burst.engine.model import RMSNorm, apply_rotary, rotary

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    cos, sin = (t.double() for t in rotary(torch.arange(6).expand(2, -1), 8, 10000.0))
    weight = torch.randn(8, dtype=torch.float64, generator=gen, requires_grad=True)
    norm = RMSNorm(8, 1e-5).double()
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))
    assert torch.autograd.gradcheck(
        lambda t, w: torch.nn.functional.linear(norm(t), torch.eye(8).double()) * w, (x, weight)
    )
    norm.weight.data = torch.randn(8, dtype=torch.float64, generator=gen)
    g = torch.randn_like(x)
    for fused, formula in (
        (lambda t: norm(t), lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight),
        (
            lambda t: apply_rotary(t, cos, sin),
            lambda t: torch.stack(
                [t[..., 0::2] * cos - t[..., 1::2] * sin, t[..., 0::2] * sin + t[..., 1::2] * cos], -1
            ).flatten(-2),
        ),
    ):
        got = torch.autograd.grad(fused(x), x, g)[0]
        want = torch.autograd.grad(formula(x), x, g)[0]
        assert (got - want).abs().max() < 1e-12 * want.abs().max()


def _final_weights_differ(a, b) -> float:
    """Max abs difference between the model weights of two runs' latest checkpoints."""
    from burst.engine.resume import checkpoint_model_name, load_model_weights

    weights = []
    for root in (a, b):
        model = Transformer(PRESETS[checkpoint_model_name(str(root))])
        load_model_weights(str(root), None, model)
        weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return (weights[0] - weights[1]).abs().max().item()


def _burst_train(*args):
    cmd = [sys.executable, "-m", "burst", "train", "--model", "tiny", "--nproc", "2", "--seed", "0", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def _burst_train_fails(*args) -> str:
    cmd = [sys.executable, "-m", "burst", "train", "--model", "tiny", "--nproc", "2", "--seed", "0", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0, done.stdout[-3000:]
    return done.stderr


def test_a_damaged_checkpoint_is_refused_and_a_non_finite_loss_stops_the_run(tmp_path):
    """Bytes of a saved shard overwritten in place (a bad disk or copy: the same size) loaded without a word and
    trained on NaN losses with exit status 0 (a helper's probe): the files' digests in burst.json refuse it by
    name; a loss that is not finite stops the run before its weights are saved."""
    ckpt = tmp_path / "ckpt"
    common = ["--seq-len", "64", "--steps", "3", "--checkpoint-dir", str(ckpt)]
    _burst_train(*common, "--checkpoint-every", "2")
    shard = sorted((ckpt / "step-2").glob("*.distcp"))[-1]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 64)
    error = _burst_train_fails(*common, "--resume-step", "2")
    assert "is damaged" in error and shard.name in error, error[-2000:]
    error = _burst_train_fails("--seq-len", "64", "--steps", "3", "--lr", "1e30", "--warmup", "0")
    assert "the loss is" in error and "stopping before its weights are saved" in error, error[-2000:]


def test_burst_train_checkpoints_and_resumes_exactly(tmp_path):
    """A 2-rank run whose rank 1 is killed (SIGKILL) in its third step under `torchrun --max-restarts 1 ...
    --resume` ends with the uninterrupted run's losses and weights; --keep 2 keeps the two newest
    checkpoints; a checkpoint without its burst.json (a killed save) is never resumed from."""
    from burst.engine.resume import META, resume_point

    ckpt, whole, resumed = tmp_path / "ckpt", tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    common = ["--seq-len", "64", "--steps", "4", "--checkpoint-every", "1", "--keep", "2"]
    _burst_train(*common, "--checkpoint-dir", str(ckpt), "--checkpointing", "selective", "--metrics", str(whole))
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"step", "loss", "tokens_per_s_per_device", "mfu", "peak_mem_bytes"} <= set(r) and r["loss"] > 0
    assert sorted(os.listdir(ckpt)) == ["step-3", "step-4"]  # --keep 2: older ones deleted once newer were complete
    (ckpt / "step-9").mkdir()  # what a save killed before its burst.json leaves
    assert resume_point(str(ckpt)) == 4 and resume_point(str(tmp_path / "empty")) is None
    # Killed and restarted by torchrun, resumed from the latest complete checkpoint (step 2) with another FSDP
    # mode (DCP reshards): the uninterrupted run's losses, and its final weights.
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    killed = tmp_path / "killed"
    done = run_process_group(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(pathlib.Path(__file__).parent / "clients" / "killed_train.py"),
            "train",
            "--model",
            "tiny",
            "--seed",
            "0",
            *common,
            "--checkpoint-dir",
            str(killed),
            "--resume",
            "--fsdp",
            "mesh",
            "--metrics",
            str(resumed),
        ],
        300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    again = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3], again  # the first attempt's steps 0-1, then 2-3 resumed
    for a, b in zip(again, rows):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a, b)
    assert "resumed from" in done.stdout + done.stderr
    assert sorted(os.listdir(killed)) == ["step-3", "step-4"] and (killed / "step-4" / META).exists()
    assert _final_weights_differ(ckpt, killed) < 1e-6
    # Refused before any process starts, naming what is wrong (the CLI's entry, in this process).
    from burst.cli import main

    for bad, message in (
        (
            ["--seq-len", "128", "--steps", "4", "--checkpoint-dir", str(ckpt), "--resume-step", "3"],
            "another config: seq_len was 64",
        ),
        ([*common, "--checkpoint-dir", str(ckpt), "--resume-step", "2"], "no complete checkpoint for step 2"),
        ([*common, "--checkpoint-dir", str(ckpt), "--resume", "--resume-step", "3"], "not both"),
        (["--seq-len", "63"], "--seq-len: 63"),
        (["--seq-len", "64", "--dp", "3"], "--dp: 3 does not divide"),
        (["--seq-len", "64", "--checkpoint-every", "2"], "needs --checkpoint-dir"),
    ):
        with pytest.raises(SystemExit, match=message):
            main(["train", "--model", "tiny", "--nproc", "2", *bad])


def _one_rank_fsdp(rank, world):
    cfg = TrainConfig(seq_len=32, batch=2, steps=3, lr=1e-2, warmup=1, fsdp="dp")
    return _compare(_train(cfg, setup(1, "dp")), _train(TrainConfig(seq_len=32, batch=2, steps=3, lr=1e-2, warmup=1)))


def test_fsdp_on_one_rank_equals_single_process():
    """`burst train --fsdp dp` on one rank (a one-GPU machine) raised TypeError: setup built no mesh for a
    world of one (found by scripts/gpu_check.sh on an H200). Without a process group it is refused."""
    _assert_equal_training(run_world(1, _one_rank_fsdp, timeout=200)[0], "fsdp dp on 1 rank")
    with pytest.raises(ValueError, match="initialized process group"):
        setup(1, "dp")


def test_a_resumed_run_writes_each_step_once_in_its_metrics(tmp_path):
    """--metrics on --resume from the checkpoint after step 2: the interrupted run's lines of steps 2 and
    later are dropped (this run writes them again), those before kept; a fresh run starts the file anew."""
    from burst.engine.train import _metrics_file

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(6)) + "not json\n")
    with _metrics_file(str(path), 2) as out:
        out.write(json.dumps({"step": 2, "loss": 0.5}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    _metrics_file(str(path), 0).close()
    assert path.read_text() == ""


def test_a_failed_save_says_how_much_room_is_left(tmp_path, monkeypatch):
    """torch's writer reports a full disk as a short write ("unexpected pos"): the error adds the free space
    of the filesystem that holds the checkpoint, and asks whether it is full when little is left."""
    from types import SimpleNamespace

    from burst.engine import resume

    target = str(tmp_path / "ck" / "step-4")  # not made yet: its nearest existing parent is measured
    monkeypatch.setattr(resume.shutil, "disk_usage", lambda path: SimpleNamespace(free=3 * 2**20))
    with pytest.raises(
        RuntimeError, match=r"unexpected pos 704 .*\(3\.0 MiB free on the filesystem holding it: is it full\?\)"
    ):
        with resume.named_failure("saving step 4's checkpoint", writes_to=target):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(resume.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    assert resume.space_left(target) == " (1048576.0 MiB free on the filesystem holding it)"
    assert resume.space_left(None) == ""


def test_set_checkpointing_refuses_what_the_cli_refuses_and_the_unfused_loss_keeps_float64():
    """set_checkpointing took ffn_chunk=2.5 (a TypeError at the forward), offload="yes", split=True and more
    layers to offload than the model has; the unfused loss ran float64 logits in float32."""
    from burst.engine.loss import unfused_cross_entropy

    model = Transformer(PRESETS["tiny"])
    for settings, words in (
        ({"ffn_chunk": 2.5}, "ffn chunk must be an int"),
        ({"ffn_chunk": True}, "ffn chunk must be an int"),
        ({"mode": "full", "offload": "yes"}, "offload must be True or False"),
        ({"mode": "selective", "split": True}, "split must be a fraction"),
        ({"mode": "full", "offload": True, "offload_layers": PRESETS["tiny"].layers + 1}, "the model has"),
    ):
        with pytest.raises(ValueError, match=words):
            model.set_checkpointing(**settings)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 5))
    loss = unfused_cross_entropy(logits, targets)
    exact = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert loss.dtype == torch.float64 and abs(loss.item() - exact.item()) < 1e-12


def test_a_step_saved_again_and_killed_is_not_taken_and_keeps_no_old_file(tmp_path, monkeypatch):
    """A run resumed from step 2 saves step 4 again. Written over in place, the old step 4 kept its burst.json,
    so a save killed midway left it taken for complete and refused as damaged at every --resume, step 2 intact
    beside it (a helper's probe); a file of the old save that no new one replaces (another world's rng-R.pt)
    was counted among the new one's."""
    from burst.engine import resume

    cfg = TrainConfig(seq_len=16, batch=1, steps=1, checkpoint_dir=str(tmp_path))
    model = Transformer(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters())
    resume.save_checkpoint(cfg, 2, model, optimizer)
    resume.save_checkpoint(cfg, 4, model, optimizer)
    (tmp_path / "step-4" / "rng-1.pt").write_bytes(b"another world's")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the save stopped after the shards, before the step's own files

    with monkeypatch.context() as patched:
        patched.setattr(resume.torch, "get_rng_state", killed)
        with pytest.raises(KeyboardInterrupt):
            resume.save_checkpoint(cfg, 4, model, optimizer)
    assert resume.resume_point(str(tmp_path)) == 2
    resume.save_checkpoint(cfg, 4, model, optimizer)
    assert resume.resume_point(str(tmp_path)) == 4 and not (tmp_path / "step-4" / "rng-1.pt").exists()
    resume.check_files(str(tmp_path), 4)

    def busy(path):
        raise OSError(39, "Directory not empty")  # NFS's .nfsXXXX files

    with monkeypatch.context() as patched:  # said as the save's failure (in a world: on every rank)
        patched.setattr(resume.shutil, "rmtree", busy)
        with pytest.raises(RuntimeError, match="saving step 4's checkpoint .* its earlier save is not removed"):
            resume.save_checkpoint(cfg, 4, model, optimizer)
