"""A long run survives its faults: the short form of the fault stress (burst/bench/faults.py).

Eight local worlds in a row: one rank raises after the forward, one is killed (SIGKILL) while its
peer waits in the ring's backward, one never makes the call its peer waits for in the agreement
check, one stops itself (SIGSTOP) where the kill was; each followed by a clean world. Every faulty
world ends within the bound with the right error naming the right rank, no process and no
shared-memory file is left, and every clean world after a fault works. `python -m
burst.bench.faults --worlds 30` is the long form (benchmarks/faults.md).
"""

from __future__ import annotations

import pytest
from burst.bench import faults

pytestmark = pytest.mark.serial  # times each faulty world's end and reads /dev/shm: no other test beside it


def test_worlds_with_faults_end_promptly_naming_the_rank_and_leave_nothing():
    rows = faults.stress(worlds=8, seed=1)
    assert {r["fault"] for r in rows} == {"raise", "kill", "stall", "freeze", "none"}
    wrong = [r for r in rows if not r["ok"]]
    assert not wrong, wrong
