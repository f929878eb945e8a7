"""Put on PYTHONPATH, every Python process of a `burst train` (the launcher and each spawned rank) runs
with a train_step that runs out of device memory (CUDA's torch.OutOfMemoryError, raised on any device):
what a too-long --seq-len does on a GPU, for tests/test_train_memory.py."""

import burst.engine.train as train_module
import torch


def train_step(*args, **kwargs):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.2 GiB is free."
    )


train_module.train_step = train_step
