"""Per-pair cost of masked attention vs full, from run_masked_tiles.sh's JSON (one or two trees).

    .venv/bin/python benchmarks/report_masked_tiles.py benchmarks/masks [BEFORE_DIR]
    .venv/bin/python benchmarks/report_masked_tiles.py RUN1,RUN2,RUN3 [BEFORE_DIR]

Several runs (comma-separated directories, each from `OUT=dir bash benchmarks/run_masked_tiles.sh`):
each cell is the median over the runs of that run's ratio to its own full pair, with the runs' range.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

MASKS = ("causal", "window", "documents", "docbalanced")  # docbalanced: the documents, layout doc_zigzag


def _cost(directory: pathlib.Path, mask: str, n: int) -> tuple[float, float]:
    """(seconds per pair relative to full's, fwd+bwd seconds)."""

    def load(name):
        row = json.loads((directory / f"tiles_{name}_{n}.json").read_text())["strategies"][0]
        return row["fwd_s"] + row["bwd_s"], row["pairs_total"]

    t_full, p_full = load("full")
    t, p = load(mask)
    return (t / p) / (t_full / p_full), t


def _median_cost(runs: list[pathlib.Path], mask: str, n: int) -> tuple[float, float, str]:
    """_cost's median over runs, and the runs' range of the ratio (empty for one run)."""
    costs = [_cost(run, mask, n) for run in runs]
    ratios = sorted(c for c, _ in costs)
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(runs) > 1 else ""
    return statistics.median(ratios), statistics.median(t for _, t in costs), spread


def main() -> None:
    runs = [pathlib.Path(d) for d in sys.argv[1].split(",")]
    before = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else None
    head = "| tokens | mask | fwd+bwd s | time per pair vs full's | speed vs a full pair |"
    if before:
        head += " before: time per pair vs full's |"
    print(head)
    print("|---|---|---|---|---|" + ("---|" if before else ""))
    for n in (8192, 16384):
        for mask in MASKS:
            cost, t, spread = _median_cost(runs, mask, n)
            line = f"| {n} | {mask} | {t:.2f} | {cost:.2f}{spread} | {1 / cost:.2f} |"
            if before:
                known = (before / f"tiles_{mask}_{n}.json").exists()
                line += f" {_cost(before, mask, n)[0]:.2f} |" if known else " - |"
            print(line)


if __name__ == "__main__":
    main()
