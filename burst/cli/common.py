"""What every verb shares: one-line usage errors, argument types, file checks, --json, progress.

A bad value ends the command before any process starts, with exit status 2 and one line:

    burst VERB: error: --option: what is wrong (what would be right)

Argument types (positive_int, ...: arg_types.py) catch a value on its own at parse time; each verb's
`validate(args)` checks what depends on several values with the library's own checks (TrainConfig,
check_request, burst.attention's validation), turning their ValueError into that line with
`blame("--option")`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

# the argument types, where the verbs import them from
from .arg_types import (  # noqa: F401  # noqa: F401
    any_case,
    dtype_name,
    dtype_names,
    int_list,
    int_pair,
    name_list,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
    refuse_repeats,
)

DEBUG_ENV = "BURST_DEBUG"


class UsageError(SystemExit):
    """A bad argument: exit status 2; str() is the one line printed (`burst VERB: error: ...`)."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


class BadOption(Exception):
    """Raised by a verb's validation: `option` (e.g. "--lr") and what is wrong with it."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option}: {problem}")
        self.option, self.problem = option, problem


@contextlib.contextmanager
def blame(option: str):
    """Turn a library check's ValueError (or OSError) inside the block into a BadOption for `option`.

    A message that already starts with an option ("--dp: ...") keeps the option it names."""
    try:
        yield
    except (ValueError, OSError) as err:
        text = str(err)
        named, sep, rest = text.partition(": ")
        if sep and named.startswith("--") and " " not in named:
            raise BadOption(named, rest) from err
        raise BadOption(option, text) from err


class HelpFormatter(argparse.HelpFormatter):
    """Each option's sentence, then its default when it has one worth saying."""

    def _get_help_string(self, action):
        default = action.default
        if (
            not action.help
            or default is None
            or isinstance(default, bool)  # a flag: its name says it (store_false defaults to True)
            or default is argparse.SUPPRESS
            or "--help" in action.option_strings
        ):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        return f"{action.help} (default: {shown})".replace("%", "%%")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`burst VERB: error: --option: ...`, exit 2) and defaults in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        required = "the following arguments are required: "
        if message.startswith(required):  # name the first missing option first, as every other error does
            missing = message[len(required) :]
            message = f"{missing.split(', ')[0]}: required (missing: {missing})"
        raise UsageError(f"{self.prog}: error: {message.replace('argument ', '', 1)}")


def debug_wanted(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


# --- arguments several verbs take ---------------------------------------------------------------


def add_common(p: argparse.ArgumentParser, world: bool = True, default_nproc: int = 2) -> None:
    """--json PATH, --debug, and (for verbs that start a world) --nproc."""
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH ('-' or no PATH: to stdout, instead of the table)",
    )
    if world:
        p.add_argument(
            "--nproc",
            type=positive_int,
            default=default_nproc,
            help="local processes to spawn (ignored under torchrun, which gives the world)",
        )
    p.add_argument("--debug", action="store_true", help=f"on a failure print the full traceback (also {DEBUG_ENV}=1)")


def add_device_options(
    p: argparse.ArgumentParser, dtypes=("float32", "bfloat16", "float16"), default_dtype="float32"
) -> None:
    """--device and (unless dtypes is None: a verb with its own) --dtype (burst/devices.py): where each
    rank runs and in what precision. dtypes: the canonical names the verb takes (each also by its short
    name: devices.DTYPE_ALIASES); args.dtype holds the canonical one."""
    from ..devices import DEVICES, dtype_listing

    p.add_argument(
        "--device",
        type=any_case(DEVICES),
        default="auto",
        help="cpu, cuda (one GPU per rank: cuda:LOCAL_RANK, NCCL) or auto (cuda when every local rank "
        "has a GPU, else cpu)",
    )
    if dtypes is not None:
        p.add_argument(
            "--dtype", type=dtype_name(dtypes), default=default_dtype, help=f"compute dtype: {dtype_listing(dtypes)}"
        )
    from ..kernels import kernels_by_name

    kernels = ("auto", *kernels_by_name())
    p.add_argument(
        "--kernel",
        type=any_case(kernels),
        default="auto",
        help="the attention kernel: auto (the fastest kernel proven for the device and dtype) or one "
        f"of {', '.join(kernels[1:])} (an error if it cannot run here); sets BURST_KERNEL for "
        "every rank",
    )


def resolve_checked_device(args) -> str:
    """args.device resolved for this machine's ranks ("cpu" or "cuda"), with args.dtype (one name or
    several) checked on it."""
    from ..devices import DTYPES, check_dtype, local_ranks, resolve_device

    with blame("--device"):
        device = resolve_device(args.device, local_ranks(world_size(args)))
        names = (args.dtype,) if isinstance(args.dtype, str) else args.dtype
        for name in names:
            check_dtype(DTYPES[name], device)
    import torch

    from ..kernels import KERNEL_ENV, named_kernel

    chosen = args.kernel if args.kernel != "auto" else os.environ.get(KERNEL_ENV, "auto")
    if chosen != "auto":  # --kernel, else the environment's BURST_KERNEL: named as what was set
        with blame("--kernel" if args.kernel != "auto" else "environment"):
            for name in names:
                named_kernel(chosen, torch.device(device), DTYPES[name])
        os.environ[KERNEL_ENV] = chosen  # every rank inherits it (spawned ones and torchrun's alike)
    return device


