"""Ranks that disagree on a call's options raise on every rank, naming the option; nothing hangs.

One world per size (2, 3). In each case rank 0 passes one option different from the others; every
rank must raise ValueError naming the option and rank 0's value, and a correct call on the same
world must still be exact afterwards. The "first" check mode is exercised too.
"""

from __future__ import annotations

import datetime
import time

import burst
import pytest
import torch
import torch.distributed as dist

from cases import TOL, full_inputs, reference_grads, sharded_errors
from world import results_by_world

B, N, H, D = 1, 8, 2, 8  # batch, local tokens, heads, head dim
WAIT_S = 1.0  # the agreement timeout of the call only rank 0 makes (the others' barrier waits twice that)


def _mismatch_cases(rank, world):
    """name -> (kwargs for burst.attention on this rank, words rank 0's value shows as)."""
    first = rank == 0
    total = N * world
    blocks = torch.ones(world, world, dtype=torch.bool)
    other_blocks = blocks.clone()
    other_blocks[-1, 0] = False
    return {
        "causal": (dict(causal=first), "True"),
        "layout": (dict(layout="zigzag" if first else "contiguous"), "'zigzag'"),
        "window": (dict(window=(2, 0) if first else (3, 0)), "(2, 0)"),
        "softmax_scale": (dict(softmax_scale=0.5 if first else 0.25), "0.5"),
        "strategy": (dict(strategy="ring" if first else "burst"), "'ring'"),
        "cu_seqlens": (dict(cu_seqlens=[0, 5, total] if first else [0, 6, total]), "(0, 5,"),
        "block_sparse": (dict(block_sparse=burst.BlockSparseMask(N, other_blocks if first else blocks)), ""),
        "return_lse": (dict(return_lse=first), "True"),
        "option distflash": (dict(strategy="distflash" if first else "burst", causal=True), "'distflash'"),
        "option chunk_rows": (dict(chunk_rows=4 if first else 0), "4"),
    }


def _run_mismatches(rank, world):
    results = {}
    full = full_inputs(7, B, N * world, H, H, D, torch.float32)
    ref = reference_grads(*full, causal=True)
    for name, (kwargs, _) in _mismatch_cases(rank, world).items():
        q, k, v = (burst.shard(t).float().requires_grad_() for t in full[:3])
        try:
            out = burst.attention(q, k, v, **kwargs)
            results[name] = ("no error", "")
            if isinstance(out, tuple):
                out = out[0]
            out.sum().backward()
        except ValueError as err:
            results[name] = ("ValueError", str(err))
        # The world is still usable: a correct call right after is exact.
        results[name] += (sharded_errors(full, ref, torch.float32, causal=True),)
    results["shard layout"] = _error_of(lambda: burst.shard(full[0], layout="striped" if rank == 0 else "zigzag"))
    longer = torch.randn(B, N * world + (world if rank == 0 else 0), H, D)
    results["shard length"] = _error_of(lambda: burst.shard(longer))
    local = burst.shard(full[0])
    results["unshard layout"] = _error_of(lambda: burst.unshard(local, layout="zigzag" if rank == 0 else "contiguous"))
    results["unshard shape"] = _error_of(lambda: burst.unshard(local[:, : N - 2] if rank == 0 else local))
    results["unshard still works"] = torch.equal(burst.unshard(local), full[0])
    results["first mode"] = _first_mode(rank, world, full, ref)
    pair = dist.new_group([0, 1])  # every rank makes it; the ranks past 1 are not in it
    if rank >= 2:  # and say so, not that the group has a size of -1
        results["not a member"] = [
            _error_of(lambda: burst.attention(local, local, local, group=pair)),
            _error_of(lambda: burst.shard(full[0], group=pair)),
        ]
    if world == 2:  # a timeout to sit out: once (the test reads the world of 2)
        results["only rank 0 calls"] = _only_rank_zero_calls(rank, full)
    return results


_BROKEN_GROUPS = []


def _only_rank_zero_calls(rank, full, wait_s=WAIT_S):
    """Rank 0 calls burst.attention while the others wait in a barrier of their own (rank 0 calls
    generate(), the rest do not): rank 0 raises TimeoutError after the agreement timeout instead
    of waiting for gloo's 30 minutes. On a side group: the default group stays usable after."""
    side = dist.new_group(backend="gloo")
    _BROKEN_GROUPS.append(side)  # freeing a group with a collective left open blocks: keep it to the exit
    q, k, v = (burst.shard(t).float() for t in full[:3])  # burst.shard agrees on the default group: every rank
    previous = burst.set_agreement_timeout(wait_s)
    start = time.monotonic()
    try:
        if rank == 0:
            burst.attention(q, k, v, group=side)
            outcome = ("no error", "")
        else:
            dist.barrier(group=side, async_op=True).wait(timeout=datetime.timedelta(seconds=2 * wait_s))
            outcome = ("barrier passed", "")
    except TimeoutError as err:
        outcome = ("TimeoutError", str(err))
    except RuntimeError as err:  # the waiting barrier of the other ranks gives up too
        outcome = ("RuntimeError", str(err))
    finally:
        burst.set_agreement_timeout(previous)
    return outcome + (time.monotonic() - start,)


