"""`burst train` whose rank 1 is killed (SIGKILL) in the middle of its third step, on torchrun's first
attempt only: what a machine failure does to a run under `torchrun --max-restarts N ... --resume`."""

import os
import signal
import sys

import burst.engine.train as train_module
from burst.cli import main

KILLED_RANK, KILLED_AT_CALL = 1, 2
_original, _calls = train_module.train_step, [0]


def train_step(*args, **kwargs):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and int(os.environ["RANK"]) == KILLED_RANK and _calls[0] == KILLED_AT_CALL:
        os.kill(os.getpid(), signal.SIGKILL)
    _calls[0] += 1
    return _original(*args, **kwargs)


train_module.train_step = train_step
sys.exit(main(sys.argv[1:]))
