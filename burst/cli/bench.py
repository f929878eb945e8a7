"""`burst bench`: time strategies on a local world against single-process SDPA (also --calibrate,
--report DIR and --cqs-table2)."""

from __future__ import annotations

import argparse
import sys

from ..devices import DTYPES, dtype_listing
from ..layout import DOCUMENT_LAYOUTS
from ..layout import LAYOUTS as WHOLE_SEQUENCE_LAYOUTS
from .common import (
    BadOption,
    add_common,
    add_device_options,
    any_case,
    blame,
    check_writable_dir,
    check_writable_file,
    dtype_name,
    int_list,
    int_pair,
    nonnegative_int,
    positive_float,
    positive_int,
    progress,
    publish,
    refuse_repeats,
    resolve_checked_device,
    world_size,
    write_json,
)

LAYOUTS = WHOLE_SEQUENCE_LAYOUTS + DOCUMENT_LAYOUTS
DEFAULT_REPORT_SEQ_LENS = (2048, 4096, 8192)
DEFAULT_REPORT_WORLDS = (1, 2, 4)


def strategy_list(text: str) -> tuple[str, ...]:
    """Comma-separated burst.attention strategies; "burst:flat" / "ring:flat" keep the flat ring on a
    multi-node topology (strategies.split_variant)."""
    from ..api import STRATEGY_NAMES
    from ..strategies import split_variant

    names = []
    for item in (p.strip().lower() for p in text.split(",")):
        try:
            base, _ = split_variant(item)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if base not in STRATEGY_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown strategy {item!r} (choose from {', '.join(STRATEGY_NAMES)}; "
                "burst:flat and ring:flat keep the flat ring)"
            )
        names.append(item)
    refuse_repeats(names)
    return tuple(names)


