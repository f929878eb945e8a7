"""`burst train` as a user runs it, and then a process dies under it (issue 51).

kill -9 on rank 0 while the world trains: the launcher must exit non-zero within seconds naming
that rank, and leave none of the processes it started (the ranks, multiprocessing's forkserver and
resource tracker) alive. SIGINT (KeyboardInterrupt) or SIGTERM sent to the launcher alone must end
every rank as well. Processes are found in /proc: the launcher's descendants, the ranks among them
by the name the launcher gives them (burst-rank-N). Each launch costs an interpreter and a forkserver
importing torch, so each fault runs once: rank 1 killed (SIGKILL in the ring's backward) is named the
same way by tests/test_faults.py, whose worlds the same spawn_world starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from world import descendants, process_stat

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc (Linux)"),
    pytest.mark.serial,  # times a world's start and end, and reads /dev/shm: no other test beside it
]

TRAIN = ["train", "--seq-len", "64", "--steps", "100000", "--nproc", "2", "--device", "cpu", "--no-progress"]
START_S = 60.0  # the world up and training, on a loaded 2-core machine (3 interpreters import torch)
EXIT_S = 15.0  # the launcher gone after the fault
GONE_S = 10.0  # every process it started gone after the launcher (the forkserver exits last)
POLL_S = 0.1


def _alive(pid: int, start: str) -> bool:
    stat = process_stat(pid)
    return stat is not None and stat[2] == start and stat[0] not in ("Z", "X")


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _poll(condition, seconds: float):
    """condition() until it returns something true or `seconds` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return value


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _training_ranks(launcher: subprocess.Popen, log: Path) -> dict[int, int]:
    """{rank: pid} once both ranks run and rank 0 has logged a step; fails if the launcher ends first."""

    def ready():
        if launcher.poll() is not None:
            pytest.fail(f"burst train exited ({launcher.returncode}) before training:\n{log.read_text()[-3000:]}")
        ranks = {
            int(_name(pid).removeprefix("burst-rank-")): pid
            for pid in descendants(launcher.pid)
            if _name(pid).startswith("burst-rank-")
        }
        return ranks if len(ranks) == 2 and "\nstep 1 " in "\n" + log.read_text() else None

    ranks = _poll(ready, START_S)
    assert ranks, f"the world was not training within {START_S:.0f} s:\n{log.read_text()[-3000:]}"
    return ranks


@contextlib.contextmanager
def _burst_train(tmp_path: Path):
    """`python -m burst train ...` in a session of its own (so whatever this test leaves is killed
    with it at the end, even if the launcher fails to end its ranks); yields (launcher, stderr log)."""
    log = tmp_path / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    with open(log, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "burst", *TRAIN],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
            # As from a terminal: a suite started in the background (`cmd &` in a script) ignores SIGINT,
            # and Python keeps an inherited SIG_IGN, so Ctrl-C would never reach the launcher.
            preexec_fn=_sigint_default,
        )
    try:
        yield launcher, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_rank_killed_ends_the_launcher_naming_it_and_every_process_it_started(tmp_path):
    """Rank 0, the rank that reports: test_faults kills rank 1, so between them a launcher that named
    one rank whichever died would fail."""
    victim = 0
    with _burst_train(tmp_path) as (launcher, log):
        ranks = _training_ranks(launcher, log)
        started = descendants(launcher.pid)  # the ranks, the forkserver, the resource tracker
        os.kill(ranks[victim], signal.SIGKILL)
        _assert_exits(launcher, log, 1)
        last = log.read_text().strip().splitlines()[-1]
        assert last.startswith(f"burst train: error: rank {victim}: ") and "killed by signal 9" in last, last
        _assert_all_gone(started)