def _error_of(fn):
    try:
        fn()
    except ValueError as err:
        return ("ValueError", str(err))
    return ("no error", "")


def _first_mode(rank, world, full, ref):
    """Mode "first": a mismatch on a signature's first call still raises on every rank; repeated
    agreed calls skip the collective (counted) and stay exact."""
    from burst import agreement

    calls = []
    real = agreement.all_gather_flat

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    previous = burst.set_agreement_check("first")
    agreement.all_gather_flat = counting
    try:
        caught = _error_of(lambda: burst.attention(*(burst.shard(t).float() for t in full[:3]), causal=rank == 0))
        before = len(calls)
        errs = [sharded_errors(full, ref, torch.float32, causal=True) for _ in range(3)]
        repeated_collectives = len(calls) - before
    finally:
        agreement.all_gather_flat = real
        burst.set_agreement_check(previous)
    return caught, errs, repeated_collectives


_results = results_by_world(_run_mismatches, timeout=240)


def _exact(errs) -> bool:
    return not errs["nan"] and max(errs[n] for n in ("out", "dq", "dk", "dv")) < TOL[torch.float32]


def test_a_rank_outside_the_group_is_told_so():
    for kind, message in _results(3)[2]["not a member"]:
        assert kind == "ValueError" and "is not a member of the group" in message, (kind, message)


@pytest.mark.parametrize("world", [2, 3])
def test_option_mismatch_raises_on_every_rank(world):
    per_rank = _results(world)
    for name, (_, shown) in _mismatch_cases(0, world).items():
        fact = name.split()[-1] if name.startswith("option") else name
        fact = "strategy" if name == "option distflash" else fact
        for rank, results in enumerate(per_rank):
            kind, message, after = results[name]
            assert kind == "ValueError", (name, rank, kind)
            assert f"{fact} differs across ranks" in message, (name, rank, message)
            assert f"rank 0: {shown}" in message, (name, rank, message)
            assert _exact(after), (name, rank, after)


@pytest.mark.parametrize("world", [2, 3])
def test_shard_and_unshard_mismatch_raise_on_every_rank(world):
    expected = {
        "shard layout": "layout differs",
        "shard length": "length differs",
        "unshard layout": "layout differs",
        "unshard shape": "shape differs",
    }
    for rank, results in enumerate(_results(world)):
        for name, words in expected.items():
            kind, message = results[name]
            assert kind == "ValueError" and words in message, (name, rank, message)
        assert results["unshard still works"]


@pytest.mark.parametrize("world", [2, 3])
def test_first_mode_catches_first_call_and_skips_repeats(world):
    for rank, results in enumerate(_results(world)):
        (kind, message), errs, repeated_collectives = results["first mode"]
        assert kind == "ValueError" and "causal differs across ranks" in message, (rank, message)
        assert all(_exact(e) for e in errs), (rank, errs)
        # Three rounds of sharded_errors: only the first checks anything new (attention with causal=True,
        # whose mismatched first call was not remembered, and shard along dim 2 for lse); the shard
        # along dim 1 was agreed by the mismatched call already.
        assert repeated_collectives == 2, (rank, repeated_collectives)


def test_a_call_made_by_only_some_ranks_raises_after_the_timeout():
    for rank, results in enumerate(_results(2)):
        kind, message, seconds = results["only rank 0 calls"]
        if rank == 0:
            assert kind == "TimeoutError" and "burst.attention" in message and "did not make it" in message, message
            assert WAIT_S <= seconds < 10, seconds
        else:  # not burst's wait: the barrier this rank chose, bounded by the test
            assert kind == "RuntimeError", (kind, message)


def test_a_mistyped_agreement_setting_in_the_environment_is_refused():
    """BURST_AGREEMENT_CHECK=Off had meant "always" silently; a timeout of "abc" or -1 was read as float("abc")'s
    traceback or a wait of -1 s. Refused at the first call (import does not raise, so that `burst`'s command line
    says it in one line, exit status 2, before anything starts); set_agreement_check refuses the same value."""
    import os
    import subprocess
    import sys

    call = "import burst, torch; x = torch.randn(1, 8, 2, 4); burst.attention(x, x, x)"
    plan = [sys.executable, "-m", "burst", "plan", "--gpus", "2", "--seq-len", "64", "--heads", "2", "--head-dim", "8"]
    cases = [("BURST_AGREEMENT_CHECK", "Off"), ("BURST_AGREEMENT_TIMEOUT", "abc"), ("BURST_AGREEMENT_TIMEOUT", "-1")]
    for name, value in [*cases, ("BURST_HOST_CHANNELS_MB", "abc"), ("BURST_KERNEL", "bogus")]:
        env = {**os.environ, name: value}
        if (name, value) in cases:  # the host channels' size is read where they open, at 2 ranks and more
            done = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True)
            assert done.returncode != 0 and f"{name}={value!r} is not" in done.stderr, done.stderr[-500:]
        done = subprocess.run(plan, env=env, capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-500:]
        assert lines[0].startswith(f"burst plan: error: environment: {name}={value!r} is not"), lines
    env = {**os.environ, "BURST_AGREEMENT_CHECK": "first"}
    assert subprocess.run([sys.executable, "-c", call], env=env).returncode == 0
    # a world started with it: the rank's error names it (each rank had died without a result)
    from burst.launch import WorldError, spawn_world

    with pytest.raises(WorldError, match="BURST_AGREEMENT_TIMEOUT='abc' is not"):
        spawn_world(_rank_of, nproc=2, threads=1, timeout=60, env={"BURST_AGREEMENT_TIMEOUT": "abc"})


