"""Names the versions a run tested, so a failure after a new transformers or torch release says which,
starts the longest modules first, and fails a run that leaves something new in the clone's root (a test
or example writing into the user's working directory)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAY_LEAVE = {".pytest_cache", "__pycache__", "bench_out"}  # caches, and .gitignore's folder for benchmark runs
_ROOT_BEFORE = pytest.StashKey[set]()

# The modules that take longest on two workers (benchmarks/suite_time.md), longest first. scripts/test.sh
# hands each worker one module at a time in collection order (--no-loadscope-reorder: xdist would start
# the modules with the most tests first, which are quick, and leave these for the end, where one worker
# runs the last of them alone).
LONGEST_FIRST = (
    "test_training_stacks",
    "test_launch_recipes",
    "test_hf_zoo",
    "test_gpu_check",
    "test_transformers_jobs",
    "test_transformers",
    "test_generate",
    "test_gpu_train_lengths",
    "test_hf_selection",
    "test_engine",
    "test_hf_hybrid",
    "test_transformers_generate",
    "test_masks_and_balance",
    "test_hf_dsa",
    "test_compile",
    "test_gpu_paths",
    "test_backward_side",
    "test_numerics_8ranks",
    "test_hf_zoo_real",
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def pytest_report_header(config):
    return f"burst tests: torch {_version('torch')}, transformers {_version('transformers')}"


def pytest_collection_modifyitems(config, items):
    """LONGEST_FIRST's modules first, in its order; the rest after them, as collected."""
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(PurePosixPath(item.nodeid.split("::")[0]).stem, len(order)))


def _root_entries() -> set:
    return {p.name for p in ROOT.iterdir() if p.name not in MAY_LEAVE and not p.name.endswith(".egg-info")}


def pytest_sessionstart(session):
    session.config.stash[_ROOT_BEFORE] = _root_entries()


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks once, at the end
        return
    left = sorted(_root_entries() - session.config.stash[_ROOT_BEFORE])
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        message = f"FAILED: the run left {left} in {ROOT} (write under tmp_path instead)"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:  # -p no:terminal
            print(message)
        else:
            reporter.write_line(message, red=True)
