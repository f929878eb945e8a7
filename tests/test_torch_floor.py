"""The torch floor (burst/torch_floor.py): `import burst` on a torch older than MIN_TORCH is one clear
ImportError naming both releases, or with BURST_ALLOW_OLD_TORCH=1 a warning; newer releases, local
builds and nightlies pass. docs/install.md states the same floor."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from burst.torch_floor import ALLOW_ENV, MIN_TORCH, check_torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", [torch.__version__, f"{MIN_TORCH}.0", f"{MIN_TORCH}.0+cu128", "3.0.0.dev20270101"])
def test_this_torch_and_newer_ones_pass(version):
    check_torch(version, allow_old=False)


@pytest.mark.parametrize("version", ["2.4.1+cu121", "2.8.0", "2.9.1+cpu"])
def test_an_older_torch_is_refused_naming_both_releases_or_warned_when_allowed(version):
    with pytest.raises(
        ImportError,
        match=rf"burst needs torch {MIN_TORCH} or newer; this is torch {re.escape(version)}\..*{ALLOW_ENV}=1",
    ):
        check_torch(version, allow_old=False)
    with pytest.warns(UserWarning, match=rf"this is torch {re.escape(version)} \({ALLOW_ENV}=1"):
        check_torch(version, allow_old=True)


def test_import_burst_refuses_an_older_torch_before_anything_else():
    """The check runs as `import burst` starts: a torch that calls itself 2.8.0 stops it with the
    ImportError; the environment variable lets it through with the warning."""
    code = "import torch; torch.__version__ = '2.8.0'; import burst; print('imported')"
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert refused.returncode != 0 and "ImportError: burst needs torch" in refused.stderr, refused.stderr[-2000:]
    allowed = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**env, ALLOW_ENV: "1"},
        cwd=ROOT,
    )
    assert allowed.returncode == 0 and "imported" in allowed.stdout, allowed.stderr[-2000:]
    assert "burst needs torch" in allowed.stderr


def test_the_install_page_states_the_floor():
    assert f"torch {MIN_TORCH}" in (ROOT / "docs" / "install.md").read_text()
