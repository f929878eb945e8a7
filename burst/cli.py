"""The `burst` command (also `python -m burst`). Subcommands: bench, check, plan, train, generate."""

from __future__ import annotations

import argparse
import os
import sys

from .bench import BenchConfig, format_table, run_bench, write_json


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="time strategies on a local world against single-process SDPA")
    d = BenchConfig()
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="global sequence length (tokens)")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA); default = heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default=d.dtype)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default=d.layout)
    p.add_argument("--nproc", type=int, default=d.nproc, help="local processes to spawn (ignored under torchrun)")
    p.add_argument("--threads", type=int, default=None, help="threads per rank; default cores // nproc")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed passes after one warm-up (best is kept); 0 = one cold pass, no warm-up")
    p.add_argument("--strategies", default=",".join(d.strategies), help="comma-separated")
    p.add_argument("--window", default=None, help="sliding window LEFT,RIGHT (-1 = unbounded)")
    p.add_argument("--documents", type=int, default=0, help="pack this many documents of uneven lengths")
    p.add_argument("--block-sparse", default=None, help="BLOCK,DENSITY: random block-sparse layout (diagonal kept)")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process SDPA yardstick")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="run on a burst.Topology of this many ranks per node (strategy 'burst:flat' keeps the flat ring)")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="EMULATE an inter-node link of this many GB/s (delays each transfer by bytes / bandwidth)")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="EMULATE an intra-node link of this many GB/s")
    p.add_argument("--cqs-table2", default=None, metavar="W,W,...",
                   help="simulate CQS-Attention's workers one after another (paper Table 2): SLR, straggler time, memory")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's attention FLOP/s and link bandwidth for `burst plan --profile local`")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="run a sweep (calibration, time vs length, memory vs world) and write a Markdown report and plots")
    p.add_argument("--report-seq-lens", default="2048,4096,8192", help="sequence lengths of the --report sweep")
    p.add_argument("--report-worlds", default="1,2,4", help="world sizes of the --report memory sweep")


def _run_calibrate_or_report(args) -> int:
    if args.calibrate:
        from .bench.calibrate import CALIBRATION_FILE, calibrate

        result = calibrate(threads=args.threads or 1)
        print(f"attention {result['flops'] / 1e9:.1f} GFLOP/s per rank, link {result['bandwidth'] / 1e9:.2f} GB/s, "
              f"latency {result['latency'] * 1e6:.0f} us; saved to {CALIBRATION_FILE}")
        return 0
    from .bench.report import run_report

    results = run_report(args.report, seq_lens=tuple(int(x) for x in args.report_seq_lens.split(",")),
                         strategies=tuple(args.strategies.split(",")),
                         worlds=tuple(int(x) for x in args.report_worlds.split(",")), nproc=args.nproc,
                         causal=args.causal, layout=args.layout, heads=args.heads, head_dim=args.head_dim,
                         repeats=args.repeats)
    print(f"wrote {args.report}/report.md ({len(results['timing'])} timed points)")
    return 0


def _run_bench(args) -> int:
    if args.cqs_table2:
        from .bench.cqs_sim import table2

        torch_threads = args.threads or 1
        import torch

        torch.set_num_threads(torch_threads)
        print(f"CQS-Attention simulated on one process ({torch_threads} thread(s)), forward, "
              f"{args.heads} heads of {args.head_dim}, {'causal' if args.causal else 'full'}:\n")
        print(table2(workers=tuple(int(w) for w in args.cqs_table2.split(",")), seq_lens=(args.seq_len,),
                     heads=args.heads, head_dim=args.head_dim, causal=args.causal))
        return 0
    if args.calibrate or args.report:
        return _run_calibrate_or_report(args)
    cfg = BenchConfig(
        seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        batch=args.batch, dtype=args.dtype, causal=args.causal, layout=args.layout, nproc=args.nproc,
        threads=args.threads, repeats=args.repeats, strategies=args.strategies.split(","),
        baseline=not args.no_baseline, documents=args.documents,
        block_sparse=(int(args.block_sparse.split(",")[0]), float(args.block_sparse.split(",")[1]))
        if args.block_sparse else None,
        window=tuple(int(x) for x in args.window.split(",")) if args.window else None,
        ranks_per_node=args.ranks_per_node, inter_node_gbps=args.inter_node_gbps, intra_node_gbps=args.intra_node_gbps,
    )
    result = run_bench(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 reports
        print(format_table(result))
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}")
    return 0


def _check_parser(sub) -> None:
    p = sub.add_parser("check", help="verify every strategy against single-device float64 attention on this world")
    p.add_argument("--strategies", default=None, help="comma-separated; default: every strategy")
    p.add_argument("--layouts", default=None, help="comma-separated; default: contiguous,zigzag,striped")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--seq-len", type=int, default=1024, help="global sequence length (tokens)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA); default = heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16,float16,float64")
    p.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")


