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

Two steps each (the second loss follows an optimizer step; every step's gradients are compared). SGD,
so a gradient difference is not hidden (Adam normalises a constant factor away).

Each interpreter costs seconds of imports (torch, transformers) per rank, so the recipes of one world
size share one launch: this file, run as a script (`_run_recipes`), runs the examples one after
another, each as `python example.py ARGS` would (its `__main__`, its own argv), in one torchrun
world of 2 and one of 4 ranks; the one-process references all run in one plain interpreter. The
recipes share the world's process group (the first initialises it; a recipe's end is a barrier).
"""

from __future__ import annotations

import functools
import pathlib
from unittest import mock

import pytest
import torch

from cases import rel_err
from requires import importorskip, transformers_or_skip

transformers_or_skip()
importorskip("accelerate", reason="accelerate is not installed (pip install '.[hf]' from the clone)")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
STEPS = 2
TRAINER = ("trainer_train.py", "--optim", "sgd", "--lr", "1.0", "--steps", str(STEPS))
TITAN = ("titan_llama.py", "--optim", "sgd", "--steps", str(STEPS))
LOOP = ("accelerate_train.py", "--steps", str(STEPS))
MOE = ("--family", "qwen3_moe", "--router-loss", "0.5", "--seq-len", "40")
# name: (ranks, the job under torchrun, the job in one process that it must equal)
RECIPES = {
    "trainer sp2": (2, (*TRAINER, "--batch", "2"), (*TRAINER, "--reference", "--batch", "2")),
    # dp x sp = 2 x 2, packed rows, gradient checkpointing; eval sets of 4 rows, so no replica pads
    "trainer dp2sp2": (
        4,
        (*TRAINER, "--packed", "--batch", "2", "--sp-size", "2", "--eval-rows", "4", "--checkpointing"),
        (*TRAINER, "--reference", "--packed", "--batch", "4", "--eval-rows", "4"),
    ),
    "trainer hybrid": (2, (*TRAINER, "--family", "qwen3_next"), (*TRAINER, "--reference", "--family", "qwen3_next")),
    # a MoE's router load-balancing loss over the whole sequence, without the padding, in the model's loss and the
    # fused one (each rank's own, summed, was 1.3x the loss and 0.9-4x off in the router's gradient)
    "trainer moe": (2, (*TRAINER, *MOE), (*TRAINER, "--reference", *MOE)),
    "trainer moe fused": (2, (*TRAINER, *MOE, "--fused-loss"), (*TRAINER, "--reference", *MOE)),
    "loop sp2": (2, (*LOOP, "--batch", "2"), (*LOOP, "--reference", "--batch", "2")),
    "loop dp2sp2": (4, (*LOOP, "--batch", "2", "--sp-size", "2"), (*LOOP, "--reference", "--batch", "4")),
    "titan sp2": (2, TITAN, (*TITAN, "--no-compile")),
    "titan dp2sp2": (4, (*TITAN, "--dp", "2", "--no-compile"), (*TITAN, "--dp", "2", "--no-compile")),
}


def _run_recipes(out: str, *jobs: str) -> None:
    """Each job ("NAME|script|arg|...") as `python examples/script args --out out/NAME` runs it, one
    after another in this interpreter (under torchrun: in this world, its group shared)."""
    import os
    import runpy
    import sys

    import burst.launch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    sys.path.insert(0, str(EXAMPLES))  # accelerate_train imports trainer_train
    end_rank = burst.launch.end_rank
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        dist.init_process_group = lambda *args, **kwargs: None  # titan_llama's: the world is up
        burst.launch.end_rank = dist.barrier  # a recipe's end: the next one runs in the same world
    for job in jobs:
        name, script, *args = job.split("|")
        AcceleratorState._reset_state()  # a fresh Accelerator per recipe (the process group stays)
        GradientState._reset_state()
        sys.argv = [str(EXAMPLES / script), *args, "--out", os.path.join(out, name)]
        runpy.run_path(sys.argv[0], run_name="__main__")
    if dist.is_initialized():
        end_rank()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """results(recipe): (its result.pt under torchrun, the one-process reference's). Each launch runs
    once, the first time a test asks: the references (ranks 1), or the recipes of one world size."""

    @functools.lru_cache(maxsize=None)
    def launch(ranks: int) -> dict:
        import os
        import sys

        from world import run_process_group, run_torchrun

        out = tmp_path_factory.mktemp(f"ranks-{ranks}")
        jobs = {name: ref if ranks == 1 else job for name, (n, job, ref) in RECIPES.items() if ranks in (1, n)}
        args = [str(out), *("|".join((name, *job)) for name, job in jobs.items())]
        if ranks == 1:
            done = run_process_group(
                [sys.executable, __file__, *args], timeout=400, env={**os.environ, "OMP_NUM_THREADS": "2"}
            )
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            run_torchrun(__file__, ranks, *args, timeout=400)
        return {name: torch.load(out / name / "result.pt", weights_only=False) for name in jobs}

    def pair(name: str) -> tuple[dict, dict]:
        return launch(RECIPES[name][0])[name], launch(1)[name]

    return pair


def _unwrapped(named: dict) -> dict:
    """Parameter names without the wrappers' infixes (activation checkpointing, torch.compile)."""
    return {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): t for n, t in named.items()}


