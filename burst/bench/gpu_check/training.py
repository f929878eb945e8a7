"""Section 6: the training stacks a user runs on this device, each step against one process.

* `burst train --device D --dtype bfloat16` (the engine's model, one rank: the most one GPU takes, since
  `burst train` puts one rank on each GPU) against `burst train --device cpu --dtype float32`, one
  process: every step's loss within bfloat16's bound (reference.BOUNDS).
* The transformers Trainer with accelerate's own FSDP2 plugin (examples/trainer_train.py --fsdp --bf16
  under torchrun, burst's SequenceParallelTrainer) against the plain Trainer in one process, eager
  attention, float32: each step's loss and every gradient. The yardstick is the same plain Trainer in
  bf16 (what one device gives in bf16): burst may be off by at most twice its error, or 1e-3.
  CUDA only: accelerate applies FSDP on GPUs alone (on the CPU the example refuses --fsdp), and the
  suite runs the Trainer on the CPU already (tests/test_training_stacks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch

from burst.kernels.reference import BOUNDS

from .report import Report, Section, repo_root

TRAIN_STEPS = 2


def _run(sec: Section, command: list, timeout: float) -> tuple[bool, str]:
    """Runs `command` from the repository root; (succeeded, the last lines of its output)."""
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=repo_root(),
            timeout=max(10.0, timeout),
            env={**os.environ, "PYTHONPATH": repo_root(), "OMP_NUM_THREADS": "4"},
        )
    except subprocess.TimeoutExpired:
        return False, "timed out"
    text = (done.stdout + done.stderr).strip()
    if done.returncode:
        sec.note(f"`{' '.join(command[1:])}` exited {done.returncode}: {text[-600:]}")
    return done.returncode == 0, text[-300:]


def _burst_train_losses(sec: Section, outdir: str, device: str, dtype: str, seq_len: int) -> list | None:
    path = os.path.join(outdir, f"train_{device}_{dtype}.jsonl")
    ok, _ = _run(
        sec,
        [
            sys.executable,
            "-m",
            "burst",
            "train",
            "--device",
            device,
            "--dtype",
            dtype,
            "--nproc",
            "1",
            "--model",
            "tiny",
            "--seq-len",
            str(seq_len),
            "--steps",
            str(TRAIN_STEPS),
            "--no-progress",
            "--metrics",
            path,
        ],
        min(sec.left(), 150),
    )
    if not ok:
        return None
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def _burst_train_rows(sec: Section, rep: Report, scratch: str) -> list:
    seq_len = 4096 if rep.device.type == "cuda" else 128
    got = _burst_train_losses(sec, scratch, rep.device.type, "bfloat16", seq_len)
    ref = _burst_train_losses(sec, scratch, "cpu", "float32", seq_len)
    feature = (
        f"`burst train --device {rep.device.type} --dtype bfloat16` vs one process in float32 (cpu), {seq_len} tokens"
    )
    if got is None or ref is None or not len(got) == len(ref) == TRAIN_STEPS:
        return [{"feature": feature, "status": "FAIL", "detail": f"losses {got} vs {ref}"}]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    return [
        {
            "feature": feature,
            "status": "ok" if worst <= BOUNDS["bfloat16"] else "FAIL",
            "detail": f"losses {', '.join(f'{x:.4f}' for x in got)} vs {', '.join(f'{x:.4f}' for x in ref)}; "
            f"worst relative {worst:.1e} (bound {BOUNDS['bfloat16']})",
        }
    ]


def _trainer(sec: Section, outdir: str, name: str, *options: str, ranks: int = 0) -> dict | None:
    """examples/trainer_train.py on this GPU (under torchrun with `ranks` ranks, else one plain process)."""
    out = os.path.join(outdir, f"trainer_{name}")
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks else [sys.executable]
    )
    ok, _ = _run(
        sec,
        [
            *launcher,
            "examples/trainer_train.py",
            "--device",
            "cuda",
            "--optim",
            "sgd",
            "--lr",
            "1.0",
            "--steps",
            str(TRAIN_STEPS),
            *options,
            "--out",
            out,
        ],
        min(sec.left(), 150),
    )
    return torch.load(os.path.join(out, "result.pt"), weights_only=False) if ok else None


def _step_errors(got: dict, ref: dict) -> tuple[float, float]:
    """(worst relative loss difference, worst gradient_error) over the steps."""
    from burst.bench.hf_steps import gradient_error

    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    grads = max(
        gradient_error([(g[n].double().cpu(), r[n].double().cpu()) for n in r])
        for g, r in zip(got["grads"], ref["grads"])
    )
    return loss, grads


def _trainer_rows(sec: Section, scratch: str) -> list:
    feature = "Trainer + accelerate FSDP2 (fsdp='full_shard'), bf16, burst, 1 rank vs the plain Trainer in float32"
    ref = _trainer(sec, scratch, "float32", "--reference")
    yardstick = _trainer(sec, scratch, "bf16", "--reference", "--bf16")
    got = _trainer(sec, scratch, "fsdp_bf16", "--fsdp", "--bf16", ranks=1)
    if ref is None or yardstick is None or got is None:
        return [{"feature": feature, "status": "FAIL", "detail": "a run failed (its output is in the notes)"}]
    if not len(got["losses"]) == len(ref["losses"]) == len(got["grads"]) == len(ref["grads"]) == TRAIN_STEPS:
        return [{"feature": feature, "status": "FAIL", "detail": f"steps {len(got['losses'])} vs {len(ref['losses'])}"}]
    mine, theirs = _step_errors(got, ref), _step_errors(yardstick, ref)
    ok = got["sharded"] and all(m <= max(2 * t, 1e-3) for m, t in zip(mine, theirs))
    return [
        {
            "feature": feature,
            "status": "ok" if ok else "FAIL",
            "detail": f"sharded {got['sharded']}; loss {mine[0]:.1e}, gradients {mine[1]:.1e} against float32 "
            f"(plain Trainer in bf16: loss {theirs[0]:.1e}, gradients {theirs[1]:.1e})",
        }
    ]


def section_training(rep: Report) -> None:
    with rep.section("6", "Training stacks: burst train, the Trainer with accelerate's FSDP2, vs one process") as sec:
        # the runs' own files stay out of the report's folder, and are gone after
        with tempfile.TemporaryDirectory(prefix="burst_gpu_check_") as scratch:
            rows = _burst_train_rows(sec, rep, scratch)
            if rep.device.type == "cuda" and not sec.skip_for_time("the Trainer with FSDP2", 30):
                rows += _trainer_rows(sec, scratch)
        for row in rows:
            if row["status"] == "FAIL":
                sec.fail(f"{row['feature']}: {row['detail']}")
        sec.table("training stacks", ["feature", "status", "detail"], rows)
