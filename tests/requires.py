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
        pytest.skip("transformers is not installed (pip install 'burst-attention[hf]')", allow_module_level=True)
