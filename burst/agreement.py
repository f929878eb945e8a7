"""Every rank of a group must make the same call: one small collective checks it.

A sharded call is only right when every rank passes the same options (causal, layout, window, ...)
and shards of one shape. A rank that differs does not fail by itself: it computes a different mask,
or runs a different number of ring steps and hangs its neighbours. `agree` gathers one int64 per
named fact from every rank (an exact value for ints, a 63-bit digest for anything else) and, when
any fact differs or any rank's input was bad, raises the same error on every rank before the
strategy sends anything. Only on that error path does a second collective gather the values
themselves, so the message can name each rank's value.

The check costs one all_gather of a few dozen bytes per call and, on a GPU, a host sync. Set
`set_agreement_check("first")` to check only the first call of each signature on this rank (sound
when every rank sees the same sequence of call signatures, which the first check of each verifies),
or "off"; the default "always" is the safe one. The environment variable BURST_AGREEMENT_CHECK sets
the starting mode.

A call that only some ranks make would leave the others waiting in the check forever (gloo's own
timeout is 30 minutes). The check waits at most `set_agreement_timeout(seconds)` (default 120 s,
environment BURST_AGREEMENT_TIMEOUT; 0 = no limit of ours) and then raises TimeoutError on the
waiting ranks, naming the entry point. The group is unusable after that: a collective is left open.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import itertools
import os
import signal
import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .comm.collectives import all_gather_flat
from .comm.membership import group_ranks, is_dtensor

MODES = ("always", "first", "off")
_checked: set[tuple] = set()  # (group key, digests) already agreed on, for mode "first"
_MAX_REMEMBERED = 4096


def settings_from_environment() -> None:
    """BURST_AGREEMENT_CHECK and BURST_AGREEMENT_TIMEOUT as the mode and the timeout: read at import, and
    again by a spawned rank once its environment is the launcher's (launch.spawn_world's env= included).
    ValueError naming the variable for a value neither takes (a typo must not mean the default silently)."""
    global _mode, _timeout_s
    _env_problems.clear()
    mode = os.environ.get("BURST_AGREEMENT_CHECK", "always")
    if mode not in MODES:
        _env_problems["mode"] = f"BURST_AGREEMENT_CHECK={mode!r} is not one of {MODES}"
    timeout = os.environ.get("BURST_AGREEMENT_TIMEOUT", "120")
    try:
        seconds = float(timeout)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        _env_problems["timeout"] = f"BURST_AGREEMENT_TIMEOUT={timeout!r} is not a number of seconds >= 0"
    _mode = mode if "mode" not in _env_problems else "always"
    _timeout_s = seconds if "timeout" not in _env_problems else 120.0
    _checked.clear()
    check_environment()


def check_environment() -> None:
    """ValueError naming what settings_from_environment found wrong, if anything: at each check (import does
    not raise, so that `burst`'s command line can say it in one line)."""
    if _env_problems:
        raise ValueError("; ".join(_env_problems.values()))


_env_problems: dict[str, str] = {}  # "mode", "timeout": what the environment set that cannot be taken
try:
    settings_from_environment()
except ValueError:
    pass  # kept in _env_problems: the first check raises it
_left_open: set[int] = set()  # groups (_group_key) where a check timed out: a collective is left open on them


def set_agreement_check(mode: str) -> str:
    """Set how often calls check that ranks agree: "always" (default), "first" or "off".

    "first" checks the first call of each signature (shapes, dtype, options) on this rank and skips
    the collective afterwards: a rank whose options change while the others' do not would then run
    a collective the others skip, so use it only where every rank runs the same program. "off"
    never checks: a disagreement is silently wrong or hangs. Returns the previous mode.
    """
    global _mode
    if mode not in MODES:
        raise ValueError(f"agreement check mode must be one of {MODES}, got {mode!r}")
    _env_problems.pop("mode", None)  # set here: the environment's is not taken
    previous, _mode = _mode, mode
    _checked.clear()
    return previous


def checks_off() -> bool:
    """Whether the agreement checks are off (set_agreement_check("off")): callers skip the work of their facts."""
    return _mode == "off"


def agreement_timeout() -> float:
    """The seconds a rank waits on its peers before it names the one that does not come (0: no limit)."""
    return _timeout_s


def set_agreement_timeout(seconds: float) -> float:
    """Wait at most `seconds` for every rank to reach a call's check (0 = no limit of ours: the
    process group's own timeout applies). Returns the previous value."""
    global _timeout_s
    if not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"agreement timeout must be a number of seconds >= 0, got {seconds!r}")
    _env_problems.pop("timeout", None)
    previous, _timeout_s = _timeout_s, float(seconds)
    return previous


