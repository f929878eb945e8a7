"""Every section in order under one deadline, and the command line (`python -m burst.bench.gpu_check`)."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from .cases import CPU_SIZES, CUDA_SIZES
from .features import section_features
from .kernels import section_kernels
from .memory import section_memory
from .references import section_references
from .report import Report
from .speed import section_speed
from .training import section_training
from .worlds import section_worlds

SECTIONS = ("1", "2", "3", "4", "5", "6", "7")
DEFAULT_SECTIONS = SECTIONS[:6]  # 7 (the references' speed, issue 66) needs most of a command's 10 minutes alone


def run(
    outdir: str,
    device: torch.device | None = None,
    budget: float | None = None,
    sections: tuple = DEFAULT_SECTIONS,
    **sizes_changed,
) -> dict:
    """The `sections` (default every one) on `device` (default: CUDA when available, else CPU;
    BURST_DEVICE overrides); writes outdir/report.md and report.json; returns the report as a dict.
    Without section 2 no several-rank world is known to run, so 3 and 4 time one rank only.
    sizes_changed: Sizes fields to replace (a rerun of what a short budget left out, e.g.
    kernel_names=("cudnn",), world_ranks=(4,))."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"no section {', '.join(sorted(unknown))}: the sections are {', '.join(SECTIONS)}")
    if device is None:
        wanted = os.environ.get("BURST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(wanted)
    sizes = dataclasses.replace(CUDA_SIZES if device.type == "cuda" else CPU_SIZES, **sizes_changed)
    budget = budget if budget is not None else sum(sizes.budgets[s] for s in sections)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    if sizes.threads:
        torch.set_num_threads(sizes.threads)
    rep = Report(outdir, device, budget, sizes, last=max(sections, key=SECTIONS.index))
    rep.write()
    several = None  # the backend that ran several ranks on this device (section 2)
    if "1" in sections:
        section_kernels(rep)
    if "2" in sections:
        several = section_worlds(rep)["backend"]
    if "3" in sections:
        section_speed(rep, several)
    if "4" in sections:
        section_memory(rep, several)
    if "5" in sections:
        section_features(rep)
    if "6" in sections:
        section_training(rep)
    if "7" in sections:
        section_references(rep)
    rep.write()
    return rep.as_dict()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m burst.bench.gpu_check",
        description="Prove burst on this machine's GPU in one command; DIR/report.md holds what it measured.",
    )
    p.add_argument("outdir", help="where report.md and report.json are written")
    p.add_argument("--budget", type=float, default=None, help="global deadline in seconds (default: the sections' sum)")
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help="comma-separated section numbers to run (default: 1-6; 2 gives 3 and 4 their several-rank "
        "world; 7, the speed against SDPA's flash and cuDNN backends and FlexAttention, runs alone)",
    )
    p.add_argument("--kernels", default="", help="section 1: only these kernel paths (comma-separated names)")
    p.add_argument("--ranks", default="", help="section 2: only worlds of these sizes besides one rank (e.g. 4)")
    args = p.parse_args(argv)
    changed = {}
    if args.kernels:
        changed["kernel_names"] = tuple(_listed(args.kernels))
    if args.ranks:
        changed["world_ranks"] = tuple(int(r) for r in _listed(args.ranks))
    data = run(args.outdir, budget=args.budget, sections=tuple(_listed(args.sections)), **changed)
    print(f"gpu_check: {'all sections ok' if data['ok'] else 'NOT all ok'}; report in {args.outdir}/report.md")
    return 0 if data["ok"] else 1


def _listed(text: str) -> list:
    return [s.strip() for s in text.split(",") if s.strip()]
