"""docs/launch.md's torchrun lines, run on the CPU as written (issue 69 item 1).

Every `torchrun` line of the page runs here with the substitutions its last section lists (SUBSTITUTE,
DROPPED, ADDED below; the page's table is checked against them): a one-node line as one node of two
ranks (`--standalone`), an N-node line as two torchrun processes of two ranks each, the two "nodes",
meeting through c10d's rendezvous on 127.0.0.1. An `srun` line must be one of the N-node lines after
`srun`. Each one-node line must be its N-node twin with the launcher swapped, so running the N-node
lines and one one-node line covers the page: the N-node launch is the one that can go wrong.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from requires import importorskip

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "launch.md"
TORCHRUN = Path(sys.executable).parent / "torchrun"
TIMEOUT = 300  # for the whole page
AT_ONCE = 3  # launches at a time: ~6 processes each, a few hundred MB per rank

# option -> the value it takes on the CPU (every occurrence, whatever the page's value)
SUBSTITUTE = {
    "--nproc-per-node": "2",
    "--nnodes": "2",
    "--device": "cpu",
    "--dtype": "float32",
    "--seq-len": "256",
    "--heads": "4",
    "--kv-heads": "2",
    "--head-dim": "32",
    "--model": "tiny",
    "--steps": "2",
}
DROPPED = {"examples/trainer_train.py": ("--bf16", "--fsdp")}  # flags of the script's own, left out on the CPU
ADDED = {"examples/titan_llama.py": ("--no-compile",)}
# the page's substitution table, as its rows read (the test keeps the two in step)
TABLE = [
    ("`--nproc-per-node 8`", "`--nproc-per-node 2`"),
    ("`--nnodes $NNODES`", "`--nnodes 2`"),
    ("`$MASTER_ADDR:29500`", "`127.0.0.1:`"),
    ("`$JOB_ID`", "a fresh id"),
    ("`--device cuda`", "`--device cpu`"),
    ("`--dtype bfloat16`", "`--dtype float32`"),
    ("`--bf16`, `--fsdp` (the Trainer's flags)", "left out"),
    ("`--seq-len N`", "`--seq-len 256`"),
    ("`--heads 32 --kv-heads 8 --head-dim 128`", "`--heads 4 --kv-heads 2 --head-dim 32`"),
    ("`--model llama-7b`", "`--model tiny`"),
    ("`--steps N`", "`--steps 2`"),
    ("`examples/titan_llama.py ...`", "`... --no-compile` added"),
]


def _page_lines() -> list[str]:
    """The page's shell lines that launch something: torchrun, or srun then torchrun."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
    return [
        line.strip() for block in blocks for line in block.splitlines() if re.match(r"\s*(srun\s+)?torchrun\s", line)
    ]


def _split(line: str) -> tuple[list[str], list[str]]:
    """(torchrun's own arguments, the program and its arguments) of a line (after `srun`, if any)."""
    words = shlex.split(line)  # $VARIABLES stay as written
    words = words[words.index("torchrun") + 1 :]
    launcher = []
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        launcher.append(flag)
        if flag != "--standalone":
            launcher.append(words.pop(0))
    return launcher, words


