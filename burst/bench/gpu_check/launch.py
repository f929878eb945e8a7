"""Every section in order under one deadline, and the command line (`python -m burst.bench.gpu_check`).
"""

from __future__ import annotations

import argparse
import os

import torch

from .cases import CPU_SIZES, CUDA_SIZES
from .features import section_features
from .kernels import section_kernels
from .memory import section_memory
from .report import Report
from .speed import section_speed
from .training import section_training
from .worlds import section_worlds


def run(outdir: str, device: torch.device | None = None, budget: float | None = None) -> dict:
    """Every section on `device` (default: CUDA when available, else CPU; BURST_DEVICE overrides);
    writes outdir/report.md and report.json; returns the report as a dict."""
    if device is None:
        wanted = os.environ.get("BURST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(wanted)
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    budget = budget if budget is not None else sum(sizes.budgets.values())
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if sizes.threads:
        torch.set_num_threads(sizes.threads)
    rep = Report(outdir, device, budget, sizes)
    rep.write()
    section_kernels(rep)
    several = section_worlds(rep)["backend"]
    section_speed(rep, several)
    section_memory(rep, several)
    section_features(rep)
    section_training(rep)
    rep.write()
    return rep.as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m burst.bench.gpu_check", description="Prove burst on this machine's GPU in one command; DIR/report.md holds what it measured.")
    p.add_argument("outdir", help="where report.md and report.json are written")
    p.add_argument("--budget", type=float, default=None, help="global deadline in seconds (default: the sections' sum)")
    args = p.parse_args(argv)
    data = run(args.outdir, budget=args.budget)
    print(f"gpu_check: {'all sections ok' if data['ok'] else 'NOT all ok'}; report in {args.outdir}/report.md")
    return 0 if data["ok"] else 1
