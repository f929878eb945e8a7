"""The GPU check's report: sections with their time budgets, tables and notes, written to
DIR/report.md and DIR/report.json after every section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from burst.kernels import aten_flash, cuda_flash_attn, select_kernel

from .cases import DTYPE_NAMES, Sizes, release_memory


@dataclass
class Section:
    id: str
    title: str
    deadline: float
    status: str = "ok"  # ok | FAIL (a result out of bounds) | error (it raised) | running
    seconds: float = 0.0
    notes: list = dataclasses.field(default_factory=list)
    tables: list = dataclasses.field(default_factory=list)  # [{"name", "columns", "rows"}]
    error: str = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[gpu_check {self.id}] {text}", flush=True)

    def table(self, name: str, columns: list, rows: list) -> None:
        self.tables.append({"name": name, "columns": list(columns), "rows": rows})

    def fail(self, why: str) -> None:
        self.status = "FAIL" if self.status != "error" else self.status
        self.note(f"FAIL: {why}")

    def skip_for_time(self, what: str, need: float = 0.0) -> bool:
        """True (and noted) when fewer than `need` seconds are left in this section's budget."""
        if self.left() > need:
            return False
        self.note(f"skipped for time: {what} (section budget spent)")
        return True


class Report:
    def __init__(self, outdir: str, device: torch.device, budget: float, sizes: Sizes, last: str | None = None):
        """last: the id of the last section this run selects, whose deadline is the budget's end (what the
        sections before it left unused, and what a --budget above the planned sum adds, goes to it)."""
        self.outdir, self.device, self.sizes, self.last = outdir, device, sizes, last
        self.start = time.monotonic()
        self.end = self.start + budget
        self.sections: list[Section] = []
        self._planned = self.start
        self.facts = environment(device)
        self.facts["budget_s"] = budget
        self.facts["sizes"] = dataclasses.asdict(sizes)

    @contextlib.contextmanager
    def section(self, sid: str, title: str):
        """A guarded section: an exception is recorded (status error) and the next section runs.
        Its deadline is the planned schedule's (unused time rolls forward), never past the end; the last
        section's is the end."""
        self._planned += self.sizes.budgets[sid]
        sec = Section(sid, title, self.end if sid == self.last else min(self._planned, self.end))
        self.sections.append(sec)
        began = time.monotonic()
        print(f"[gpu_check {sid}] {title} ({sec.left():.0f} s)", flush=True)
        try:
            yield sec
        except Exception as err:  # noqa: BLE001 - one failing section must not stop the others
            sec.status = "error"
            sec.error = traceback.format_exc()
            sec.note(f"error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        finally:
            sec.seconds = time.monotonic() - began
            try:
                release_memory(self.device)
            except Exception as err:  # noqa: BLE001 - a sticky CUDA error: every later section will say so too
                sec.note(f"could not free device memory after this section: {first_line(err)}")
            self.write()

    def as_dict(self) -> dict:
        return {
            **self.facts,
            "total_s": time.monotonic() - self.start,
            "ok": all(s.status == "ok" for s in self.sections),
            "sections": [dataclasses.asdict(s) for s in self.sections],
        }

    def write(self) -> None:
        os.makedirs(self.outdir, exist_ok=True)
        data = self.as_dict()
        with open(os.path.join(self.outdir, "report.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)
        with open(os.path.join(self.outdir, "report.md"), "w") as f:
            f.write(markdown(data))


def markdown(data: dict) -> str:
    lines = [
        f"# burst GPU check: {data['device_name']}",
        "",
        f"Command: `{data['command']}`  ",
        f"burst commit {data['git_commit']}, torch {data['torch']}, "
        f"CUDA {data['cuda']}, flash_attn {data['flash_attn']}, aten_flash {data.get('aten_flash')}, "
        f"mode {data['mode']}, {data['total_s']:.0f} s of a {data['budget_s']:.0f} s budget"
        + (f", {data['gpu_memory_bytes'] / 2**30:.0f} GiB of GPU memory." if data["gpu_memory_bytes"] else "."),
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {s['id']}. {s['title']} | {s['status']} | {s['seconds']:.0f} |" for s in data["sections"]]
    found = [
        f"- {s['id']}: {n}"
        for s in data["sections"]
        for n in s["notes"]
        if n.startswith(("FAIL", "error", "skipped for time", "could not"))
    ]
    if found:
        lines += ["", "What to look at (failures, errors, what ran out of time):", "", *found]
    for s in data["sections"]:
        lines += ["", f"## {s['id']}. {s['title']} ({s['status']})", ""]
        lines += [f"- {n}" for n in s["notes"]]
        for t in s["tables"]:
            lines += [
                "",
                f"**{t['name']}**",
                "",
                "| " + " | ".join(t["columns"]) + " |",
                "|" + "---|" * len(t["columns"]),
            ]
            lines += ["| " + " | ".join(_cell(r.get(c)) for c in t["columns"]) + " |" for r in t["rows"]]
        if s["error"]:
            lines += ["", "```", s["error"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _cell(x) -> str:
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.1e}" if 0 < abs(x) < 1e-2 else f"{x:.3g}"
    return "-" if x is None else str(x).replace("|", "/")


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "mode": device.type,
        "device_name": torch.cuda.get_device_name(0)
        if cuda
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "flash_attn": cuda_flash_attn.available(),
        "aten_flash": aten_flash.available(),
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "command": " ".join(["scripts/gpu_check.sh", *sys.argv[1:]]),
        "selected_kernels": {
            DTYPE_NAMES[dt]: select_kernel(device, dt).__name__.rsplit(".", 1)[-1] for dt in DTYPE_NAMES
        },
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
    }


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return (
            subprocess.run(
                ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def repo_root() -> str:
    """The repository's root (this file is burst/bench/gpu_check/report.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