def block_sparse(text: str) -> tuple[int, float]:
    """BLOCK,DENSITY: a positive block size and a density in (0, 1]."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected BLOCK,DENSITY (e.g. 128,0.3), got {text!r}")
    size, density = positive_int(parts[0]), positive_float(parts[1])
    if density > 1:
        raise argparse.ArgumentTypeError(f"the density must lie in (0, 1], got {parts[1]}")
    return size, density


def add_parser(sub) -> None:
    from ..bench import BenchConfig

    d = BenchConfig()
    p = sub.add_parser(
        "bench",
        help="time strategies on a local world against single-process SDPA",
        description="Time each strategy's forward and backward on a fresh local world (or "
        "torchrun's), against PyTorch SDPA in one process, and check its rows against "
        "float64 attention.",
    )
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="global sequence length (tokens)")
    p.add_argument("--heads", type=positive_int, default=d.heads, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=positive_int, default=d.head_dim, help="dimension of each head")
    p.add_argument("--batch", type=positive_int, default=d.batch, help="sequences")
    p.add_argument(
        "--dtype", type=dtype_name(tuple(DTYPES)), default=d.dtype, help="dtype of q, k, v: " + dtype_listing(DTYPES)
    )
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument(
        "--layout",
        type=any_case(LAYOUTS),
        default=d.layout,
        help="how the sequence is split over the ranks: "
        + ", ".join(LAYOUTS)
        + " (doc_*: each packed document cut on its own; needs --documents)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="threads per rank; default: cores // nproc")
    p.add_argument(
        "--repeats",
        type=nonnegative_int,
        default=d.repeats,
        help="timed passes after one warm-up (the best is kept); 0 = one cold pass, no warm-up",
    )
    p.add_argument(
        "--strategies",
        type=strategy_list,
        default=tuple(d.strategies),
        help="comma-separated strategies ('burst:flat' = burst on the flat ring of a multi-node topology)",
    )
    p.add_argument(
        "--window", type=int_pair, default=None, metavar="LEFT,RIGHT", help="sliding window in tokens (-1 = unbounded)"
    )
    p.add_argument(
        "--documents",
        type=nonnegative_int,
        default=0,
        help="pack this many documents of uneven (seeded) lengths; 0 = one sequence",
    )
    p.add_argument(
        "--block-sparse",
        type=block_sparse,
        default=None,
        metavar="BLOCK,DENSITY",
        help="a seeded random block-sparse layout of this block size and density (diagonal kept)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process SDPA yardstick")
    p.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        help="run on a burst.Topology of this many ranks per node (a divisor of the world)",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=positive_float,
        default=None,
        help="EMULATE an inter-node link of this many GB/s (delays each transfer by bytes / bandwidth)",
    )
    p.add_argument(
        "--intra-node-gbps", type=positive_float, default=None, help="EMULATE an intra-node link of this many GB/s"
    )
    p.add_argument(
        "--cqs-table2",
        type=int_list,
        default=None,
        metavar="W,W,...",
        help="simulate CQS-Attention's workers one after another (paper Table 2): SLR, straggler time, memory",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's attention FLOP/s and link bandwidth for `burst plan --profile local`",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="run a sweep (calibration, time vs length, memory vs world) and write a Markdown report and plots to DIR",
    )
    p.add_argument(
        "--report-seq-lens",
        type=int_list,
        default=None,
        help=f"sequence lengths of the --report sweep (default {','.join(map(str, DEFAULT_REPORT_SEQ_LENS))})",
    )
    p.add_argument(
        "--report-worlds",
        type=int_list,
        default=None,
        help=f"world sizes of the --report memory sweep (default {','.join(map(str, DEFAULT_REPORT_WORLDS))})",
    )
    add_device_options(p, dtypes=None)
    add_common(p)


def config(args):
    from ..bench import BenchConfig

    return BenchConfig(
        seq_len=args.seq_len,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        batch=args.batch,
        dtype=args.dtype,
        causal=args.causal,
        layout=args.layout,
        nproc=world_size(args),
        threads=args.threads,
        repeats=args.repeats,
        strategies=list(args.strategies),
        baseline=not args.no_baseline,
        documents=args.documents,
        block_sparse=args.block_sparse,
        window=args.window,
        ranks_per_node=args.ranks_per_node,
        inter_node_gbps=args.inter_node_gbps,
        intra_node_gbps=args.intra_node_gbps,
        device=args.device,
    )


def validate(args) -> None:
    check_writable_file("--json", args.json)
    args.device = resolve_checked_device(args)
    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise BadOption("--kv-heads", f"{args.kv_heads} does not divide --heads {args.heads} (use a divisor)")
    if args.report is None:
        for option in ("report_seq_lens", "report_worlds"):
            if getattr(args, option) is not None:
                raise BadOption(f"--{option.replace('_', '-')}", "sets the --report sweep: give --report DIR too")
    args.report_seq_lens = args.report_seq_lens or DEFAULT_REPORT_SEQ_LENS
    args.report_worlds = args.report_worlds or DEFAULT_REPORT_WORLDS
    if args.cqs_table2:
        _check_cqs_table2(args)
    if args.inter_node_gbps is not None and args.ranks_per_node is None:
        raise BadOption("--inter-node-gbps", "needs --ranks-per-node (without nodes there is no inter-node link)")
    if args.calibrate or args.cqs_table2:
        return
    if args.report:
        check_writable_dir("--report", args.report)
        for n in args.report_seq_lens:
            _check_strategies(args, n, "--report-seq-lens")
        _check_report_worlds(args)
        return
    if args.documents > args.seq_len:
        raise BadOption("--documents", f"{args.documents} documents do not fit in {args.seq_len} tokens")
    if args.layout in DOCUMENT_LAYOUTS:
        parts = world_size(args) * (2 if args.layout == "doc_zigzag" else 1)
        if args.documents < 1:
            raise BadOption("--layout", f"{args.layout} cuts packed documents: give --documents N")
        if args.documents > args.seq_len // parts:
            raise BadOption(
                "--documents",
                f"{args.documents} documents of multiples of {parts} tokens do not fit in {args.seq_len} tokens",
            )
    if args.ranks_per_node is not None:
        from ..comm.topology import Topology

        with blame("--ranks-per-node"):
            Topology(args.ranks_per_node).check(world_size(args))
    _check_strategies(args, args.seq_len, "--seq-len")


def _check_cqs_table2(args) -> None:
    """--cqs-table2 simulates CQS's workers in this process: a world or other strategies would not be read."""
    from ..bench import BenchConfig

    d = BenchConfig()
    if len(set(args.cqs_table2)) != len(args.cqs_table2):
        raise BadOption("--cqs-table2", f"{','.join(map(str, args.cqs_table2))} names a worker count twice")
    if tuple(args.strategies) != tuple(d.strategies):
        raise BadOption("--strategies", "--cqs-table2 simulates CQS-Attention alone: leave --strategies out")
    if args.nproc != d.nproc:
        raise BadOption("--nproc", "--cqs-table2 simulates its workers in one process: leave --nproc out")