def digest(value: Any) -> int:
    """A deterministic int64 for `value`: ints (and bools) as themselves, anything else a 63-bit
    hash of its repr (Python's hash() of a str differs between processes)."""
    if isinstance(value, bool) or (isinstance(value, int) and -(2**62) < value < 2**62):
        return int(value)
    raw = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def collective_device(group) -> torch.device:
    """Where the check's small tensor lives: the CPU for gloo, this rank's GPU for NCCL (even when
    this rank's own input is bad or not a tensor)."""
    if dist.get_backend(group) != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch.compiler.disable in torch's own lazy form (as custom_op.run_eagerly): the check is host-side collectives,
# never for dynamo to trace (under torch.compile it runs eagerly behind a graph break)
_eagerly = getattr(torch, "_disable_dynamo", torch.compiler.disable)


@_eagerly
def agree(
    entry: str,
    facts: dict[str, Any] | None,
    problem: BaseException | None,
    group,
    world: int,
    hints: dict[str, str] | None = None,
) -> None:
    """Raise on every rank of `group` unless every rank had no `problem` and equal `facts`.

    entry: the public function, for messages ("burst.attention"). facts: name -> value (None when
    this rank's input was too bad to describe). A rank with a problem raises it; the others raise
    ValueError naming the rank and its message. A fact that differs raises ValueError naming it and
    each rank's value (hints[name] is appended).

    The collective is the same on every rank whatever its input: (ok, digest of all facts), two int64.
    """
    check_environment()
    if world == 1 or _mode == "off":
        if problem is not None:
            raise problem
        return
    ok = problem is None and facts is not None
    digests = tuple(digest(v) for v in facts.values()) if ok else ()
    key = (_group_key(group), tuple(facts) if ok else (), digests)
    if ok and _mode == "first" and key in _checked:
        return
    device = collective_device(group)
    mine = torch.tensor([int(ok), digest((tuple(facts), digests)) if ok else 0], dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    _wait_for_every_rank(all_gather_flat(every, mine, group=group, async_op=True), entry, group)
    rows = every.view(world, 2).cpu().tolist()
    if not all(r[0] for r in rows):
        _raise_bad_input(entry, problem, group, world)
    if len({r[1] for r in rows}) > 1:
        _raise_disagreement(entry, facts, digests, group, world, hints or {})
    if _mode == "first" and len(_checked) < _MAX_REMEMBERED:
        _checked.add(key)


# modules whose weights every rank of a group was found to hold: module -> the groups (_group_key) it was checked on
_weights_agreed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SAMPLES_PER_PARAMETER = 64
WEIGHTS = "the model's weights (a sample of each parameter)"  # the fact's name in agree()'s message
WEIGHTS_HINT = (
    ": the ranks that split one sequence must run one model. Build it under the same seed on every rank "
    "(torch.manual_seed(s) before it is made), load the same checkpoint, or copy one rank's weights to the others "
    "(for t in model.state_dict().values(): dist.broadcast(t, src=0, group=group)) before training"
)


@_eagerly
def agree_on_weights(module: torch.nn.Module, group, world: int, entry: str) -> None:
    """ValueError on every rank of `group` unless every rank's `module` holds the same parameters (weights_digest),
    checked once per module and group. A model built on each rank without a common seed runs without an error and
    gives wrong results: each rank's shard meets other weights. A collective on every rank: call it where every
    rank is."""
    if world == 1 or checks_off():
        return
    checked = _weights_agreed.setdefault(module, set())
    if _group_key(group) in checked:
        return
    agree(entry, {WEIGHTS: weights_digest(module, group)}, None, group, world, hints={WEIGHTS: WEIGHTS_HINT})
    checked.add(_group_key(group))


def weights_digest(module: torch.nn.Module, group=None) -> str:
    """A hex digest of the names and shapes of `module`'s parameters and derived buffers (rotary frequencies: a
    rope setting given to one rank only) and of 64 evenly spaced entries of each, the first and the last included (one
    copy to the host per device), as the ranks of `group` hold them. A DTensor
    counts by its local shard where its mesh holds no other rank of `group` (FSDP over the data-parallel ranks:
    each rank of the group holds the same piece); other sharded parameters (a mesh over the group, FSDP1's) and
    ones not yet made (meta, lazy) are left out: they differ across ranks by design."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        return "not compared (FSDP1 shards the parameters)"
    names, samples, alike = [], {}, {}
    for name, p in _compared_tensors(module):
        if is_dtensor(p):
            mesh = p.device_mesh
            if id(mesh) not in alike:
                alike[id(mesh)] = _holds_no_other_rank(mesh, group)
            if alike[id(mesh)]:
                p = p.to_local()
            else:
                continue
        if p.is_meta or isinstance(p, torch.nn.parameter.UninitializedParameter):
            continue
        flat = p.detach().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        names.append(f"{name}{tuple(p.shape)}")
        if flat.numel():  # the first and the last entry among them: rows added at the end (resized embeddings)
            samples.setdefault(flat.device, []).append(flat[_sample_positions(flat.numel(), flat.device)].double())
    values = b"".join(torch.cat(parts).cpu().numpy().tobytes() for parts in samples.values())
    return hashlib.blake2b(repr(names).encode() + values, digest_size=8).hexdigest()


def _sample_positions(n: int, device) -> torch.Tensor:
    """_SAMPLES_PER_PARAMETER evenly spaced positions of n entries (all of them when fewer), the first and the last
    included; in integers: linspace's float32 rounds n - 1 up to n past 2**24 entries (a real model's embedding or
    projection), an index past the end."""
    k = min(_SAMPLES_PER_PARAMETER, n)
    return torch.arange(k, device=device) * (n - 1) // max(k - 1, 1)


def _compared_tensors(module: torch.nn.Module):
    """(name, tensor) for `module`'s parameters and its non-persistent buffers: those a model derives from its
    config (rotary frequencies, masks, position ids), the same on every rank by design. Persistent buffers may
    be state that training updates from each rank's own tokens (batch norm's running statistics, a
    quantization observer's ranges): not compared."""
    yield from module.named_parameters()
    for prefix, owner in module.named_modules():
        for name in sorted(owner._non_persistent_buffers_set):
            buffer = owner._buffers.get(name)
            if buffer is not None:
                yield f"{prefix}.{name}" if prefix else name, buffer


