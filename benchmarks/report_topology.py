"""benchmarks/topology.md from benchmarks/topology/*.json (bash benchmarks/run_topology.sh)."""

import glob
import json
import os

from burst.plan import papers

here = os.path.dirname(os.path.abspath(__file__))
print("# Topology: flat ring vs double ring vs Ulysses vs USP over an EMULATED slow inter-node link\n")
print("4 local ranks as 2 nodes x 2 ranks (`burst.Topology(local_world_size=2)`), 1 thread each on 2 cores;")
print("the inter-node link is EMULATED (every transfer crossing nodes takes bytes / bandwidth, comm/emulation.py),")
print("intra-node transfers use the real loopback. fp32, 8 heads of 64, full mask, forward + backward.")
print('`burst:flat` is burst on the flat ring of the same topology. "compute share" is the busiest rank\'s')
print("kernel time over the wall time (1.0 = all communication hidden).\n")
print(
    "| inter GB/s (emulated) | tokens | strategy | fwd s | bwd s | fwd+bwd s | compute share "
    "| inter-node MiB (busiest rank) | commit |"
)
print("|---|---|---|---|---|---|---|---|---|")
for path in sorted(
    glob.glob(os.path.join(here, "topology", "inter_*.json")), key=lambda p: float(p.split("_")[-1][:-5])
):
    r = json.load(open(path))
    cfg = r["config"]
    for s in r["strategies"]:
        print(
            f"| {cfg['inter_node_gbps']} | {cfg['seq_len']} | {s['strategy']} | {s['fwd_s']:.2f} | {s['bwd_s']:.2f} | "
            f"{s['fwd_s'] + s['bwd_s']:.2f} | {s['compute_share']:.2f} | {s['sent_inter_max_per_rank'] / 2**20:.1f} | "
            f"{r.get('git_commit')} |"
        )
print("\n## Double ring against the flat ring\n")
t = papers.burstengine_comm_time(G=4, n_inter=2, t_intra=0.0, t_inter=1.0)
print(
    f"burstengine.md Table 1 with a slow inter-node link (T_intra -> 0), G = 4 in 2 nodes: RingAttention "
    f"{t['RingAttention']:.0f} T, DoubleRing {t['DoubleRing']:.0f} T, BurstAttention {t['BurstAttention']:.0f} T "
    f"(communication time; flat/double {t['RingAttention'] / t['BurstAttention']:.1f}x for ring vs burst).\n"
)
print("| inter GB/s (emulated) | burst flat / double (wall) | ring flat / double (wall) |")
print("|---|---|---|")
for path in sorted(
    glob.glob(os.path.join(here, "topology", "inter_*.json")), key=lambda p: float(p.split("_")[-1][:-5])
):
    r = json.load(open(path))
    wall = {s["strategy"]: s["fwd_s"] + s["bwd_s"] for s in r["strategies"]}
    print(
        f"| {r['config']['inter_node_gbps']} | {wall['burst:flat'] / wall['burst']:.2f} | "
        f"{wall['ring:flat'] / wall['ring']:.2f} |"
    )
print(
    "\nCommand: `bash benchmarks/run_topology.sh` (N=4096 by default: CPU compute is slow, so only links below "
    "~0.1 GB/s are slower than a step of compute; the issue's 16K at 0.1-10 GB/s would show every strategy "
    "compute-bound here)."
)
