"""`scripts/gpu_check.sh DIR`: one prepared command that proves burst on a GPU (issue 27).

On a machine with one CUDA GPU it runs, each section in its own time budget under one global
deadline, and writes DIR/report.md and DIR/report.json after every section (a run cut short still
leaves what it measured):

1. kernels: every kernel path burst selects on this device, through the block step (masks.plan_tiles,
   block.attend_forward/attend_backward), against float64 (kernels/reference.py) for full, causal,
   window, documents and block-sparse masks and striped causal across two ranks, each dtype, GQA;
   which kernel served which tile; and torch SDPA's own backends (the speed yardstick).
2. worlds: burst.check (every strategy x layout x causal x dtype) and the masks through
   burst.attention on a one-rank world (NCCL on a GPU), then 2-4 ranks sharing the device with
   whichever backend takes it (probed: NCCL, then gloo with CUDA tensors, whose point-to-point
   transfers burst stages through host memory: comm/p2p.py).
3. speed: the block step and one-rank burst.attention fwd+bwd against torch SDPA's flash path.
4. memory: the longest sequence whose fwd+bwd fits, burst vs SDPA; peak per rank vs the 1/G share;
   the engine's model trained two steps at the longest length each checkpointing mode reaches.
5. CUDA-only features: FSDP2 CPU offload in `burst train`, bf16 autocast, `burst check`.
6. training stacks against one process: `burst train --device cuda --dtype bfloat16`, the transformers
   Trainer with accelerate's FSDP2 plugin in bf16 (training.py).

BURST_DEVICE=cpu runs the same code at tiny sizes on the CPU (the test suite does, so this cannot
rot); there "fits" in section 4 means a peak-RSS growth under a cap, not a CUDA out-of-memory.

    PYTHONPATH=. python3 -m burst.bench.gpu_check DIR [--budget SECONDS]

One module per part: cases.py (sizes, masks, inputs, the float64 reference, the block step),
report.py (sections and the written report), kernels.py, worlds.py, speed.py, memory.py and
features.py and training.py (sections 1-6), launch.py (the sections in order, the command line).
"""

from .cases import CPU_SIZES, CUDA_SIZES, KERNEL_CASES, QUANTITIES, Sizes, compare
from .kernels import kernel_rows
from .launch import main, run
from .memory import longest, memory_trial
from .report import Report, Section

__all__ = [
    "CPU_SIZES",
    "CUDA_SIZES",
    "KERNEL_CASES",
    "QUANTITIES",
    "Report",
    "Section",
    "Sizes",
    "compare",
    "kernel_rows",
    "longest",
    "main",
    "memory_trial",
    "run",
]