def _holds_no_other_rank(mesh, group) -> bool:
    """Whether `mesh` (a DeviceMesh of any shape) holds no rank of `group` but this one."""
    ranks = set(mesh.mesh.flatten().tolist())
    return not (ranks - {dist.get_rank()}) & set(group_ranks(group))


def _wait_for_every_rank(work, entry: str, group) -> None:
    """Wait for the check's all_gather at most the agreement timeout; past it, some rank never made
    the call (it is elsewhere in the program): raise here instead of hanging."""
    if not _timeout_s:
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=_timeout_s))
    except RuntimeError as err:
        _left_open.add(_group_key(group))
        _bound_the_exit()
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            first_line = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise RuntimeError(
                f"{entry}: the group broke while this rank waited for the others' check ({first_line}): a peer "
                "left it, most often one whose own wait for this check timed out first. The process group is "
                "unusable now"
            ) from err
        raise TimeoutError(
            f"{entry}: waited {_timeout_s:g} s for the other ranks of the group to make the same call; some "
            "ranks did not make it (every rank must call it, e.g. model.generate() or forward() on every "
            "rank, not on rank 0 only), or made it on another group (pass every rank the same group: one "
            "dist.new_group made on every rank). The process group is unusable now. A slow rank that is merely "
            "late needs a longer wait: burst.set_agreement_timeout(seconds) or BURST_AGREEMENT_TIMEOUT"
        ) from err