def check_environment() -> None:
    """ValueError naming a BURST_* variable every rank would read and not take (the agreement's mode and
    timeout, the host channels' size, the kernel's name), before anything starts."""
    from .. import agreement
    from ..comm.shm_p2p import default_capacity_mb
    from ..kernels import KERNEL_ENV
    from ..kernels.registry import check_kernel_name

    agreement.settings_from_environment()
    default_capacity_mb()
    check_kernel_name(os.environ.get(KERNEL_ENV, "auto"))  # its name here; whether it runs there, with --device


def world_size(args) -> int:
    """The world the command will run on: torchrun's, else --nproc."""
    from ..launch import under_torchrun

    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc


def is_reporting_rank() -> bool:
    """Rank 0 of torchrun's world or of a spawned one (the launcher sets RANK), or the launching
    process: the ones that print. Every other rank stays silent (publish, progress, note)."""
    return int(os.environ.get("RANK", "0")) == 0


def publish(args, value, text: str | None = None) -> None:
    """A verb's result, on the reporting rank only: `value` as JSON to --json's path (or stdout),
    and `text` on stdout unless the JSON went there."""
    if not is_reporting_rank():
        return
    if args.json:
        write_json(args.json, value)
    if text is not None and args.json != "-":
        print(text)


# --- files -------------------------------------------------------------------------------------


def check_readable_file(option: str, path: str) -> None:
    if not os.path.exists(path):
        raise BadOption(option, f"{path!r} does not exist")
    if os.path.isdir(path):
        raise BadOption(option, f"{path!r} is a directory (expected a file)")
    if not os.access(path, os.R_OK):
        raise BadOption(option, f"{path!r} is not readable")


def check_writable_file(option: str, path: str | None) -> None:
    """A file we may create or overwrite ('-' is stdout), without creating it."""
    if path is None or path == "-":
        return
    if not path.strip():  # `--json ""` (an unset shell variable) had printed the table and written nothing
        raise BadOption(option, "an empty path: give a file, or - for standard output")
    if os.path.isdir(path):
        raise BadOption(option, f"{path!r} is a directory (expected a file path)")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise BadOption(option, f"{folder!r} is a file, not a directory")
    if not os.path.isdir(folder):
        raise BadOption(option, f"the directory {folder!r} does not exist (create it first)")
    if not _can_write_in(folder) or (os.path.exists(path) and not _can_append(path)):
        raise BadOption(option, f"{path!r} is not writable")


def check_writable_dir(option: str, path: str) -> None:
    """A directory that exists and is writable, or that we may create (its nearest existing
    ancestor is a writable directory)."""
    here = os.path.abspath(path)
    if os.path.exists(here) and not os.path.isdir(here):
        raise BadOption(option, f"{path!r} is a file (expected a directory)")
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise BadOption(option, f"{here!r} is a file, so {path!r} cannot be created")
    if not _can_write_in(here):
        raise BadOption(option, f"{here!r} is not writable")


def _can_write_in(folder: str) -> bool:
    """Whether a file can be made in `folder`, tried (os.access says yes to root everywhere, and to
    /proc or a read-only mount): a temporary file, made and removed."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".burst-probe-"):
            return True
    except OSError:
        return False


def _can_append(path: str) -> bool:
    try:
        with open(path, "a"):
            return True
    except OSError:
        return False


def write_json(path: str, value) -> None:
    """`value` as JSON to `path`, or to stdout for '-'. A file is replaced whole or not at all (a full disk had
    left an earlier run's results 0 bytes long), a symbolic link's target in its place; a device or a pipe is written
    as it is. OSError naming `path`."""
    text = json.dumps(value, indent=1) + "\n"
    if path == "-":
        print(text, end="")
        return
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            with open(path, "w") as f:
                f.write(text)
            return
        target = os.path.realpath(path)  # a symbolic link stays one: its target is what is replaced
        partial = f"{target}.partial"
        try:
            with open(partial, "w") as f:
                f.write(text)
            os.replace(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(partial)
    except OSError as err:
        raise OSError(err.errno, f"could not write {path}: {err.strerror or err}") from err


def progress(total: int, desc: str, unit: str, lines: int | None = None):
    """A step callback: a tqdm bar on a terminal, else one line per item on stderr (or about
    `lines` lines in all, for many small items); silent off the reporting rank.

    step(label) marks one item done; step.close() ends the bar."""
    if not is_reporting_rank():

        def silent(label: str) -> None:
            pass

        silent.close = lambda: None
        return silent
    if sys.stderr.isatty():
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # no multiprocessing lock: none is left to leak at exit
        bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

        def step(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        step.close = bar.close
        return step
    print(f"{desc}: {total} {unit}(s) to run", file=sys.stderr, flush=True)
    count = [0]
    every = max(1, -(-total // lines)) if lines else 1

    def line(label: str) -> None:
        count[0] += 1
        if count[0] % every == 0 or count[0] in (1, total):
            print(f"{desc}: [{count[0]}/{total}] {label}", file=sys.stderr, flush=True)

    line.close = lambda: None
    return line


def note(desc: str, text: str) -> None:
    """A line of feedback on stderr (the table or JSON stays alone on stdout); the reporting rank's."""
    if is_reporting_rank():
        print(f"{desc}: {text}", file=sys.stderr, flush=True)