def _rank_of(rank, world):
    return rank


def _caught_timeout(rank, world):
    """Rank 0 calls burst.attention on the default group alone and catches the TimeoutError; rank 1 makes
    no call at all. Both return normally. The timeout is the launcher's env= (BURST_AGREEMENT_TIMEOUT)."""
    if rank == 0:
        x = torch.randn(B, N, H, D)
        try:
            burst.attention(x, x, x)
        except TimeoutError:
            return "caught"
        return "no error"
    time.sleep(3 * WAIT_S)
    return "made no call"


def test_a_world_ends_after_a_rank_caught_the_agreement_timeout():
    """The closing barrier of a rank's end would pair with the collective the timed-out check left open and
    wait forever (a helper's world sat out its whole timeout): a rank whose default group has one left open
    does not wait there. spawn_world's env= reaches burst's settings read at import (they were the forkserver's:
    the default 120 s, past this world's 60)."""
    from burst.launch import spawn_world

    start = time.monotonic()
    env = {"BURST_AGREEMENT_TIMEOUT": str(WAIT_S)}
    assert spawn_world(_caught_timeout, nproc=2, threads=1, timeout=60, env=env) == ["caught", "made no call"]
    assert time.monotonic() - start < 30


def _timeout_then_a_new_world(rank, world):
    """Rank 0's check on the default group times out (rank 1 makes no call); both ranks destroy the group and
    initialise a new world. The new default group is not the old one: its checks run (mode "first" too, which had
    remembered the old group's), and collective_left_open() is False on it (it was True: the old group's number
    was kept for the default group, and launch's end skipped its closing barrier)."""
    import os
    import tempfile

    from burst.agreement import collective_left_open, set_agreement_check

    x = torch.randn(B, N, H, D)
    previous = set_agreement_check("first")
    try:
        if rank == 0:
            burst.attention(x, x, x)  # checked: remembered for the default group
            try:
                burst.attention(x, x, x, window=(1, 0))  # a new signature: checked, and rank 1 never comes
            except TimeoutError:
                pass
        else:
            burst.attention(x, x, x)
            time.sleep(3 * WAIT_S)
        before = collective_left_open()
        dist.destroy_process_group()
        store = os.path.join(tempfile.gettempdir(), f"burst-test-reinit-{os.getppid()}")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        after = collective_left_open()
        seen = burst.attention(x, x, x) if rank == 0 else None  # alone: skipped as the old world's, it would hang
    except (TimeoutError, ValueError) as err:
        seen = f"{type(err).__name__}: {err}"
    finally:
        set_agreement_check(previous)
    return before, after, seen if isinstance(seen, str) else "no error"


def test_a_world_initialised_again_is_checked_and_waited_for_afresh():
    from burst.launch import spawn_world

    env = {"BURST_AGREEMENT_TIMEOUT": str(WAIT_S)}
    (before0, after0, seen0), (before1, after1, _) = spawn_world(
        _timeout_then_a_new_world, nproc=2, threads=1, timeout=60, env=env
    )
    assert before0 and not before1, (before0, before1)
    assert not after0 and not after1, (after0, after1)
    assert seen0.startswith("TimeoutError"), seen0  # the new world's check ran: rank 1 did not come


def test_weights_digest_samples_large_parameters_to_their_last_entry():
    """A parameter of more than 2**24 entries (a real model's embedding or projection: Phi-3-mini's qkv_proj holds
    28,311,552) raised IndexError in every shard_batch across ranks: float32 linspace rounded its last position up
    to one past the end (a helper's probe on published shapes). The last entry is still sampled."""
    from burst.agreement import weights_digest

    for n in (2**24 + 3, 28_311_552):
        layer = torch.nn.Linear(1, 1)
        layer.weight = torch.nn.Parameter(torch.zeros(n))
        before = weights_digest(layer)
        with torch.no_grad():
            layer.weight[-1] = 1.0
        assert weights_digest(layer) != before, n