def _assert_same_steps(got: dict, ref: dict, bound: float = 1e-4) -> None:
    """Each step's loss and every gradient (hf_steps.gradient_error, the zoo's rule), and the final weights."""
    from burst.bench.hf_steps import gradient_error

    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert len(got["grads"]) == len(ref["grads"]) == STEPS
    for step, (grads, ref_grads) in enumerate(zip(got["grads"], ref["grads"])):
        grads, ref_grads = _unwrapped(grads), _unwrapped(ref_grads)
        assert grads.keys() == ref_grads.keys()
        worst = gradient_error([(grads[n], ref_grads[n]) for n in ref_grads])
        assert worst < bound, f"step {step}: gradient off by {worst:.2e} (relative)"
    weights, ref_weights = _unwrapped(got["weights"]), _unwrapped(ref["weights"])
    assert max(_rel(weights[n], ref_weights[n]) for n in ref_weights) < bound


def _rel(x, ref) -> float:
    """rel_err of losses (floats) or tensors."""
    return rel_err(torch.as_tensor(x), torch.as_tensor(ref).double())


def _assert_same_trainer_job(got: dict, ref: dict) -> None:
    _assert_same_steps(got, ref)
    assert got["tokens_seen"] == ref["tokens_seen"] > 0  # include_num_input_tokens_seen: once per group's batch
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


def test_trainer_two_ranks_one_sequence_equals_one_process(results):
    _assert_same_trainer_job(*results("trainer sp2"))


def test_trainer_two_replicas_of_two_ranks_equal_one_process(results):
    """dp x sp = 2 x 2, packed rows (DataCollatorWithFlattening: position ids restart per document),
    gradient checkpointing: the replicas take different batches (one process packs both at once);
    eval sets of 4 rows, so no replica pads its last batch (plain DDP would differ there too)."""
    _assert_same_trainer_job(*results("trainer dp2sp2"))


def test_trainer_hybrid_model_equals_one_process(results):
    """A hybrid (Qwen3-Next, tiny from its config class: gated delta rule and short convolutions beside
    attention): the Trainer hooks its recurrent layers, which pass their state across the 2 ranks."""
    _assert_same_trainer_job(*results("trainer hybrid"))


@pytest.mark.parametrize("recipe", ["trainer moe", "trainer moe fused"])
def test_trainer_moe_router_loss_equals_one_process(results, recipe):
    """Qwen3-MoE with output_router_logits (coefficient 0.5), right-padded rows of uneven length, gradient
    accumulation: the router loss of the whole sequence, its padding left out as the reference's mask leaves it.
    (predict()'s outputs carry the router logits beside the logits, of each rank's rows: the losses are compared.)"""
    got, ref = results(recipe)
    _assert_same_steps(got, ref)
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert got["predict_loss"] == pytest.approx(ref["predict_loss"], rel=1e-5)


def test_accelerate_loop_equals_one_process(results):
    """2 ranks on one sequence (sp 2), then 2 replicas x 2 ranks (dp 2 x sp 2) against one process
    running the replicas' rows together."""
    _assert_same_steps(*results("loop sp2"))
    _assert_same_steps(*results("loop dp2sp2"))


def test_titan_recipe_two_ranks_equals_one_process(results):
    """zigzag over 2 ranks, activation checkpointing, torch.compile on the blocks, FSDP2 over the mesh."""
    _assert_same_steps(*results("titan sp2"))


def test_titan_recipe_two_replicas_of_two_ranks_equal_one_process(results):
    """(dp, sp) = (2, 2): FSDP2 over all 4 ranks (sum over sp, mean over dp), checkpointing, no compile."""
    _assert_same_steps(*results("titan dp2sp2"))


