"""Names the versions a run tested, so a failure after a new transformers or torch release says which."""

from __future__ import annotations

from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def pytest_report_header(config):
    return f"burst tests: torch {_version('torch')}, transformers {_version('transformers')}"
