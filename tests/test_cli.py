"""The `burst` command as a new user meets it (issue 24).

Bad values: every verb refuses each class of mistake in this process, before any world starts
(spawning is made to fail the test), with exit status 2 and one line naming the option. A rank
that fails inside a world ends every rank promptly, and the launcher reports that rank's line.
"""

from __future__ import annotations

import json
import time

import burst.bench.harness
import burst.launch
import numpy as np
import pytest
from burst.cli import VERBS, build_parser, main
from burst.devices import DTYPE_ALIASES, DTYPES
from burst.launch import WorldError, spawn_world

PROMPT_MISSING = "/nonexistent-dir/prompt.txt"
UNWRITABLE = "/nonexistent-dir/out.json"


@pytest.fixture
def no_world(monkeypatch):
    """Starting any process fails the test: bad values must be refused before that."""

    def refuse(*args, **kwargs):
        raise AssertionError("a world was started for a bad value")

    for module in (burst.launch, burst.bench.harness):
        monkeypatch.setattr(module, "spawn_world", refuse)
        monkeypatch.setattr(module, "run_world", refuse)


def _refusals(capsys, verb: str, base: list[str], cases: list) -> None:
    """Each case: extra arguments and the option the one-line error must name, written as
    (["--a", "1", "--b", "2"], "--b"), or as one string "--a 1" where that option is the first."""
    slowest = 0.0
    for case in cases:
        extra, option = (case.split(), case.split()[0]) if isinstance(case, str) else case
        start = time.perf_counter()
        with pytest.raises(SystemExit) as exited:
            main([verb, *base, *extra])
        slowest = max(slowest, time.perf_counter() - start)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert exited.value.code == 2, (extra, err)
        assert len(lines) == 1, (extra, err)
        assert lines[0].startswith(f"burst {verb}: error: {option}: "), (extra, lines[0])
    assert slowest < 5.0, f"a refusal took {slowest:.1f} s: something heavier than validation ran"


def test_train_refuses_bad_values(capsys, no_world, tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"only a few bytes")
    folder_as_file = tmp_path / "a-folder"
    folder_as_file.mkdir()
    beyond = tmp_path / "beyond.bin"  # uint16 ids up to 1999: the tiny model's vocabulary is 256
    beyond.write_bytes(bytes(range(256)) * 16)
    odd = tmp_path / "odd.bin"  # uint16 ids in an odd number of bytes
    odd.write_bytes(bytes(1001))
    (tmp_path / "empty.bin").write_bytes(b"")
    records = {}  # a step's burst.json that `burst train` did not write
    for name, text in (("junk", "garbage"), ("empty", "{}")):
        (tmp_path / name / "step-2").mkdir(parents=True)
        (tmp_path / name / "step-2" / "burst.json").write_text(text)
        records[name] = str(tmp_path / name)
    _refusals(
        capsys,
        "train",
        ["--seq-len", "64"],
        [
            "--steps 0",
            "--batch -2",
            "--nproc 0",
            "--seq-len x",
            "--strategy nope",
            "--strategy distflash",  # the default zigzag layout
            "--lr -1",
            "--lr nan",
            "--warmup -1",
            "--peak-flops -5",
            "--metrics /nonexistent-dir/m.jsonl",  # used to hang
            (["--metrics", str(folder_as_file)], "--metrics"),
            f"--json {UNWRITABLE}",
            "--data /nonexistent-dir/data.txt",
            (["--data", str(short)], "--data"),  # shorter than one sample
            (["--data", str(beyond)], "--data"),  # ids beyond the vocabulary
            (["--data", str(odd)], "--data"),  # not whole ids
            (["--data", str(tmp_path / "empty.bin")], "--data"),  # numpy said "cannot mmap"; now: holds 0 tokens
            (["--resume-step", "2", "--checkpoint-dir", records["junk"]], "--resume-step"),
            (["--resume-step", "2", "--checkpoint-dir", records["empty"]], "--resume-step"),
            (["--resume", "--checkpoint-dir", records["empty"]], "--resume"),
            "--seq-len 63",
            (["--seq-len", str(1 << 21)], "--seq-len"),  # beyond the model's positions
            "--dp 3",
            "--model huge",
            "--checkpointing some",
            "--checkpoint-split 1.5",
            "--checkpoint-split 0.2",  # without --checkpointing selective it would do nothing
            "--checkpoint-split 0.5 --checkpointing full",  # given as the default: still does nothing
            "--keep 2",  # without --checkpoint-dir
            (["--checkpoint-dir", "/proc/burst-ckpt"], "--checkpoint-dir"),  # refused by the kernel, even to root
            (["--metrics", "/proc/burst-m.jsonl"], "--metrics"),
            (["--metrics", str(short / "m.jsonl")], "--metrics"),  # under a file
            "--checkpoint-every 2",
            "--resume-step 2",
            (["--resume-step", "2", "--checkpoint-dir", str(tmp_path / "none")], "--checkpoint-dir"),
            (["--resume-step", "2", "--checkpoint-dir", str(tmp_path)], "--resume-step"),
            (["--checkpoint-dir", str(short)], "--checkpoint-dir"),
            (["--cpu-offload"], "--cpu-offload"),  # needs --fsdp dp or mesh
            (["--strategy", "ulysses", "--nproc", "3", "--layout", "contiguous", "--seq-len", "66"], "--strategy"),
        ],
    )