def _check_strategies(args, seq_len: int, length_option: str) -> None:
    """Each strategy takes this call on this world (burst.attention's own checks), masks included."""
    from dataclasses import replace

    from ..plan.takes import check_call, check_split
    from ..strategies import split_variant

    world = world_size(args)
    with blame(length_option):
        check_split(seq_len, world, args.layout)
    cfg = replace(config(args), seq_len=seq_len)
    masks = cfg.mask_kwargs()
    for strategy in args.strategies:
        with blame("--strategies"):
            check_call(
                world,
                seq_len,
                args.heads,
                args.kv_heads,
                args.head_dim,
                strategy=split_variant(strategy)[0],
                layout=args.layout,
                batch=args.batch,
                dtype=args.dtype,
                **masks,
            )


def _check_report_worlds(args) -> None:
    """The memory sweep runs the middle length on each world (contiguous where the layout does not
    split it: bench/report.py)."""
    middle = args.report_seq_lens[len(args.report_seq_lens) // 2]
    for world in args.report_worlds:
        if middle % world:
            raise BadOption(
                "--report-worlds",
                f"{world} ranks do not split the memory sweep's {middle} tokens "
                "(the middle of --report-seq-lens; use world sizes that divide it)",
            )


def run(args) -> int:
    if args.cqs_table2:
        return _cqs_table2(args)
    if args.calibrate:
        return _calibrate(args)
    if args.report:
        return _report(args)
    from ..bench import format_table, run_bench
    from ..kernels.reference import BOUNDS

    cfg = config(args)
    step = progress(len(cfg.strategies) + bool(cfg.baseline), "burst bench", "world")
    result = run_bench(cfg, on_done=step)
    step.close()
    publish(args, result, format_table(result))
    wrong = [r["strategy"] for r in result["strategies"] if not r["error_ok"]]
    if wrong:  # a timing of wrong numbers is not a result: say so, as burst check does
        print(
            f"burst bench: error: {', '.join(wrong)}: max err over {cfg.dtype}'s bound {BOUNDS[cfg.dtype]:.0e} "
            "against float64 attention (FAIL in the table)",
            file=sys.stderr,
        )
        return 1
    return 0


def _cqs_table2(args) -> int:
    import torch

    from ..bench.cqs_sim import table2

    torch_threads = args.threads or 1
    torch.set_num_threads(torch_threads)
    print(
        f"CQS-Attention simulated on one process ({torch_threads} thread(s)), forward, "
        f"{args.heads} heads of {args.head_dim}, {'causal' if args.causal else 'full'}:\n"
    )
    print(
        table2(
            workers=args.cqs_table2,
            seq_lens=(args.seq_len,),
            heads=args.heads,
            head_dim=args.head_dim,
            causal=args.causal,
        )
    )
    return 0


def _calibrate(args) -> int:
    from ..bench.calibrate import CALIBRATION_FILE, calibrate

    result = calibrate(threads=args.threads or 1)
    print(
        f"attention {result['flops'] / 1e9:.1f} GFLOP/s per rank, link {result['bandwidth'] / 1e9:.2f} GB/s, "
        f"latency {result['latency'] * 1e6:.0f} us; saved to {CALIBRATION_FILE}"
    )
    if args.json:
        write_json(args.json, result)
    return 0


def _report(args) -> int:
    from ..bench.report import run_report

    results = run_report(
        args.report,
        seq_lens=args.report_seq_lens,
        strategies=args.strategies,
        worlds=args.report_worlds,
        nproc=args.nproc,
        causal=args.causal,
        layout=args.layout,
        heads=args.heads,
        head_dim=args.head_dim,
        repeats=args.repeats,
    )
    print(f"wrote {args.report}/report.md ({len(results['timing'])} timed points)")
    if args.json:
        write_json(args.json, results)
    return 0
