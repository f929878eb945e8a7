"""The `burst` command (also `python -m burst`): bench, check, plan, train, generate.

Each verb is one module here with `add_parser(sub)` (its arguments), `validate(args)` (everything
that can be checked before a process starts, with the library's own checks) and `run(args)`.
Exit status: 0 done, 1 a failure while running (one line; the traceback with --debug or
BURST_DEBUG=1), 2 a bad argument (one line `burst VERB: error: --option: ...`, nothing started).
"""

from __future__ import annotations

import os
import re
import sys

from . import bench, check, generate, plan, train
from .common import BadOption, Parser, UsageError, blame, check_environment, debug_wanted, is_reporting_rank

VERBS = {"bench": bench, "check": check, "plan": plan, "train": train, "generate": generate}


def build_parser() -> Parser:
    from .. import __version__

    parser = Parser(prog="burst", description="Exact attention over long sequences split across processes.")
    parser.add_argument("--version", action="version", version=f"burst {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="VERB", parser_class=Parser, title="verbs (burst VERB --help for each)"
    )
    for module in VERBS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `burst ARGV`; returns the exit status (a bad argument raises UsageError, a SystemExit(2))."""
    parser = build_parser()
    try:
        if not (sys.argv[1:] if argv is None else argv):
            raise UsageError(f"burst: error: VERB: missing (one of {', '.join(VERBS)}; see burst --help)")
        args, unknown = parser.parse_known_args(_glued_pairs(sys.argv[1:] if argv is None else argv))
        if unknown:
            raise UsageError(
                f"burst {args.command}: error: {unknown[0]}: unknown option (see burst {args.command} --help)"
            )
        verb = VERBS[args.command]
        try:
            with blame("environment"):
                check_environment()
            verb.validate(args)
        except BadOption as bad:
            raise UsageError(f"burst {args.command}: error: {bad.option}: {bad.problem}") from None
    except UsageError as usage:
        if is_reporting_rank():  # under torchrun every rank refuses alike; one says so
            print(usage.line, file=sys.stderr, flush=True)
        raise
    return _run(verb, args)


def _glued_pairs(argv: list[str]) -> list[str]:
    """`--window -1,0` as `--window=-1,0`: argparse reads a value that starts with '-' and is not one
    number as an option of its own ("expected one argument"), though -1 is the documented "unbounded"."""
    out = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-\d+(,-?\d+)+", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _run(verb, args) -> int:
    """The verb's run; a failure is one line (the failing rank's, in a world) and status 1."""
    from ..launch import WorldError, one_line

    try:
        return verb.run(args)
    except KeyboardInterrupt:
        print(f"burst {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `burst plan | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except WorldError as err:
        if debug_wanted(args):
            print(err.details, file=sys.stderr, end="")
        print(
            f"burst {args.command}: error: rank {err.rank}: {err.summary}"
            + ("" if debug_wanted(args) else " (--debug for the traceback)"),
            file=sys.stderr,
            flush=True,
        )
        return 1
    except Exception as err:  # noqa: BLE001 - a failure in this process (or this torchrun rank)
        if debug_wanted(args):
            raise
        print(f"burst {args.command}: error: {one_line(err)} (--debug for the traceback)", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
