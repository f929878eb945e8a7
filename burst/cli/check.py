"""`burst check`: every strategy against single-device float64 attention, on this world."""

from __future__ import annotations

from ..devices import DTYPES, dtype_listing
from ..layout import LAYOUTS
from .common import (
    BadOption,
    add_common,
    add_device_options,
    any_case,
    blame,
    check_writable_file,
    dtype_names,
    name_list,
    positive_int,
    progress,
    publish,
    resolve_checked_device,
    world_size,
)

CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}


def add_parser(sub) -> None:
    from ..api import STRATEGIES

    p = sub.add_parser(
        "check",
        help="verify every strategy against single-device float64 attention on this world",
        description="Run each strategy x layout x mask x dtype on random inputs and compare the "
        "output, lse and gradients with float64 attention on one device.",
    )
    p.add_argument(
        "--strategies", type=name_list(tuple(STRATEGIES)), default=tuple(STRATEGIES), help="comma-separated strategies"
    )
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=LAYOUTS, help="comma-separated layouts")
    p.add_argument("--causal", type=any_case(tuple(CAUSAL)), default="both", help="causal mask: both, yes or no")
    p.add_argument(
        "--seq-len", type=positive_int, default=1024, help="global sequence length (tokens; a multiple of 2 x ranks)"
    )
    p.add_argument("--heads", type=positive_int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=positive_int, default=64, help="dimension of each head")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences")
    p.add_argument(
        "--dtype",
        type=dtype_names(tuple(DTYPES)),
        default=("float32",),
        help="comma-separated dtypes: " + dtype_listing(DTYPES),
    )
    p.add_argument(
        "--sinks", action="store_true", help="also pass attention sinks (gpt-oss's s_aux) and compare their gradient"
    )
    add_device_options(p, dtypes=None)
    add_common(p)


def validate(args) -> None:
    """Also sets args.refused: {(strategy, layout, causal): why} for the cases that will be skipped."""
    from ..check import validate_arguments

    check_writable_file("--json", args.json)
    args.device = resolve_checked_device(args)
    world = world_size(args)
    kv_heads = args.kv_heads or args.heads
    with blame("--kv-heads"):  # burst.check's own rules, one value at a time
        validate_arguments((), (), (), 2 * world, args.heads, kv_heads, world)
    with blame("--seq-len"):
        validate_arguments((), (), (), args.seq_len, 1, 1, world)
    args.refused = _refusals(args, world, kv_heads)
    cases = len(args.strategies) * len(args.layouts) * len(CAUSAL[args.causal])
    if len(args.refused) == cases:
        reasons = sorted({why for why in args.refused.values()})
        raise BadOption("--strategies", "nothing would run: every case is refused: " + " | ".join(reasons))


def _refusals(args, world: int, kv_heads: int) -> dict:
    from ..plan.takes import check_call

    refused = {}
    for strategy in args.strategies:
        for layout in args.layouts:
            for causal in CAUSAL[args.causal]:
                try:
                    check_call(
                        world,
                        args.seq_len,
                        args.heads,
                        kv_heads,
                        args.head_dim,
                        strategy=strategy,
                        layout=layout,
                        batch=args.batch,
                        causal=causal,
                    )
                except (ValueError, TypeError, NotImplementedError) as err:
                    refused[(strategy, layout, causal)] = str(err)
    return refused


def run(args) -> int:
    from ..devices import backend_for
    from ..launch import run_world

    kwargs = dict(
        strategies=args.strategies,
        layouts=args.layouts,
        causal=CAUSAL[args.causal],
        seq_len=args.seq_len,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        batch=args.batch,
        dtypes=args.dtype,
        sinks=args.sinks,
        device=args.device,
    )
    report = run_world(_check_on_rank, kwargs, nproc=args.nproc, backend=backend_for(args.device))
    publish(args, report.as_dict(), verdict(report, args.refused))
    return 0 if report.ok else 1


def verdict(report, refused: dict) -> str:
    lines = [report.table(), ""]
    for row in report.failures:
        lines.append(
            f"FAIL: {row.strategy} layout={row.layout} causal={row.causal} {row.dtype}: {row.errors} "
            f"over the bound {row.bound:g}"
        )
    for (strategy, layout, causal), why in sorted(refused.items()):
        lines.append(f"skipped: {strategy} layout={layout} causal={causal}: {why}")
    ran = [r for r in report.rows if r.status != "skipped"]
    if not ran:
        lines.append("nothing ran: every case was skipped")
    elif report.ok:
        lines.append(f"all cases within their bounds ({len(ran)} ran)")
    else:
        lines.append(f"{len(report.failures)} of {len(ran)} case(s) over their bound")
    return "\n".join(lines)


def _check_on_rank(rank, world, kwargs):
    """burst.check one strategy, mask and dtype at a time, so rank 0 can show progress."""
    from ..check import CheckReport, check
    from ..devices import bind

    device = bind(kwargs["device"])  # the launcher bound the rank's GPU already: the same one
    cases = [
        (dtype, causal, strategy)
        for dtype in kwargs["dtypes"]
        for causal in kwargs["causal"]
        for strategy in kwargs["strategies"]
    ]
    step = progress(len(cases), "burst check", "case")
    rows, report = [], None
    for dtype, causal, strategy in cases:
        report = check(
            strategies=(strategy,),
            layouts=kwargs["layouts"],
            causal=causal,
            seq_len=kwargs["seq_len"],
            heads=kwargs["heads"],
            kv_heads=kwargs["kv_heads"],
            head_dim=kwargs["head_dim"],
            batch=kwargs["batch"],
            dtype=dtype,
            sinks=kwargs["sinks"],
            device=device,
        )
        rows += report.rows
        step(f"{strategy} causal={causal} {dtype}: {_outcome(report.rows)}")
    step.close()
    return CheckReport(rows=rows, world=report.world, shape=report.shape)


def _outcome(rows) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "FAIL", "skipped")}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n)