EXIT_GRACE_S = 20  # how long a process whose check timed out may take to exit before it is ended (SIGALRM)


def _bound_the_exit() -> None:
    """Arm, at this process's exit, an alarm that ends it EXIT_GRACE_S later. The check's all_gather stays open
    after its wait timed out, and gloo's worker thread waits for it on the way out (destroy_process_group returns,
    the interpreter's exit does not) until the late rank comes, which may be never: under torchrun the job hung
    with the TimeoutError printed, and torchrun, seeing no rank fail, kept the others waiting too. Killed by
    SIGALRM, the rank is seen failed and torchrun stops the rest. An exit that needs no wait is not slowed; a
    process that ends without an uncaught error is not bounded (_alarm_at_exit)."""
    global _exit_bounded
    if not _exit_bounded and hasattr(signal, "alarm"):
        _exit_bounded = True
        atexit.register(_alarm_at_exit)


_exit_bounded = False


def _alarm_at_exit() -> None:
    """Armed only when the process ends on an uncaught error (the timeout's, or what followed it): one that caught
    the TimeoutError and went on (a new world) ends as it would have, its exit unbounded."""
    if threading.current_thread() is not threading.main_thread() or getattr(sys, "last_value", None) is None:
        return
    print(
        f"burst: a collective check timed out in this process and is still open; the process is ended (SIGALRM) "
        f"if it has not exited in {EXIT_GRACE_S} s",
        file=sys.stderr,
        flush=True,
    )
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(EXIT_GRACE_S)


def collective_left_open(group=None) -> bool:
    """Whether a check timed out on `group` (None: the default group) in this process: no later collective
    on it can pair up (launch.end_rank does not wait at its closing barrier then, which would never end)."""
    return _group_key(group) in _left_open


def _group_key(group) -> int:
    """A number for `group` (None: the default group) that no other group gets, not even one made after it is
    destroyed (an id() may be reused): a world initialised again is checked, and waited for, afresh."""
    if group is None:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            return 0
    key = _group_keys.get(group)
    if key is None:
        key = _group_keys[group] = next(_next_group_key)
    return key


_group_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_next_group_key = itertools.count(1)  # keys are never reused


def _raise_bad_input(entry: str, problem, group, world: int) -> None:
    messages = [None] * world
    dist.all_gather_object(messages, None if problem is None else f"{type(problem).__name__}: {problem}", group=group)
    if problem is not None:
        raise problem
    bad = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    raise ValueError(f"{entry}: bad input on another rank; " + "; ".join(bad))


def _raise_disagreement(entry: str, facts: dict, digests: tuple, group, world: int, hints: dict[str, str]) -> None:
    """Gather every rank's facts (every rank is here: all saw the same digests) and name those that differ."""
    mine = [(name, d, _shown(value)) for (name, value), d in zip(facts.items(), digests)]
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    by_name = [dict((name, (d, shown)) for name, d, shown in rows) for rows in every]
    names = list(dict.fromkeys(name for rows in every for name, _, _ in rows))
    parts = []
    for name in names:
        values = [row.get(name, (None, "(not given)")) for row in by_name]
        if len({d for d, _ in values}) > 1:
            by_rank = ", ".join(f"rank {r}: {shown}" for r, (_, shown) in enumerate(values))
            parts.append(
                f"{name} differs across ranks ({by_rank}); it must be equal on every rank" + hints.get(name, "")
            )
    raise ValueError(f"{entry}: " + "; ".join(parts))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