def _on_cpu(program: list[str]) -> list[str]:
    """The program's words with the page's CPU substitutions."""
    script = program[1] if program[0] == "-m" else program[0]
    out, words = [], list(program)
    while words:
        word = words.pop(0)
        if word in DROPPED.get(script, ()):
            continue
        out.append(word)
        if word in SUBSTITUTE and words:
            words.pop(0)
            out.append(SUBSTITUTE[word])
    return out + list(ADDED.get(script, ()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _problems(program: list[str], outputs: list[str]) -> list[str]:
    """What the run's output (stdout and stderr) lacks: `burst check`'s verdict, or the training doors'
    second step (printed by global rank 0, on whichever node the rendezvous made first). That the losses equal one
    process's is tests/test_training_stacks.py's and tests/test_engine.py's to show."""
    printed = "\n".join(outputs)
    if program[:3] == ["-m", "burst", "check"] and "all cases within their bounds" not in printed:
        return ["burst check did not report every case within its bounds"]
    if program[:3] != ["-m", "burst", "check"] and not re.search(r"^step 1 loss \d", printed, re.M):
        return ["no 'step 1 loss' line"]
    return []


def _start(launcher: list[str], program: list[str], nodes: int, out: Path) -> tuple[list[str], list]:
    """`nodes` torchrun processes (the nodes) from the repository root, each in a session of its own,
    writing to files under `out` (a pipe left unread could stall one node, and its peers with it)."""
    cmd = [str(TORCHRUN), *launcher, *_on_cpu(program)]
    started = []
    for node in range(nodes):
        stdout, stderr = out / f"node{node}.out", out / f"node{node}.err"
        with open(stdout, "w") as o, open(stderr, "w") as e:
            started.append(
                (
                    subprocess.Popen(cmd, stdout=o, stderr=e, env=_env(), cwd=ROOT, start_new_session=True),
                    stdout,
                    stderr,
                )
            )
    return cmd, started


def _finish(cmd: list[str], nodes: list, program: list[str], deadline: float) -> list[str]:
    """The failures of one launch (empty: it ran); a node left running past the deadline is killed
    with its workers."""
    outputs, failures = [], []
    for node, stdout, stderr in nodes:
        try:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
            failures.append(f"timed out after {TIMEOUT} s")
        outputs.append(stdout.read_text() + stderr.read_text())  # burst train's step lines go to stderr
        if node.returncode:
            failures.append(f"a node exited {node.returncode}:\n{stderr.read_text()[-2500:]}")
    failures += _problems(program, outputs) if not failures else []
    return [f"{shlex.join(cmd)}\n  {failure}\n{''.join(outputs)[-1500:]}" for failure in failures]


def _recipes():
    one_node, several, srun = {}, {}, []
    for line in _page_lines():
        launcher, program = _split(line)
        if line.startswith("srun"):
            srun.append((line, launcher, program))
        elif "--nnodes" in launcher:
            several[tuple(program)] = (line, launcher, program)
        else:
            one_node[tuple(program)] = (line, launcher, program)
    return one_node, several, srun


def test_page_lines_pair_up_and_the_table_is_the_tests():
    one_node, several, srun = _recipes()
    doors = {key[1] if key[0] == "-m" else key[0] for key in one_node}
    assert {"burst", "examples/titan_llama.py", "examples/trainer_train.py"} <= doors, doors
    assert any(key[:3] == ("-m", "burst", "check") for key in one_node) and any(
        key[:3] == ("-m", "burst", "train") for key in one_node
    ), list(one_node)
    assert _split(_page_lines()[0])[1][:3] == ["-m", "burst", "check"], "the page starts with burst check"
    assert set(one_node) == set(several), (
        f"every one-node line needs its N-node twin (the same program and arguments):\n{set(one_node) ^ set(several)}"
    )
    for line, launcher, _ in one_node.values():
        assert launcher == ["--standalone", "--nproc-per-node", "8"], line
    for line, launcher, _ in several.values():
        assert launcher == [
            "--nnodes",
            "$NNODES",
            "--nproc-per-node",
            "8",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "$MASTER_ADDR:29500",
            "--rdzv-id",
            "$JOB_ID",
        ], line
    assert srun, "the page has no SLURM line"
    for line, launcher, program in srun:
        assert tuple(program) in several and several[tuple(program)][1] == launcher, (
            f"an srun line that is not one of the N-node lines after srun: {line}"
        )
    text = PAGE.read_text()
    for on_page, on_cpu in TABLE:
        assert re.search(rf"^\|[^|\n]*{re.escape(on_page)}[^|\n]*\| {re.escape(on_cpu)}", text, re.M), (
            f"docs/launch.md's substitution table has no row {on_page} -> {on_cpu}"
        )


def test_every_line_runs_on_the_cpu(tmp_path):
    """The N-node lines as two local nodes of two ranks, and the one-node launcher once (the page's
    first line, `burst check`, as one node of two ranks). AT_ONCE launches run together (a core is
    mostly idle while a world starts); their failures are reported together."""
    one_node, several, _ = _recipes()
    if any(key[0] == "examples/trainer_train.py" for key in several):
        importorskip("transformers", reason="transformers is not installed (pip install '.[hf]' from the clone)")
        importorskip("accelerate", reason="accelerate is not installed (pip install '.[hf]' from the clone)")
    first = next(program for key, (_, _, program) in one_node.items() if key[:3] == ("-m", "burst", "check"))
    jobs = [(["--standalone", "--nproc-per-node", "2"], first, 1)]
    for _, _, program in several.values():
        jobs.append(
            (
                [
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{_free_port()}",
                    "--rdzv-id",
                    uuid.uuid4().hex[:12],
                ],
                program,
                2,
            )
        )
    deadline = time.monotonic() + TIMEOUT
    running, failures = [], []
    for number, (launcher, program, nodes) in enumerate(jobs):
        if len(running) == AT_ONCE:
            failures += _finish(*running.pop(0), deadline)
        out = tmp_path / str(number)
        out.mkdir()
        running.append((*_start(launcher, program, nodes, out), program))
    for cmd, nodes, program in running:
        failures += _finish(cmd, nodes, program, deadline)
    assert not failures, "\n\n".join(failures)


def test_every_example_runs_on_gpus_as_written():
    """Each script under examples/ takes --device cuda (one GPU per rank, NCCL), as the page says."""
    for script in sorted((ROOT / "examples").glob("*.py")):
        text = script.read_text()
        # \s*: the formatter puts a long add_argument call's arguments one to a line
        assert re.search(r'add_argument\(\s*"--device",\s*choices=\("cpu", "cuda"\)', text), (
            f"{script.name} has no --device {{cpu,cuda}}"
        )
        assert "torchrun" not in text or "--device cuda" in text, f"{script.name}'s usage shows no GPU line"