@pytest.mark.parametrize(
    "sent, code, line",
    [(signal.SIGINT, 130, "burst train: interrupted"), (signal.SIGTERM, 128 + signal.SIGTERM, None)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_to_the_launcher_alone_ends_every_rank(tmp_path, sent, code, line):
    """The ranks share the launcher's process group, so a terminal's Ctrl-C reaches them too; `kill PID`
    or a KeyboardInterrupt raised in the launcher alone must end them as well."""
    with _burst_train(tmp_path) as (launcher, log):
        _training_ranks(launcher, log)
        started = descendants(launcher.pid)
        launcher.send_signal(sent)
        _assert_exits(launcher, log, code)
        if line is not None:
            assert log.read_text().strip().splitlines()[-1] == line
        _assert_all_gone(started)


def _assert_exits(launcher: subprocess.Popen, log: Path, code: int) -> None:
    exited = _poll(lambda: launcher.poll() is not None, EXIT_S)
    assert exited, f"the launcher still runs {EXIT_S:.0f} s after the fault:\n{log.read_text()[-2000:]}"
    assert launcher.returncode == code, (launcher.returncode, log.read_text()[-2000:])


def _assert_all_gone(started: dict[int, str]) -> None:
    def running():
        return {pid: _name(pid) for pid, start in started.items() if _alive(pid, start)}

    _poll(lambda: not running(), GONE_S)
    assert not running(), f"still running {GONE_S:.0f} s after the launcher exited: {running()}"


def test_the_launcher_killed_outright_takes_its_ranks_with_it(tmp_path):
    """kill -9 of `burst train` itself (a scheduler's timeout, the OOM killer, a closed SSH session): it
    can end nothing, so each rank ends itself (launch.end_with_launcher); none is left after 5 s, and
    no shared-memory file of the run stays in /dev/shm. The launcher is not reaped until then: a parent that
    reads the launcher's output before it waits (a log streamer) keeps it a zombie, which the ranks' watch had
    taken for alive (they trained on; a helper's probe)."""
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with _burst_train(tmp_path) as (launcher, log):
        _training_ranks(launcher, log)
        started = descendants(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)

        def running():
            return {pid: _name(pid) for pid, start in started.items() if _alive(pid, start)}

        _poll(lambda: not running(), 5.0)
        assert not running(), f"still running 5 s after the launcher was killed (not reaped): {running()}"
        launcher.wait()
    if os.path.isdir("/dev/shm"):
        left = {name for name in set(os.listdir("/dev/shm")) - shm_before if "burst" in name}
        assert not left, left


def test_a_rank_that_ran_out_of_batches_does_not_wait_at_its_end_for_ever(tmp_path):
    """Under torchrun, rank 1 ends (burst.launch.end_rank) while rank 0 still calls burst.shard, whose check
    times out: rank 0 raised, but its exit waited on the check's open collective and rank 1 waited at the
    closing barrier, neither ever ending (a helper's Trainer-less loop with a shorter dataloader on one rank).
    The closing barrier waits the agreement's timeout at most."""
    start = time.monotonic()
    source = (
        "import torch, torch.distributed as dist, burst\n"
        "from burst.launch import end_rank\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 0:\n"
        "    burst.shard(torch.zeros(1, 4))  # alone: rank 1 has no batch left\n"
        "end_rank()\n"
    )
    done = _torchrun_two_ranks(tmp_path / "short.py", source, 120)
    said = "did not make it" in done.stderr or "the group broke while this rank waited" in done.stderr
    assert done.returncode != 0 and said, done.stderr[-2000:]  # rank 0's check: timed out, or its peer left
    assert time.monotonic() - start < 60


def test_a_rank_whose_check_timed_out_exits_while_its_peer_is_stuck_elsewhere(tmp_path):
    """Under torchrun, rank 1 is stuck in work of its own (a sleep) and never makes rank 0's call. Rank 0's check
    times out and raises, but its exit waited on the check's open collective (gloo's worker thread) as long as rank 1
    stayed away: torchrun, seeing no rank fail, waited too. Rank 0 is ended EXIT_GRACE_S after its exit begins and
    torchrun stops rank 1."""
    from burst.agreement import EXIT_GRACE_S

    source = (
        "import time, torch, torch.distributed as dist, burst\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(600)  # stuck elsewhere\n"
        "burst.shard(torch.zeros(1, 4))\n"
    )
    done = _torchrun_two_ranks(tmp_path / "stuck.py", source, EXIT_GRACE_S + 60)  # TimeoutExpired: rank 0 hung
    assert done.returncode != 0 and "did not make it" in done.stderr, done.stderr[-2000:]
    assert "SIGALRM" in done.stderr, done.stderr[-2000:]


def _torchrun_two_ranks(script: Path, source: str, timeout: float):
    """`source` written to `script` and run by torchrun on 2 ranks, the agreement's timeout 3 s; the finished run."""
    from world import run_process_group

    script.write_text(source)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BURST_AGREEMENT_TIMEOUT": "3"}
    return run_process_group([str(torchrun), "--standalone", "--nproc-per-node=2", str(script)], timeout, env=env)
