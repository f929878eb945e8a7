"""Optional dependencies a test module needs: it is skipped where one is missing, except on CI
(whose set-up installs every extra, so a missing one there is a failure)."""

from __future__ import annotations

import os

import pytest


def transformers_or_skip() -> None:
    """Call at module level, before importing anything from transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("transformers is not installed (pip install '.[hf]' from the clone)", allow_module_level=True)


def importorskip(name: str, reason: str | None = None):
    """pytest.importorskip(name), except on CI (the CI env var set, as CI services set it), where every
    extra is installed, so a missing one raises ImportError (the run fails) instead of skipping."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(name)
    return pytest.importorskip(name, reason=reason)
