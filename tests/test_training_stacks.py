"""The training stacks people run, with burst, as a user runs them: the example scripts under torchrun,
beside the same script in one process (the same weights and data, the same global batches).

* examples/trainer_train.py: the transformers Trainer (SequenceParallelTrainer) against the plain
  Trainer with eager attention. Every optimizer step's loss and gradients, the final weights,
  evaluate()'s loss, predict()'s loss and its logits on labelled positions. Rows of uneven length,
  right-padded or packed, gradient accumulation (2) and clipping.
* examples/accelerate_train.py: a hand-written accelerate loop with burst's SequenceParallel against
  the same loop in one process: each step's loss and gradients, the final weights (gradient
  accumulation and clipping are accelerate's).
* examples/titan_llama.py: a torchtitan-style LLaMA (torch building blocks, burst.context_parallel
  on a (dp, sp) mesh, activation checkpointing, torch.compile, FSDP2 over the mesh). Each step's
  loss and gradients, the final weights.

SGD, so a gradient difference is not hidden (Adam normalises a constant factor away).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from requires import importorskip, transformers_or_skip
from world import run_process_group, run_torchrun

transformers_or_skip()
importorskip("accelerate", reason="accelerate is not installed (pip install '.[hf]' from the clone)")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TRAINER = (EXAMPLES / "trainer_train.py", "--optim", "sgd", "--lr", "1.0", "--steps", "3")
TITAN = (EXAMPLES / "titan_llama.py", "--optim", "sgd", "--steps", "3")
LOOP = (EXAMPLES / "accelerate_train.py", "--steps", "3")


def _run(tmp_path, name: str, nproc: int, job: tuple, *args: str) -> dict:
    out = tmp_path / name
    script, *options = job
    if nproc == 1:
        import os
        import sys

        done = run_process_group(
            [sys.executable, str(script), *options, *args, "--out", str(out)],
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "2"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        run_torchrun(script, nproc, *options, *args, "--out", str(out))
    return torch.load(out / "result.pt", weights_only=False)


def _unwrapped(named: dict) -> dict:
    """Parameter names without the wrappers' infixes (activation checkpointing, torch.compile)."""
    return {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): t for n, t in named.items()}


def _assert_same_steps(got: dict, ref: dict, bound: float = 1e-4) -> None:
    """Each step's loss and every gradient (hf_zoo.gradient_error, the zoo's rule), and the final weights."""
    from burst.bench.hf_zoo import gradient_error

    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert len(got["grads"]) == len(ref["grads"]) == 3
    for step, (grads, ref_grads) in enumerate(zip(got["grads"], ref["grads"])):
        grads, ref_grads = _unwrapped(grads), _unwrapped(ref_grads)
        assert grads.keys() == ref_grads.keys()
        worst = gradient_error([(grads[n], ref_grads[n]) for n in ref_grads])
        assert worst < bound, f"step {step}: gradient off by {worst:.2e} (relative)"
    weights, ref_weights = _unwrapped(got["weights"]), _unwrapped(ref["weights"])
    assert max(_rel(weights[n], ref_weights[n]) for n in ref_weights) < bound


def _rel(x, ref) -> float:
    x, ref = torch.as_tensor(x).double(), torch.as_tensor(ref).double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _assert_same_trainer_job(got: dict, ref: dict) -> None:
    _assert_same_steps(got, ref)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert got["predict_loss"] == pytest.approx(ref["predict_loss"], rel=1e-5)
    # Logits on positions that score a label: padded positions are not computed alike (one process
    # masks the padding as keys; burst runs the rows whole, which no labelled token can see).
    labels = torch.as_tensor(ref["label_ids"])
    assert torch.equal(torch.as_tensor(got["label_ids"]), labels)
    scored = (labels != -100).unsqueeze(-1)
    got_logits, ref_logits = torch.as_tensor(got["predictions"]), torch.as_tensor(ref["predictions"])
    assert got_logits.shape == ref_logits.shape
    assert _rel(got_logits * scored, ref_logits * scored) < 1e-5


def test_trainer_two_ranks_one_sequence_equals_one_process(tmp_path):
    ref = _run(tmp_path, "reference", 1, TRAINER, "--reference", "--batch", "2")
    _assert_same_trainer_job(_run(tmp_path, "sp2", 2, TRAINER, "--batch", "2"), ref)


