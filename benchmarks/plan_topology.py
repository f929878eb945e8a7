"""The planner's prediction for the emulated-link topology runs (benchmarks/topology/*.json) against
what they measured; appended to benchmarks/topology.md by benchmarks/run_topology.sh.

Profile: `local`, calibrated (benchmarks/report/results.json: kernel FLOP/s with 2 ranks on 2 cores,
loopback bandwidth and latency), halved FLOP/s because the 4 ranks share 2 cores, the inter-node
bandwidth set to the emulated one.
"""

import glob
import json
import os
from dataclasses import replace

from burst.plan import Cluster, Workload, estimate
from burst.plan.profiles import PROFILES

here = os.path.dirname(os.path.abspath(__file__))
cal = json.load(open(os.path.join(here, "report", "results.json")))["calibration"]
local = replace(
    PROFILES["local"],
    flops=cal["flops"] / 2,
    intra_bw=cal["bandwidth"],
    inter_bw=cal["bandwidth"],
    intra_latency=cal["latency"],
    inter_latency=cal["latency"],
)
print("\n## The planner against these runs\n")
print("`burst.plan` with the calibrated local profile (FLOP/s halved: 4 ranks on 2 cores) and the emulated")
print("inter-node bandwidth; measured / predicted fwd+bwd wall time.\n")
print("| inter GB/s (emulated) | strategy | measured s | predicted s | measured / predicted |")
print("|---|---|---|---|---|")
ratios = []
for path in sorted(
    glob.glob(os.path.join(here, "topology", "inter_*.json")), key=lambda p: float(p.split("_")[-1][:-5])
):
    r = json.load(open(path))
    cfg = r["config"]
    cluster = Cluster(
        gpus=cfg["nproc"], gpus_per_node=cfg["ranks_per_node"], profile=local, inter_bw=cfg["inter_node_gbps"] * 1e9
    )
    w = Workload(
        seq_len=cfg["seq_len"],
        heads=cfg["heads"],
        head_dim=cfg["head_dim"],
        causal=cfg["causal"],
        dtype_bytes=4,
        layout=cfg["layout"],
    )
    for s in r["strategies"]:
        measured = s["fwd_s"] + s["bwd_s"]
        predicted = estimate(s["strategy"], cluster, w).wall_s
        ratios.append(measured / predicted)
        print(
            f"| {cfg['inter_node_gbps']} | {s['strategy']} | {measured:.2f} | {predicted:.2f} | "
            f"{measured / predicted:.2f} |"
        )
within = sum(0.75 <= x <= 1.25 for x in ratios)
print(f"\n{within} of {len(ratios)} within ±25% (measured / predicted {min(ratios):.2f} to {max(ratios):.2f}).")
