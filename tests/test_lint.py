"""ruff's lint over the tree (its rules in pyproject.toml): unused and undefined names fail the suite."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "burst", "tests", "examples",
                           "benchmarks", "scripts"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in done.stderr, "ruff is in the dev extra: bash scripts/setup.sh installs it"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
