"""Names the versions a run tested, so a failure after a new transformers or torch release says which,
and starts the longest modules first."""

from __future__ import annotations

from importlib import metadata
from pathlib import PurePosixPath

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