def _check_on_rank(rank, world, kwargs):
    from .parity import check

    return check(**kwargs)


def _run_check(args) -> int:
    import json

    from .launch import run_world

    split = lambda text: tuple(text.split(",")) if text else None  # noqa: E731
    kwargs = dict(strategies=split(args.strategies), layouts=split(args.layouts),
                  causal={"both": (False, True), "yes": True, "no": False}[args.causal], seq_len=args.seq_len,
                  heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch,
                  dtype=split(args.dtype))
    report = run_world(_check_on_rank, kwargs, nproc=args.nproc)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report.table())
        for row in report.failures:
            print(f"FAIL: {row.strategy} layout={row.layout} causal={row.causal} {row.dtype}: {row.errors} "
                  f"over the bound {row.bound:g}")
        print("all cases within their bounds" if report.ok else f"{len(report.failures)} case(s) over their bound")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


def _plan_parser(sub) -> None:
    from .plan import PROFILES

    p = sub.add_parser("plan", help="estimate each strategy's time, traffic and memory on a described cluster")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--profile", choices=sorted(PROFILES), default="H100")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default="zigzag")
    p.add_argument("--dtype-bytes", type=int, default=None, help="default: the profile's (2 on GPUs)")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="inter-node GB/s per device (default: profile)")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="intra-node GB/s per device (default: profile)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")


def _run_plan(args) -> int:
    import json

    from .plan import Cluster, Workload, plan, profile

    if args.gpus < 1 or args.gpus_per_node < 1 or args.gpus % min(args.gpus, args.gpus_per_node):
        raise SystemExit(f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({args.gpus_per_node})")
    cluster = Cluster(gpus=args.gpus, gpus_per_node=min(args.gpus, args.gpus_per_node), profile=profile(args.profile),
                      inter_bw=args.inter_node_gbps * 1e9 if args.inter_node_gbps else None,
                      intra_bw=args.intra_node_gbps * 1e9 if args.intra_node_gbps else None)
    workload = Workload(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, kv_heads=args.kv_heads,
                        batch=args.batch, layers=args.layers, causal=args.causal, dtype_bytes=args.dtype_bytes,
                        layout=args.layout)
    rows = [e.row() for e in plan(cluster, workload)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.gpus} x {args.profile} ({cluster.nodes} node(s) of {cluster.gpus_per_node}), {args.seq_len} tokens, "
          f"{args.heads} heads ({args.kv_heads or args.heads} kv) x {args.head_dim}, {args.layers} layer(s), "
          f"{'causal' if args.causal else 'full'}; forward + backward of attention, modelled")
    print("| rank | strategy | fits | wall (s) | compute (s) | comm hidden | memory/device (GiB) | inter-node GB/device | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['strategy']} | {'yes' if r['fits'] else 'no'} | {r['wall_s']:.3g} | {r['compute_s']:.3g} | "
              f"{r['overlap']:.0%} | {r['mem_bytes_per_device'] / 2**30:.2f} | "
              f"{r['inter_node_bytes_per_device'] / 1e9:.3g} | {r['note']} |")
    return 0


def _train_parser(sub) -> None:
    from .engine.model import PRESETS
    from .engine.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train the LLaMA-style model sequence-parallel (a local world or torchrun's)")
    p.add_argument("--model", choices=sorted(PRESETS), default=d.model)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="global tokens per sequence")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=d.data, help="'synthetic', a .bin token file (uint16; .u32.bin: uint32) or a text file")
    p.add_argument("--strategy", default=d.strategy)
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default=d.layout)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--peak-flops", type=float, default=d.peak_flops, help="per-device peak FLOP/s for MFU")
    p.add_argument("--metrics", default=None, help="write one JSON object per step to this file")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel replicas (sequence-parallel ranks = world / dp)")
    p.add_argument("--fsdp", choices=["none", "dp", "mesh"], default=d.fsdp,
                   help="FSDP2 parameter sharding: over the dp dimension or every rank of the world")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of parameters and optimizer state")
    p.add_argument("--checkpointing", choices=["none", "full", "remat", "selective"], default=d.checkpointing,
                   help="activation checkpointing (full: per layer; remat: DistFlashAttn's, at the attention "
                        "output; selective: BurstEngine's sequence-level)")
    p.add_argument("--checkpoint-split", type=float, default=d.checkpoint_split,
                   help="selective: the fraction of the sequence whose attention is recomputed")
    p.add_argument("--ffn-chunk", type=int, default=d.ffn_chunk, help="blockwise feedforward: tokens per chunk (0 = off)")
    p.add_argument("--no-fused-loss", dest="fused_loss", action="store_false",
                   help="build the logits (the baseline of the fused LM head + loss)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="a line per step instead of a bar")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints are written and read (DCP)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="write a checkpoint every K steps")
    p.add_argument("--resume-step", type=int, default=None, help="resume from the checkpoint written after K steps")


def _train_on_rank(rank, world, cfg_dict):
    from .engine.train import TrainConfig, train

    return train(rank, world, TrainConfig(**cfg_dict))


def _run_train(args) -> int:
    from dataclasses import asdict, fields

    from .engine.train import TrainConfig
    from .launch import run_world

    keys = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in keys})
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        cfg.check(world)  # before any process starts
    except ValueError as err:
        raise SystemExit(f"burst train: {err}")
    run_world(_train_on_rank, asdict(cfg), nproc=args.nproc)
    return 0


