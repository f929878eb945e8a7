"""The oldest torch burst runs on, checked once, when burst is imported.

pyproject.toml asks only for torch>=2.4 so that pip never replaces a torch a user built or chose (CUDA,
ROCm, a nightly) with the newest wheel. burst itself needs newer, and says so here instead of failing
later in a way that names nothing: on torch 2.4 `import burst` raised from torch.library, and several
ranks crashed in aten's CPU flash op (it read grouped heads past their storage: kernels/cpu_flash.py);
2.6 lacks Stream.record_event (the host optimizer) and DCP's no_dist (checkpoints); 2.8's CPU flash op
still corrupted the heap on grouped heads. The suite's two-worker part passed on 2.10 and 2.15 (the
releases it ran on: docs/install.md).
"""

from __future__ import annotations

import os
import warnings

from torch.torch_version import TorchVersion

MIN_TORCH = "2.10"
ALLOW_ENV = "BURST_ALLOW_OLD_TORCH"  # 1: import anyway on an older torch, with a warning (untested there)


def check_torch(version: str, allow_old: bool | None = None) -> None:
    """ImportError when `version` is older than MIN_TORCH, unless allowed (default: ALLOW_ENV set to 1),
    then a warning."""
    if TorchVersion(version) >= MIN_TORCH:
        return
    if allow_old is None:
        allow_old = os.environ.get(ALLOW_ENV) == "1"
    message = f"burst needs torch {MIN_TORCH} or newer; this is torch {version}"
    if allow_old:
        warnings.warn(f"{message} ({ALLOW_ENV}=1: going on, on a release burst was not tested on)", stacklevel=3)
        return
    raise ImportError(
        f"{message}. Upgrade torch the way you installed it (pip does not replace it for you: burst asks only "
        f"for torch>=2.4), or set {ALLOW_ENV}=1 to import burst anyway, untested."
    )
