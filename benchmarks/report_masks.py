"""Turn benchmarks/masks/*.json into benchmarks/masks.md (printed; run_masks.sh writes it).

The sections from "## Masked tiles" on are written by hand around report_masked_tiles.py's table:
they are read from the current benchmarks/masks.md and printed again unchanged.
"""

import json
import os

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "masks")


def load(name):
    path = os.path.join(here, name)
    return json.load(open(path)) if os.path.exists(path) else None


print("# Masks and workload balance (BurstEngine Table 3 at our scale)\n")
print("Command: `bash benchmarks/run_masks.sh`. 16,384 tokens, batch 1, 8 heads, head dim 64, fp32,")
print("2 ranks x 1 thread (gloo; messages up to 1 MiB through shared memory since 99d1479). Times are the best of 2")
print("passes after a warm-up, max over ranks.")
print("`compute max/min` is the spread of the ranks' time inside attention kernels (fwd+bwd).\n")
print("## Same sequence, different masks (strategy burst)\n")
print(
    "| mask | layout | attended pairs | fwd+bwd s | speedup vs full | useful TFLOP/s (fwd+bwd) "
    "| compute max/min | max err |"
)
print("|---|---|---|---|---|---|---|---|")
full = load("full.json")
base_t = None
for name, label in (
    ("full.json", "full"),
    ("causal_zigzag.json", "causal"),
    ("window_2048.json", "causal, window 2048"),
    ("documents_8.json", "causal, 8 packed documents"),
):
    r = load(name)
    if not r:
        continue
    s = r["strategies"][0]
    t = s["fwd_s"] + s["bwd_s"]
    base_t = base_t or t
    flops = 4 * 8 * 64 * s["pairs_total"] * 3.5
    print(
        f"| {label} | {r['config']['layout']} | {s['pairs_total']:,} | {t:.2f} | {base_t / t:.2f}x | "
        f"{flops / t / 1e12:.3f} | {s['compute_max_over_min']:.2f} | {s['max_err']:.1e} |"
    )
print("\n## Causal: schedules and layouts\n")
print(
    "| strategy | layout | fwd s | bwd s | fwd+bwd vs SDPA | pairs max/mean | compute max/min "
    "| sent fwd MiB | sent bwd MiB |"
)
print("|---|---|---|---|---|---|---|---|---|")
base = None
for name in ("causal_contiguous.json", "causal_zigzag_all.json", "causal_striped.json"):
    r = load(name)
    if not r:
        continue
    base = r["sdpa_single_process"] or base
    for s in r["strategies"]:
        vs = (base["fwd_s"] + base["bwd_s"]) / (s["fwd_s"] + s["bwd_s"]) if base else float("nan")
        print(
            f"| {s['strategy']} | {r['config']['layout']} | {s['fwd_s']:.2f} | {s['bwd_s']:.2f} | {vs:.2f} | "
            f"{s['pairs_fwd_max_over_mean']:.2f} | {s['compute_max_over_min']:.2f} | "
            f"{s['sent_fwd_per_rank'] / 2**20:.0f} | {s['sent_bwd_per_rank'] / 2**20:.0f} |"
        )
if base:
    print(f"\nSDPA, one process x 2 threads, causal: fwd {base['fwd_s']:.2f} s, bwd {base['bwd_s']:.2f} s.")

print("\n## Block-sparse: contiguous vs striped (burstengine.md Fig. 11)\n")
print("Random layout: 25% of 512-token block pairs plus the diagonal, combined with causal; strategy burst.\n")
print("| layout | attended pairs | fwd+bwd s | pairs max/mean | compute max/min | useful TFLOP/s |")
print("|---|---|---|---|---|---|")
for layout in ("contiguous", "striped"):
    r = load(f"block_sparse_{layout}.json")
    if not r:
        continue
    s = r["strategies"][0]
    t = s["fwd_s"] + s["bwd_s"]
    print(
        f"| {layout} | {s['pairs_total']:,} | {t:.2f} | {s['pairs_fwd_max_over_mean']:.2f} | "
        f"{s['compute_max_over_min']:.2f} | {4 * 8 * 64 * s['pairs_total'] * 3.5 / t / 1e12:.3f} |"
    )

kept_from = "## Masked tiles"
md = os.path.join(os.path.dirname(here), "masks.md")
written = open(md).read() if os.path.exists(md) else ""
if kept_from in written:
    print("\n" + written[written.index(kept_from) :].rstrip())
