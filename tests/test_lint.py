"""ruff over the tree (its settings in pyproject.toml): unused and undefined names and lines over 120
columns fail the suite, and so does a file `ruff format` would change (run `ruff format burst tests
examples benchmarks scripts`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = ["burst", "tests", "examples", "benchmarks", "scripts"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", *TREE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "No module named ruff" not in done.stderr, "ruff is in the dev extra: bash scripts/setup.sh installs it"
    return done


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = _ruff(*command)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
