"""`burst plan`: each strategy's modelled time, traffic and memory on a described cluster (no world)."""

from __future__ import annotations

from .common import (BadOption, add_common, any_case, blame, check_writable_file, positive_float, positive_int,
                     write_json)

LAYOUTS = ("contiguous", "zigzag", "striped")


def add_parser(sub) -> None:
    from ..plan import PROFILES

    p = sub.add_parser("plan", help="estimate each strategy's time, traffic and memory on a described cluster",
                       description="Model forward + backward of attention for every strategy on a described "
                                   "cluster; strategies that fit come first, fastest first.")
    p.add_argument("--gpus", type=positive_int, required=True, help="devices in the cluster")
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="devices per node (the whole cluster when larger than --gpus)")
    p.add_argument("--profile", type=any_case(sorted(PROFILES)), default="H100",
                   help=f"hardware profile, any case: {', '.join(sorted(PROFILES))} ('local' = this machine, "
                        "calibrated by `burst bench --calibrate`)")
    p.add_argument("--seq-len", type=positive_int, required=True, help="global sequence length (tokens)")
    p.add_argument("--heads", type=positive_int, required=True, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=positive_int, required=True, help="dimension of each head")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step")
    p.add_argument("--layers", type=positive_int, default=1, help="attention layers (time and memory scale by it)")
    p.add_argument("--causal", action="store_true", help="causal mask (default: full attention)")
    p.add_argument("--layout", type=any_case(LAYOUTS), default="zigzag", help="how the sequence is split: "
                   + ", ".join(LAYOUTS))
    p.add_argument("--dtype-bytes", type=int, choices=(1, 2, 4, 8), default=None,
                   help="bytes per element of q, k, v; default: the profile's (2 on GPUs)")
    p.add_argument("--inter-node-gbps", type=positive_float, default=None,
                   help="inter-node GB/s per device per direction; default: the profile's")
    p.add_argument("--intra-node-gbps", type=positive_float, default=None,
                   help="intra-node GB/s per device per direction; default: the profile's")
    add_common(p, world=False)


def validate(args) -> None:
    per_node = min(args.gpus, args.gpus_per_node)
    if args.gpus % per_node:
        raise BadOption("--gpus", f"{args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node} "
                                  "(whole nodes only)")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise BadOption("--kv-heads", f"{args.kv_heads} does not divide --heads {args.heads} (use a divisor)")
    with blame("--profile"):
        from ..plan import profile

        profile(args.profile)  # `local` reads a saved calibration
    check_writable_file("--json", args.json)


def run(args) -> int:
    from ..plan import Cluster, Workload, plan, profile

    cluster = Cluster(gpus=args.gpus, gpus_per_node=min(args.gpus, args.gpus_per_node), profile=profile(args.profile),
                      inter_bw=args.inter_node_gbps * 1e9 if args.inter_node_gbps else None,
                      intra_bw=args.intra_node_gbps * 1e9 if args.intra_node_gbps else None)
    workload = Workload(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
                        batch=args.batch, layers=args.layers, causal=args.causal, dtype_bytes=args.dtype_bytes,
                        layout=args.layout)
    rows = [e.row() for e in plan(cluster, workload)]
    if args.json:
        write_json(args.json, rows)
    if args.json != "-":
        print(table(args, cluster, rows))
    return 0


def table(args, cluster, rows) -> str:
    lines = [
        f"{args.gpus} x {args.profile} ({cluster.nodes} node(s) of {cluster.gpus_per_node}), {args.seq_len} tokens, "
        f"{args.heads} heads ({args.kv_heads or args.heads} kv) x {args.head_dim}, {args.layers} layer(s), "
        f"{'causal' if args.causal else 'full'}, layout {args.layout}; forward + backward of attention, modelled",
        "| rank | strategy | fits | wall (s) | compute (s) | comm hidden | memory/device (GiB) | inter-node GB/device "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['strategy']} | {'yes' if r['fits'] else 'no'} | {r['wall_s']:.3g} | "
                     f"{r['compute_s']:.3g} | {r['overlap']:.0%} | {r['mem_bytes_per_device'] / 2**30:.2f} | "
                     f"{r['inter_node_bytes_per_device'] / 1e9:.3g} | {r['note']} |")
    return "\n".join(lines)