def test_trainer_two_replicas_of_two_ranks_equal_one_process(tmp_path):
    """dp x sp = 2 x 2, packed rows (DataCollatorWithFlattening: position ids restart per document),
    gradient checkpointing: the replicas take different batches (one process packs both at once);
    eval sets of 4 rows, so no replica pads its last batch (plain DDP would differ there too)."""
    ref = _run(tmp_path, "reference", 1, TRAINER, "--reference", "--packed", "--batch", "4", "--eval-rows", "4")
    got = _run(
        tmp_path,
        "dp2sp2",
        4,
        TRAINER,
        "--packed",
        "--batch",
        "2",
        "--sp-size",
        "2",
        "--eval-rows",
        "4",
        "--checkpointing",
    )
    _assert_same_trainer_job(got, ref)


def test_trainer_hybrid_model_equals_one_process(tmp_path):
    """A hybrid (Qwen3-Next, tiny from its config class: gated delta rule and short convolutions beside
    attention): the Trainer hooks its recurrent layers, which pass their state across the 2 ranks."""
    ref = _run(tmp_path, "reference", 1, TRAINER, "--reference", "--family", "qwen3_next")
    _assert_same_trainer_job(_run(tmp_path, "sp2", 2, TRAINER, "--family", "qwen3_next"), ref)


def test_accelerate_loop_equals_one_process(tmp_path):
    """2 ranks on one sequence (sp 2), then 2 replicas x 2 ranks (dp 2 x sp 2) against one process
    running the replicas' rows together."""
    ref = _run(tmp_path, "reference-2", 1, LOOP, "--reference", "--batch", "2")
    _assert_same_steps(_run(tmp_path, "sp2", 2, LOOP, "--batch", "2"), ref)
    ref = _run(tmp_path, "reference-4", 1, LOOP, "--reference", "--batch", "4")
    _assert_same_steps(_run(tmp_path, "dp2sp2", 4, LOOP, "--batch", "2", "--sp-size", "2"), ref)


def test_titan_recipe_two_ranks_equals_one_process(tmp_path):
    """zigzag over 2 ranks, activation checkpointing, torch.compile on the blocks, FSDP2 over the mesh."""
    ref = _run(tmp_path, "reference", 1, TITAN, "--no-compile")
    _assert_same_steps(_run(tmp_path, "sp2", 2, TITAN), ref)


def test_titan_recipe_two_replicas_of_two_ranks_equal_one_process(tmp_path):
    """(dp, sp) = (2, 2): FSDP2 over all 4 ranks (sum over sp, mean over dp), checkpointing, no compile."""
    ref = _run(tmp_path, "reference", 1, TITAN, "--dp", "2", "--no-compile")
    _assert_same_steps(_run(tmp_path, "dp2sp2", 4, TITAN, "--dp", "2", "--no-compile"), ref)


def test_refusals_before_training():
    """What the Trainer would compute inexactly raises at construction, naming it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from burst.integrations.transformers import SequenceParallelTrainer

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_config(config)
    args = dict(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="average_tokens_across_devices"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args, average_tokens_across_devices=False))
    with pytest.raises(ValueError, match="sp_size=3"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args), sp_size=3)


def test_whole_sequences_padding_rules():
    from burst.integrations.transformers.sequence_parallel import whole_sequences

    ids = torch.arange(10).reshape(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    out, length = whole_sequences({"input_ids": ids, "labels": labels, "attention_mask": mask}, multiple=4)
    assert length == 5 and "attention_mask" not in out
    assert out["input_ids"].shape == (2, 8) and torch.equal(out["input_ids"][:, :5], ids)
    assert torch.equal(out["labels"][:, :5], labels) and bool((out["labels"][:, 5:] == -100).all())
    positions = torch.tensor([[0, 1, 2, 0, 1]] * 2)
    out, _ = whole_sequences({"input_ids": ids, "position_ids": positions}, multiple=8)
    assert out["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # the last document goes on
    with pytest.raises(ValueError, match="left padding"):
        whole_sequences({"input_ids": ids, "attention_mask": mask.flip(1)}, multiple=1)
    with pytest.raises(ValueError, match="labels at padded positions"):
        whole_sequences({"input_ids": ids, "labels": ids, "attention_mask": mask}, multiple=1)