def test_refusals_before_training(tmp_path):
    """What the Trainer would compute inexactly raises at construction, naming it."""
    from burst.integrations.transformers import SequenceParallelTrainer
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_config(config)
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="average_tokens_across_devices"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args, average_tokens_across_devices=False))
    with pytest.raises(ValueError, match="sp_size=3"):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args), sp_size=3)
    # NEFTune's noise is scaled by the length a rank sees: refused where that is a shard (two ranks a sequence)
    with mock.patch("burst.integrations.transformers.trainer.sequence_parallel_groups", return_value=(None, 2, 0, 1)):
        with pytest.raises(ValueError, match="neftune_noise_alpha"):
            SequenceParallelTrainer(model=model, args=TrainingArguments(**args, neftune_noise_alpha=5.0))
        # transformers' BatchRebalanceSampler deals each process its own rows: the same-batch check failed at the
        # first step, advising a DistributedSampler the user never wrote (a helper's probe)
        with pytest.raises(ValueError, match="train_sampling_strategy='batch_rebalance'"):
            rebalanced = TrainingArguments(**args, train_sampling_strategy="batch_rebalance")
            SequenceParallelTrainer(model=model, args=rebalanced)
    # transformers 5.17's Trainer left the token count sp_size times too large (losses and gradients 1/2 at 2 ranks)
    from burst.integrations.transformers import trainer

    with (
        mock.patch.object(trainer, "sequence_parallel_groups", lambda sp_size: (None, 2, 0, 1)),
        mock.patch.object(trainer.transformers, "__version__", "5.18.0"),
        pytest.raises(ValueError, match="transformers 5.18.0 .*get_cp_size"),
    ):
        SequenceParallelTrainer(model=model, args=TrainingArguments(**args))


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
    # a collator's own shift_labels (and any entry along the tokens) padded as the labels are: shard_batch had
    # refused the shorter shift_labels on every rank (a helper's Trainer probe)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    types = torch.ones(2, 5, 3)
    batch = {"input_ids": ids, "labels": labels, "shift_labels": shifted, "token_type_ids": types}
    out, _ = whole_sequences({**batch, "attention_mask": mask}, multiple=4)
    assert torch.equal(out["shift_labels"], torch.nn.functional.pad(shifted, (0, 3), value=-100))
    assert out["token_type_ids"].shape == (2, 8, 3) and not out["token_type_ids"][:, 5:].any()
    with pytest.raises(ValueError, match="shift_labels at padded positions"):
        whole_sequences({**batch, "shift_labels": ids, "attention_mask": mask}, multiple=1)


if __name__ == "__main__":  # _results' launches: python|torchrun tests/test_training_stacks.py OUT JOB...
    import sys

    _run_recipes(*sys.argv[1:])


def test_a_dataloader_accelerate_ran_as_one_process_is_refused_saying_why(monkeypatch):
    """Accelerator() under torchrun on a machine without a GPU runs each process as a world of one and leaves
    the dataloader without its per-process sampler: sp.dataloader refuses, naming cpu=True (it named
    dispatch_batches, which did not apply: a helper followed docs/training.md's block literally)."""
    from burst.integrations.transformers import sequence_parallel

    monkeypatch.setattr(sequence_parallel.dist, "get_world_size", lambda *args: 2)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=1)
    with pytest.raises(NotImplementedError, match=r"world of 1 while the process group has 2.*cpu=True"):
        sequence_parallel.over_replicas(loader, replica=0, replicas=1, sp_size=2)


def test_a_dataloader_resumed_by_skip_first_batches_is_pointed_at_the_replicas():
    """accelerate's skip_first_batches (resuming mid-epoch) wraps the per-process sampler in its own: sp.dataloader
    found none there and refused, naming an iterable dataset (a helper's resume, in accelerate's usual order). It
    reaches the sampler through the wrapper: the replica's batches from the one after those skipped."""
    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
    from burst.integrations.transformers import sequence_parallel

    def loader(skip):
        per_process = BatchSamplerShard(torch.utils.data.BatchSampler(range(16), 2, False), 4, 1)
        sampler = SkipBatchSampler(per_process, skip) if skip else per_process
        return torch.utils.data.DataLoader(list(range(16)), batch_sampler=sampler)

    def batches(skip):  # 4 processes as 2 replicas of 2 ranks: this rank's replica is 1 of 2
        return [b.tolist() for b in sequence_parallel.over_replicas(loader(skip), replica=1, replicas=2, sp_size=2)]

    assert batches(0) == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert batches(1) == batches(0)[1:]
