"""`burst plan`: each strategy's modelled time, traffic and memory on a described cluster (no world):
attention alone (--heads, --head-dim), or the whole model's step (--model, or --hidden ...). Its options
and their checks are plan_options.py's."""

from __future__ import annotations

from .common import publish
from .plan_options import add_parser, model_of, validate  # noqa: F401 (add_parser, validate: the verb's names)


def run(args) -> int:
    from dataclasses import replace

    from ..plan import Cluster, Training, Workload, plan, profile

    prof = profile(args.profile)
    if args.gpu_mem_gib:
        prof = replace(prof, memory_bytes=args.gpu_mem_gib * 2**30)
    cluster = Cluster(
        gpus=args.gpus,
        gpus_per_node=min(args.gpus, args.gpus_per_node),
        profile=prof,
        inter_bw=args.inter_node_gbps * 1e9 if args.inter_node_gbps else None,
        intra_bw=args.intra_node_gbps * 1e9 if args.intra_node_gbps else None,
    )
    if args.longest:
        return _longest(args, cluster)
    if args.model is not None or args.hidden is not None:
        cfg = model_of(args)
        args.heads, args.kv_heads, args.head_dim, args.layers = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.layers
    if args.model is not None and not args.attention_only or args.hidden is not None:
        workload = Training(
            cfg,
            args.seq_len,
            batch=args.batch,
            dp=args.dp,
            mode=args.mode,
            checkpointing=args.checkpointing,
            fused_loss=not args.unfused_loss,
            fsdp=not args.no_fsdp,
            offload_optimizer=args.offload_optimizer,
            causal=args.causal,
            layout=args.layout,
            dtype_bytes=args.dtype_bytes,
            backward_overlap=not args.no_backward_overlap,
            host_memory_bytes=args.host_mem_gib * 2**30 if args.host_mem_gib else None,
        )
    else:
        workload = Workload(
            seq_len=args.seq_len,
            heads=args.heads,
            head_dim=args.head_dim,
            kv_heads=args.kv_heads,
            batch=args.batch,
            layers=args.layers or 1,
            causal=args.causal,
            dtype_bytes=args.dtype_bytes,
            layout=args.layout,
            forward_only=args.mode == "prefill",
            gathered=args.gathered[0],
            gathered_with_gradient=args.gathered[1],
            window=args.window,
            windowed_share=args.windowed_share,
            entries=args.entries,
            indexer_macs=args.indexer_macs,
            latent=args.latent,
        )
    rows = [e.row() for e in plan(cluster, workload)]
    publish(args, rows, table(args, cluster, rows))
    return 0


def _longest(args, cluster) -> int:
    from ..plan.lengths import option_rows

    host = args.host_mem_gib * 2**30 if args.host_mem_gib else None
    rows = option_rows(model_of(args), cluster, host_memory_bytes=host, dtype_bytes=args.dtype_bytes)
    lines = [
        f"{args.gpus} x {args.profile}, whole model {args.model}, one sequence per step, modelled (predictions, "
        f"not measurements; each run also takes --nproc 1 --dtype bfloat16); "
        f"host memory {'%g GiB' % args.host_mem_gib if host else 'not limited'}; MFU counts attention as "
        "torchtitan does (the whole square, also when causal), so it can pass 100% where attention dominates",
        "| memory option | longest seq | step (s) | optimizer (s) | tokens/s/device | MFU | GPU GiB | host GiB "
        "| burst train flags |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["longest"]:
            lines.append(f"| {r['option']} | does not fit | | | | | | | {r['flags']} |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.0%}"
        limit = " (the model's limit)" if r["at_model_limit"] else ""
        lines.append(
            f"| {r['option']} | {r['longest']}{limit} | "
            f"{r['step_s']:.3g} | {r['optimizer_s']:.3g} | "
            f"{r['tokens_per_s_per_device']:.4g} | {mfu} | {r['mem_bytes'] / 2**30:.1f} | "
            f"{r['host_mem_bytes'] / 2**30:.1f} | {r['flags']} |"
        )
    publish(args, rows, "\n".join(lines))
    return 0


def table(args, cluster, rows) -> str:
    scope = rows[0]["scope"] if rows else "attention only"
    passes = "a prefill (forward)" if args.mode == "prefill" else "a training step (forward + backward)"
    checkpointing = f", checkpointing {args.checkpointing}" if args.mode == "train" else ""
    what = (
        f"whole model{' ' + args.model if args.model else ''}, {passes}{checkpointing}"
        + (f", dp {args.dp}" if args.dp > 1 else "")
        if scope == "whole model"
        else f"attention only, {passes}"
    )
    lines = [
        f"{args.gpus} x {args.profile} ({cluster.nodes} node(s) of {cluster.gpus_per_node}), {args.seq_len} tokens, "
        f"{args.heads} heads ({args.kv_heads or args.heads} kv) x {args.head_dim}, {args.layers or 1} layer(s), "
        f"{'causal' if args.causal else 'full'}, layout {args.layout}; {what}, modelled" + _gathered_note(args),
        "| rank | strategy | fits | step (s) | tokens/s/device | compute (s) | comm hidden | memory/device (GiB) "
        "| inter-node GB/device | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['strategy']} | {'yes' if r['fits'] else 'no'} | {r['step_s']:.3g} | "
            f"{r['tokens_per_s_per_device'] or 0:.4g} | "
            f"{r['compute_s']:.3g} | {r['overlap']:.0%} | {r['mem_bytes_per_device'] / 2**30:.2f} | "
            f"{r['inter_node_bytes_per_device'] / 1e9:.3g} | {r['note']} |"
        )
    return "\n".join(lines)


def _gathered_note(args) -> str:
    plain, with_gradient = args.gathered
    notes = []
    if args.window is not None:
        share = args.windowed_share
        notes.append(f"a {args.window}-token sliding window" + (f" on {share:.0%} of the layers" if share < 1 else ""))
    if args.entries:
        notes.append(f"each query also attends {args.entries:.4g} compressed entries on average")
    if plain or with_gradient:
        notes.append(
            f"sparse attention gathers {plain:.4g} numbers per token and layer (indexer keys) and "
            f"{with_gradient:.4g} with gradients (compressed entries) to every rank"
        )
    return "".join(f"; {n}" for n in notes)