def test_generate_refuses_bad_values(capsys, no_world, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _refusals(
        capsys,
        "generate",
        ["--prompt-len", "32"],
        [
            "--prompt-len -5",
            "--new-tokens 0",
            (["--new-tokens", str(1 << 21)], "--new-tokens"),  # prompt + new tokens beyond the model
            "--batch 0",
            "--nproc 0",
            "--top-p 1.5",
            "--top-p 0",
            "--top-p 0.5",  # greedy (--temperature 0): it would do nothing
            "--temperature -1",
            f"--prompt-file {PROMPT_MISSING}",
            (["--prompt-file", str(empty)], "--prompt-file"),
            f"--json {UNWRITABLE}",
            "--strategy nope",
            (["--strategy", "distflash", "--layout", "zigzag"], "--strategy"),
            (["--strategy", "ulysses", "--nproc", "3"], "--strategy"),  # 4 heads over 3 ranks
            (["--checkpoint-dir", str(tmp_path / "none")], "--checkpoint-dir"),
            (["--checkpoint-dir", str(tmp_path)], "--checkpoint-dir"),  # no checkpoint in it
            "--checkpoint-step 3",
            "--model huge",
        ],
    )
    text = tmp_path / "prompt.txt"
    text.write_bytes(b"a prompt")
    _refusals(  # the random prompts' shape, with a file as the prompt: it would be dropped
        capsys,
        "generate",
        ["--prompt-file", str(text)],
        [(["--prompt-len", "10"], "--prompt-len"), (["--batch", "2"], "--batch")],
    )


def test_check_refuses_bad_values(capsys, no_world):
    _refusals(
        capsys,
        "check",
        ["--seq-len", "32", "--heads", "2", "--head-dim", "16"],
        [
            "--seq-len 0",
            "--seq-len 30",  # not a multiple of 2 x ranks
            "--heads -1",
            "--nproc 0",
            "--strategies nope",
            "--strategies burst,,ring",  # an empty name: a typo, not a strategy to skip
            "--strategies burst,BURST",  # every case twice
            "--layouts zigzag,zigzag",
            (["--strategies", "distflash", "--layouts", "zigzag"], "--strategies"),  # nothing would run
            "--layouts diagonal",
            "--dtype float8",
            "--causal maybe",
            (["--kv-heads", "3", "--heads", "4"], "--kv-heads"),
            f"--json {UNWRITABLE}",
        ],
    )


def test_bench_refuses_bad_values(capsys, no_world, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    _refusals(
        capsys,
        "bench",
        ["--seq-len", "256"],
        [
            "--seq-len 0",
            "--seq-len 255",  # does not split over 2 ranks
            "--heads 0",
            "--nproc 0",
            "--repeats -1",
            "--threads 0",
            "--strategies nope",
            (["--strategies", "distflash", "--causal", "--layout", "zigzag"], "--strategies"),
            "--strategies distflash",  # not causal
            "--kv-heads 3",
            "--inter-node-gbps -1",
            "--intra-node-gbps 0",
            "--ranks-per-node 3",
            "--window 1",
            "--window -2,4",
            "--block-sparse 64,2",
            "--documents 300",
            "--layout doc_zigzag",  # per-document layouts need --documents
            "--dtype float8",
            f"--json {UNWRITABLE}",
            (["--report", str(tmp_path / "r"), "--report-seq-lens", "100,0"], "--report-seq-lens"),
            (["--report", str(tmp_path / "r"), "--report-seq-lens", "101"], "--report-seq-lens"),
            (["--report", str(a_file / "report")], "--report"),
            (["--report", str(tmp_path / "r"), "--report-worlds", "1,3"], "--report-worlds"),  # 4096 over 3 ranks
            "--cqs-table2 4,-1",
            # options nothing would read in this mode (each had run the plain bench, or ignored them)
            "--report-seq-lens 2048",  # without --report
            "--report-worlds 2",
            "--cqs-table2 4,4",  # a worker count twice
            (["--cqs-table2", "4", "--strategies", "ring"], "--strategies"),
            (["--cqs-table2", "4", "--nproc", "4"], "--nproc"),
            "--inter-node-gbps 5",  # no nodes without --ranks-per-node
            "--strategies ring,Ring",  # each case would run twice
            (["--json", ""], "--json"),
        ],
    )


def test_plan_refuses_bad_values(capsys, no_world):
    _refusals(
        capsys,
        "plan",
        ["--gpus", "16", "--seq-len", "65536", "--heads", "32", "--head-dim", "128"],
        [
            "--gpus 0",
            "--gpus -8",
            (["--gpus-per-node", "3"], "--gpus"),
            "--seq-len -1",
            "--heads 0",
            "--kv-heads 5",
            "--layers 0",
            "--batch 0",
            "--inter-node-gbps -1",
            "--intra-node-gbps 0",
            "--profile X100",
            "--layout diagonal",
            "--dtype-bytes 3",
            f"--json {UNWRITABLE}",
            (["--json", ""], "--json"),  # an unset shell variable: the table, and no file written
            # a whole model's step options, where nothing would read them: attention alone, a prefill, --longest
            "--checkpointing full",
            "--host-mem-gib 64",
            "--no-backward-overlap",
            # one node: no inter-node link to set
            (["--gpus", "8", "--inter-node-gbps", "10"], "--inter-node-gbps"),
        ],
    )
    _refusals(
        capsys,
        "plan",
        ["--gpus", "2", "--model", "tiny"],
        [
            (["--seq-len", "1024", "--mode", "prefill", "--offload-optimizer"], "--offload-optimizer"),
            # --longest plans one GPU's `burst train --nproc 1` flags, one bf16 sequence a step
            (["--longest"], "--gpus"),
        ],
    )
    _refusals(
        capsys,
        "plan",
        ["--gpus", "1", "--model", "tiny", "--longest"],
        [
            (["--no-fsdp"], "--no-fsdp"),
            (["--mode", "prefill"], "--mode"),
            (["--batch", "2"], "--batch"),
            (["--dtype-bytes", "4"], "--dtype-bytes"),
            # the advice would be for a model `burst train --model` cannot run
            (["--layers", "4"], "--layers"),
            (["--hidden", "128"], "--hidden"),
            # it plans the whole model on one GPU: no attention alone, no layout, no node to read them
            (["--attention-only"], "--attention-only"),
            (["--layout", "striped"], "--layout"),
            (["--gpus-per-node", "4"], "--gpus-per-node"),
            (["--intra-node-gbps", "100"], "--intra-node-gbps"),
        ],
    )
    _refusals(  # attention alone: nothing reads the whole model's sizes
        capsys, "plan", ["--gpus", "2", "--model", "tiny", "--seq-len", "1024", "--attention-only"], ["--vocab 1000"]
    )


def test_plan_refuses_a_config_that_is_not_there(capsys, no_world, tmp_path):
    """A path that does not exist, or a folder without config.json: one line, before transformers would read
    the value as a hub id (and look it up on the network)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [f"--hf-config {PROMPT_MISSING}", "--hf-config ./nonexistent-dir", f"--hf-config {empty}"]
    _refusals(capsys, "plan", ["--gpus", "16", "--seq-len", "65536"], cases)
    with pytest.raises(SystemExit):
        main(["plan", "--gpus", "16", "--seq-len", "65536", "--hf-config", str(empty)])
    assert "has no config.json" in capsys.readouterr().err


def test_a_negative_pair_is_an_options_value():
    """`--window -1,0` (-1: unbounded, as the help says): argparse would read -1,0 as an option."""
    from burst.cli import _glued_pairs

    assert _glued_pairs(["bench", "--window", "-1,0", "--causal"]) == ["bench", "--window=-1,0", "--causal"]
    assert _glued_pairs(["plan", "--window", "4,0"]) == ["plan", "--window", "4,0"]


def test_plan_reads_like_it_should(capsys, tmp_path):
    """Profile names in any case; --json PATH writes rows and - prints them alone; a strategy that
    cannot take the layout is flagged, not ranked first."""
    args = [
        "plan",
        "--gpus",
        "8",
        "--seq-len",
        "1048576",
        "--heads",
        "32",
        "--head-dim",
        "128",
        "--causal",
        "--profile",
        "h100",
        "--layout",
        "zigzag",
    ]
    assert main([*args, "--json", str(tmp_path / "rows.json")]) == 0
    table = capsys.readouterr().out
    assert "8 x H100" in table
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["fits"] and rows[0]["strategy"] != "distflash"
    distflash = next(r for r in rows if r["strategy"] == "distflash")
    assert not distflash["fits"] and "contiguous" in distflash["note"]
    assert main([*args, "--layout", "contiguous", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert next(r for r in rows if r["strategy"] == "distflash")["fits"]


# Each verb with --dtype: the smallest arguments its validation takes, and the dtypes it runs in.
DTYPE_VERBS = {
    "train": (["--seq-len", "64"], ("float32", "bfloat16")),
    "generate": (["--prompt-len", "8"], ("float32", "bfloat16", "float16")),
    "bench": (["--seq-len", "64"], ("float32", "bfloat16", "float16", "float64")),
    "check": (["--seq-len", "32", "--heads", "2", "--head-dim", "16"], ("float32", "bfloat16", "float16", "float64")),
}


def test_every_verb_with_dtype_is_covered(capsys):
    import re

    for verb in VERBS:
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        has_dtype = re.search(r"--dtype\b(?!-)", capsys.readouterr().out) is not None
        assert has_dtype == (verb in DTYPE_VERBS), verb


def test_dtype_takes_torch_names_beside_the_short_ones_on_every_verb(no_world):
    """float32 / bfloat16 (torch's names) and fp32 / bf16, in any case, on each verb with --dtype (issue
    51); past parsing the verb sees torch's name alone (burst train's TrainConfig too)."""
    from burst.cli import train as train_cli

    for verb, (base, _) in DTYPE_VERBS.items():
        for given, canonical in (
            ("float32", "float32"),
            ("fp32", "float32"),
            ("bfloat16", "bfloat16"),
            ("bf16", "bfloat16"),
            ("BFloat16", "bfloat16"),
        ):
            args = build_parser().parse_args([verb, *base, "--device", "cpu", "--dtype", given])
            VERBS[verb].validate(args)
            assert args.dtype == (canonical if verb != "check" else (canonical,)), (verb, given, args.dtype)
            if verb == "train":
                assert train_cli.config(args).dtype == canonical
    args = build_parser().parse_args(["check", "--dtype", "fp32,BF16,float32,float64"])
    assert args.dtype == ("float32", "bfloat16", "float64")  # each once, in the order given


def test_a_bad_dtype_is_refused_listing_the_names_taken(capsys, no_world):
    for verb, (base, taken) in DTYPE_VERBS.items():
        short = {name: alias for alias, name in DTYPE_ALIASES.items() if alias != name}
        for bad in ("float8", "fp8", *(name for name in DTYPES if name not in taken)):
            with pytest.raises(SystemExit) as exited:
                main([verb, *base, "--dtype", bad])
            line = capsys.readouterr().err.strip()
            assert exited.value.code == 2 and "\n" not in line, (verb, bad, line)
            listing = ", ".join(f"{name} ({short[name]})" for name in taken)
            assert line == f"burst {verb}: error: --dtype: {bad!r} is not one of {listing}", line


def test_mistakes_of_any_verb(capsys, no_world):
    """An unknown option, a missing required one, a missing value, an unknown verb: one line each."""
    for argv, line in (
        (["train", "--stepz", "3"], "burst train: error: --stepz: unknown option"),
        (["plan", "--gpus", "4"], "burst plan: error: --seq-len: required"),
        (["train", "--steps"], "burst train: error: --steps: expected one argument"),
        (["nope"], "burst: error: VERB: invalid choice: 'nope'"),
        ([], "burst: error: VERB: missing"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and err[0].startswith(line), (argv, err)


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("burst ")
    for verb in ("bench", "check", "plan", "train", "generate"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = capsys.readouterr().out
        assert "--json" in text and "--debug" in text and "(default:" in text, verb


def _rank_one_fails(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, for ever unless the world ends
    return rank


def test_a_failing_rank_ends_the_world_with_its_message():
    start = time.perf_counter()
    with pytest.raises(WorldError) as failed:
        spawn_world(_rank_one_fails, nproc=2, threads=1, timeout=120)
    elapsed = time.perf_counter() - start
    assert failed.value.rank == 1 and failed.value.summary == "ValueError: rank one cannot go on"
    assert "Traceback" in failed.value.details and "_rank_one_fails" in failed.value.details
    assert elapsed < 60, elapsed  # the start of 2 processes, not the 120 s timeout


def test_a_failure_inside_a_train_world_is_one_line(capsys, tmp_path, monkeypatch):
    """Token ids beyond the vocabulary, past the check before start (skipped here), are found by the
    ranks: exit 1, one line naming the rank and the option, no traceback."""
    from burst.cli import train as train_cli

    monkeypatch.setattr(train_cli, "validate", lambda args: None)
    data = tmp_path / "tokens.bin"
    np.full(200, 300, dtype=np.uint16).tofile(data)  # the tiny model's vocabulary is 256
    assert main(["train", "--seq-len", "64", "--steps", "1", "--nproc", "2", "--data", str(data)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("burst train: error: rank ") and "--data: " in err[0], err
    assert "beyond the model's vocabulary" in err[0]


def test_unwritable_metrics_inside_the_world_ends_it(capsys, tmp_path, monkeypatch):
    """Rank 0's own open() failing (validation skipped here) used to leave rank 1 waiting for ever;
    now the world ends, and with --debug the traceback comes before the one line."""
    from burst.cli import train as train_cli

    monkeypatch.setattr(train_cli, "validate", lambda args: None)
    start = time.perf_counter()
    assert (
        main(
            [
                "train",
                "--seq-len",
                "64",
                "--steps",
                "2",
                "--nproc",
                "2",
                "--debug",
                "--metrics",
                str(tmp_path / "missing" / "m.jsonl"),
            ]
        )
        == 1
    )
    assert time.perf_counter() - start < 120
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("burst train: error: rank 0: FileNotFoundError: ")


def test_train_says_when_nothing_is_left(capsys, tmp_path, no_world):
    step = tmp_path / "step-2"
    step.mkdir()
    from burst.engine.resume import _identity
    from burst.engine.train import TrainConfig

    cfg = TrainConfig(seq_len=64, steps=2, checkpoint_dir=str(tmp_path), resume_step=2)
    (step / "burst.json").write_text(json.dumps({"step": 2, "identity": _identity(cfg), "config": {}}))
    again = ["train", "--seq-len", "64", "--steps", "2", "--checkpoint-dir", str(tmp_path), "--resume-step", "2"]
    assert main([*again, "--json", "-"]) == 0
    said = capsys.readouterr()
    assert "nothing left to train" in said.err and json.loads(said.out) == []  # --json still gets a document


def test_resume_checks_the_data_files_contents_not_its_path(tmp_path, monkeypatch):
    """A checkpoint keeps --data's size and digest: the same file under another path (a run restarted from another
    directory) resumes, another file under the same name (edited, replaced) is refused; a checkpoint that kept the
    path text (0.3.10 and before) is held to that text."""
    from burst.engine.resume import _identity, check_resumable
    from burst.engine.train import TrainConfig

    text = bytes(range(32, 127)) * 40
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "text.txt").write_bytes(text)
    (tmp_path / "b" / "text.txt").write_bytes(text[::-1])  # the same size, other tokens
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-2").mkdir(parents=True)

    def config(data):
        return TrainConfig(seq_len=64, steps=4, data=data, checkpoint_dir=str(ckpt), resume_step=2)

    def saved(identity):
        (ckpt / "step-2" / "burst.json").write_text(json.dumps({"step": 2, "identity": identity, "config": {}}))

    monkeypatch.chdir(tmp_path / "a")
    saved(_identity(config("text.txt")))
    check_resumable(config(str(tmp_path / "a" / "text.txt")))  # the same file, spelt otherwise
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(ValueError, match="data was 'file of 3800 bytes"):
        check_resumable(config("text.txt"))  # another file of that name
    (tmp_path / "b" / "text.txt").write_bytes(text)
    check_resumable(config("text.txt"))  # a copy of it
    from burst.engine import resume

    monkeypatch.setattr(resume, "_WHOLE_BELOW", 1000)  # a large file's sampled digest: the first and last bytes read
    large = resume.data_fingerprint("text.txt")
    (tmp_path / "b" / "text.txt").write_bytes(text[:-1] + b"!")
    assert resume.data_fingerprint("text.txt") != large and large.startswith("file of 3800 bytes")
    (tmp_path / "b" / "text.txt").write_bytes(text)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path / "b")
    legacy = {**_identity(config("text.txt")), "data": "text.txt"}
    saved(legacy)
    check_resumable(config("text.txt"))
    with pytest.raises(ValueError, match="data was 'text.txt'"):
        check_resumable(config("./text.txt"))


def test_bench_runs_one_small_world(capsys, tmp_path):
    """The harness starts its world through burst.launch; --json PATH beside the table, progress on stderr."""
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--seq-len",
                "64",
                "--heads",
                "1",
                "--head-dim",
                "8",
                "--strategies",
                "Burst",
                "--repeats",
                "0",
                "--no-baseline",
                "--nproc",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "| burst |" in captured.out
    assert "burst bench: [1/1] burst on 2 ranks" in captured.err
    result = json.loads(out.read_text())
    assert [r["strategy"] for r in result["strategies"]] == ["burst"] and result["strategies"][0]["max_err"] < 1e-4
    assert result["strategies"][0]["error_ok"]


def test_bench_fails_a_row_whose_error_is_over_its_dtype_bound(capsys, monkeypatch):
    """bench printed a 1e-2 error in float32 and exited 0 (a helper injected it into a rank's output); a row over
    the dtype's bound (burst check's) is marked FAIL and the exit status is 1."""
    import burst.bench
    from burst.bench.harness import error_within_bound

    assert error_within_bound(5e-5, "float32") and not error_within_bound(1e-2, "float32")
    assert not error_within_bound(float("nan"), "bfloat16") and error_within_bound(1e-2, "bfloat16")
    real = burst.bench.run_bench

    def one_row_off(cfg, on_done=None):  # the harness's own row, its error as a wrong rank's would be
        result = real(cfg, on_done)
        result["strategies"][0].update(max_err=1e-2, error_ok=error_within_bound(1e-2, cfg.dtype))
        return result

    monkeypatch.setattr(burst.bench, "run_bench", one_row_off)
    args = ["bench", "--seq-len", "64", "--heads", "1", "--head-dim", "8", "--strategies", "ring", "--repeats", "0"]
    assert main([*args, "--no-baseline"]) == 1
    captured = capsys.readouterr()
    assert "| 1.0e-02 FAIL |" in captured.out, captured.out
    assert "burst bench: error: ring: max err over float32's bound 1e-04" in captured.err, captured.err


def test_generate_prints_text_beside_ids():
    from burst.cli.generate import decode_bytes, summary

    assert decode_bytes([72, 105, 0xC3, 0xA9, 300]) == "Hi\u00e9\ufffd"
    text = summary(
        {
            "prefill_s": 0.1,
            "decode_s_per_token": 0.01,
            "cache_bytes_per_rank": 2**20,
            "tokens": [[72, 105]],
            "text": ["Hi"],
        }
    )
    assert "[0] ids:  72 105" in text and "[0] text: 'Hi'" in text


def test_json_results_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """--json on a full disk truncated an earlier run's results to 0 bytes and said only "No space left on device"
    (a helper's probe): the new results go to a side file first, and the error names the file."""
    import errno
    import os

    from burst.cli import common

    results = tmp_path / "out.json"
    common.write_json(str(results), {"run": 1})
    assert json.loads(results.read_text()) == {"run": 1}

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(common.os, "replace", full)
        with pytest.raises(OSError, match=f"could not write {results}: No space left on device"):
            common.write_json(str(results), {"run": 2})
    assert json.loads(results.read_text()) == {"run": 1} and os.listdir(tmp_path) == ["out.json"]
    link = tmp_path / "latest.json"  # a symbolic link stays one, its target replaced (a diff review)
    link.symlink_to(results)
    common.write_json(str(link), {"run": 4})
    assert link.is_symlink() and json.loads(results.read_text()) == {"run": 4}
    if os.path.exists("/dev/full"):  # a device is written as it is (never replaced), and named when it fails
        with pytest.raises(OSError, match="could not write /dev/full"):
            common.write_json("/dev/full", {"run": 3})
