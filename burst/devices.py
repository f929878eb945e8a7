"""Where each rank runs: `--device` and `--dtype` for the CLI verbs, and binding a rank to its GPU.

A verb resolves its device once, in the launching process, before any rank starts (`resolve_device`:
"auto" is cuda when every local rank has a GPU of its own, else cpu; "cuda" without enough GPUs is a
clear error, not a world of ranks piled on GPU 0). Each rank then binds `cuda:LOCAL_RANK` *before* its
process group starts (`bind`), so NCCL's communicator, the model, the batches and the optimizer state
all land on that rank's GPU; a CPU run uses gloo (`backend_for`). spawn_world and torchrun both give
LOCAL_RANK.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")
# The one reading of a --dtype name: each spelling the CLI takes (torch's own name, or the short one
# the verbs first took) to its canonical name, torch's (`str(torch.bfloat16)` less "torch."), which
# burst.check, the benchmarks and kernels.reference speak. Parsing normalises to it, so nothing after
# the command line meets "bf16".
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float64": "float64",
    "fp64": "float64",
}
DTYPES = {name: getattr(torch, name) for name in dict.fromkeys(DTYPE_ALIASES.values())}  # canonical -> dtype


def local_ranks(world: int) -> int:
    """Ranks that share this machine: torchrun's LOCAL_WORLD_SIZE, else the whole (spawned) world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def resolve_device(name: str, local: int) -> str:
    """ "cpu" or "cuda" for `local` ranks on this machine; ValueError (naming --device) when it cannot be."""
    if name not in DEVICES:
        raise ValueError(f"--device: {name!r} is not one of {', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if gpus >= local else "cpu"
    if name == "cuda" and gpus == 0:
        raise ValueError(
            "--device: cuda, but this machine has no CUDA device that torch can use "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu"
        )
    if name == "cuda" and gpus < local:
        raise ValueError(
            f"--device: cuda needs a GPU per rank: {local} ranks on this machine, {gpus} GPU(s) "
            "(fewer ranks, or --device cpu)"
        )
    return name


def dtype_listing(names) -> str:
    """Canonical `names` each with its other spellings, for help and errors: "float32 (fp32), bfloat16 (bf16)"."""

    def spelt(name: str) -> str:
        others = [alias for alias, canonical in DTYPE_ALIASES.items() if canonical == name and alias != name]
        return f"{name} ({', '.join(others)})" if others else name

    return ", ".join(spelt(name) for name in names)


def canonical_dtype(name: str, allowed=tuple(DTYPES)) -> str:
    """The canonical name of a dtype written any way --dtype takes ("bf16", "BFloat16" -> "bfloat16");
    ValueError (naming --dtype and listing the names taken) for one that is not among `allowed`."""
    canonical = DTYPE_ALIASES.get(name.strip().lower())
    if canonical not in allowed:
        raise ValueError(f"--dtype: {name!r} is not one of {dtype_listing(allowed)}")
    return canonical


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --dtype name in any spelling (torch.bfloat16 for "bf16" or "bfloat16")."""
    return DTYPES[canonical_dtype(name)]


def check_dtype(dtype: torch.dtype, device: str) -> None:
    """ValueError (naming --dtype) for a dtype the device cannot compute in."""
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "--dtype: bfloat16 (bf16) needs a GPU of compute capability 8.0 or newer; use float16 or float32"
        )


def backend_for(device: str) -> str:
    """The process group's backend for ranks on `device`: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def device_of_backend(backend: str) -> str:
    """The device a rank of a `backend` world computes on: NCCL joins GPUs, gloo CPUs."""
    return "cuda" if backend == "nccl" else "cpu"


def bind(device: str) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK made current (call before the process group starts), or cpu."""
    if device != "cuda":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} GPU(s) visible "
            "(CUDA_VISIBLE_DEVICES, or fewer ranks per node)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
