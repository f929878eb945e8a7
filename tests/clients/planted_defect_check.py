"""`burst check` with a planted defect, run under torchrun by tests/test_check.py.

On the last rank the CPU kernel's dq comes back 0.1% too large: the kind of silent gradient bug
users of ring-attention libraries found only when training diverged. `burst check` must exit 1
and name the failing cases.
"""

import os
import sys

import burst.kernels.cpu_flash as cpu_flash
from burst.cli import main

if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    honest = cpu_flash.backward

    def off_by_a_thousandth(*args, **kwargs):
        dq, dk, dv = honest(*args, **kwargs)
        return dq * 1.001, dk, dv

    cpu_flash.backward = off_by_a_thousandth

sys.exit(main(["check", *sys.argv[1:]]))