def _generate_parser(sub) -> None:
    from .engine.model import PRESETS

    p = sub.add_parser("generate", help="generate on a sharded KV cache (prefill through burst, exact decode)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None, help="default: the checkpoint's, else tiny")
    p.add_argument("--checkpoint-dir", default=None, help="load the weights `burst train` wrote there")
    p.add_argument("--checkpoint-step", type=int, default=None, help="which step's checkpoint (default: the latest)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens of the random prompt (seeded)")
    p.add_argument("--prompt-file", default=None, help="a text file as the prompt (byte-level tokens)")
    p.add_argument("--batch", type=int, default=1, help="random prompts of lengths prompt-len, prompt-len - 1, ...")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun); 1 = reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="burst")
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default="contiguous")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--json", default=None)


def _generate_on_rank(rank, world, kwargs):
    import torch

    from .engine.model import PRESETS, Transformer
    from .inference.generate import generate

    torch.manual_seed(kwargs["seed"])  # the same (random) weights on every rank unless a checkpoint is loaded
    model = Transformer(PRESETS[kwargs["model"]]).eval()
    if kwargs["checkpoint_dir"]:
        from .engine.resume import load_model_weights

        load_model_weights(kwargs["checkpoint_dir"], kwargs["checkpoint_step"], model)
    result = generate(model, kwargs["prompts"], kwargs["new_tokens"], strategy=kwargs["strategy"],
                      layout=kwargs["layout"], temperature=kwargs["temperature"], top_p=kwargs["top_p"],
                      seed=kwargs["seed"])
    return result.__dict__


def _run_generate(args) -> int:
    import json

    import torch

    from .launch import run_world

    from .engine.model import PRESETS
    from .inference.generate import check_request

    model_name = args.model or "tiny"
    if args.checkpoint_dir:
        from .engine.resume import checkpoint_model_name, latest_step

        try:
            step = args.checkpoint_step if args.checkpoint_step is not None else latest_step(args.checkpoint_dir)
            trained = checkpoint_model_name(args.checkpoint_dir, step)
        except (OSError, ValueError) as err:
            raise SystemExit(f"burst generate: --checkpoint-dir {args.checkpoint_dir!r}: {err}")
        if args.model and args.model != trained:
            raise SystemExit(f"burst generate: the checkpoint holds model {trained!r}, not --model {args.model!r}")
        model_name, args.checkpoint_step = trained, step
    if args.prompt_file:
        with open(args.prompt_file, "rb") as f:
            prompts = [list(f.read())]
    else:
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, 256, (max(1, args.prompt_len - i),), generator=g).tolist() for i in range(args.batch)]
    try:
        check_request(prompts, args.new_tokens, PRESETS[model_name].max_seq_len)
    except ValueError as err:
        raise SystemExit(f"burst generate: {err}")
    kwargs = dict(model=model_name, checkpoint_dir=args.checkpoint_dir, checkpoint_step=args.checkpoint_step,
                  prompts=prompts, new_tokens=args.new_tokens, strategy=args.strategy,
                  layout=args.layout, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result = run_world(_generate_on_rank, kwargs, nproc=args.nproc)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"prefill {result['prefill_s']:.3f} s (time to first token), decode {result['decode_s_per_token'] * 1e3:.1f} "
              f"ms/token ({1 / max(result['decode_s_per_token'], 1e-9):.1f} tokens/s), KV cache "
              f"{result['cache_bytes_per_rank'] / 2**20:.2f} MiB per rank")
        for row in result["tokens"]:
            print(" ".join(map(str, row)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="burst", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _check_parser(sub)
    _plan_parser(sub)
    _train_parser(sub)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _run_bench(args)
    if args.command == "check":
        return _run_check(args)
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "train":
        return _run_train(args)
    if args.command == "generate":
        return _run_generate(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
