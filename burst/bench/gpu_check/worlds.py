"""Section 2: burst.check and the masks through burst.attention on a one-rank world, then 2-4 ranks
sharing the device with whichever backend takes it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import burst
from burst import api
from burst import layout as layout_mod
from burst.bench.harness import _sync as sync
from burst.check import max_over_ranks
from burst.kernels import reference
from burst.launch import spawn_world

from .cases import QUANTITIES, Sizes, api_mask_kwargs, compare, float64_reference, mask_spec, random_inputs, rank_device
from .report import Report, Section, first_line


def _check_world(rank, world, sizes_dict, device_kind, strategies):
    """On every rank: burst.check plus the masks through burst.attention; rank 0's result returned."""
    sizes = Sizes(**sizes_dict)
    device = rank_device(device_kind)
    report = burst.check(
        strategies=strategies,
        seq_len=sizes.world_len,
        heads=sizes.world_heads,
        kv_heads=sizes.world_kv_heads,
        head_dim=sizes.world_dim,
        dtype=sizes.world_dtypes,
        device=device,
    )
    return {
        "check": report.as_dict(),
        "masks": masked_api_rows(None, world, device, sizes, strategies),
        "backend": dist.get_backend(),
        "device": str(device),
    }


def _probe_then_check(rank, world, sizes_dict, device_kind):
    """_probe_world, then, when every exchange came back right, _check_world in the same world."""
    probe = _probe_world(rank, world, device_kind)
    every = torch.tensor([float(all(probe.values()))], device=rank_device(device_kind))
    dist.all_reduce(every, op=dist.ReduceOp.MIN)  # all ranks go on to the check, or none does
    check = _check_world(rank, world, sizes_dict, device_kind, None) if every.item() == 1.0 else None
    return {"probe": probe, "check": check}


def masked_api_rows(group, world: int, device, sizes: Sizes, strategies=None) -> list:
    """window / documents / block-sparse through burst.attention, every strategy x layout, vs float64
    on the whole sequence (burst.check covers full and causal)."""
    n, rows = sizes.world_len, []
    for dtype_name in sizes.world_dtypes[:2]:
        dtype = getattr(torch, dtype_name)
        full = random_inputs(1, n, sizes.world_heads, sizes.world_kv_heads, sizes.world_dim, dtype, device, seed=7)
        for kind in ("window", "documents", "documents_window", "block_sparse"):
            spec = mask_spec(kind, n)
            ref = float64_reference(*full, spec, sizes.world_dim**-0.5)
            for strategy in strategies or api.STRATEGIES:
                for lay in layout_mod.LAYOUTS:
                    row = {"strategy": strategy, "layout": lay, "mask": kind, "dtype": dtype_name}
                    q, k, v, dout = (layout_mod.shard(t, group=group, layout=lay) for t in full)
                    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                    try:
                        out, lse = burst.attention(
                            q,
                            k,
                            v,
                            group=group,
                            strategy=strategy,
                            layout=lay,
                            return_lse=True,
                            **api_mask_kwargs(spec),
                        )
                    except (ValueError, NotImplementedError) as err:  # refused alike on every rank
                        row.update(status="skipped", note=first_line(err)[:70])
                        rows.append(row)
                        continue
                    out.backward(dout)
                    theirs = [layout_mod.shard(t, group=group, layout=lay, dim=2 if t.dim() == 3 else 1) for t in ref]
                    errors, _ = compare((out, lse, q.grad, k.grad, v.grad), theirs, dtype_name)
                    worst = max_over_ranks([errors[x] for x in QUANTITIES], group, world, out.device)
                    errors = dict(zip(QUANTITIES, worst))
                    row.update(errors, status="ok" if reference.within_bounds(errors, dtype_name) else "FAIL")
                    rows.append(row)
    return rows


def _probe_world(rank, world, device_kind):
    """Can ranks sharing this device talk? Collectives, and a ring step through burst's own exchange
    (comm/p2p.py, which takes device tensors through host copies on gloo), on device tensors."""
    from burst.comm.p2p import exchange

    device = rank_device(device_kind)
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    done = {"all_reduce": float(x[0]) == world * (world + 1) / 2}
    gathered = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((4,), float(rank), device=device))
    done["all_gather"] = [float(t[0]) for t in gathered] == [float(r) for r in range(world)]
    mine = torch.full((1024,), float(rank), device=device)
    got = exchange(None, "forward", [(mine, (rank + 1) % world, 0)], [(mine, (rank - 1) % world, 0)]).wait()[0]
    sync(device)
    done["exchange"] = got.device == device and float(got[0]) == float((rank - 1) % world)
    return done


def _world_table(sec: Section, label: str, result: dict) -> None:
    check_rows = [
        {**{k: r[k] for k in ("strategy", "layout", "causal", "dtype", "status", "note")}, **r["errors"]}
        for r in result["check"]["rows"]
    ]
    bad = [r for r in check_rows + result["masks"] if r["status"] == "FAIL"]
    ran = [r for r in check_rows + result["masks"] if r["status"] == "ok"]
    sec.note(
        f"{label}: backend {result['backend']}, tensors on {result['device']}: {len(ran)} cases within bounds, "
        f"{len(bad)} FAIL, {len(check_rows) + len(result['masks']) - len(ran) - len(bad)} skipped "
        "(refused by the strategy)"
    )
    for r in bad:
        sec.fail(f"{label}: {r['strategy']} {r['layout']} {r.get('causal', r.get('mask'))} {r['dtype']}")
    cols = ["strategy", "layout", "dtype", "out", "lse", "dq", "dk", "dv", "status", "note"]
    sec.table(f"{label}: burst.check (full and causal)", cols[:2] + ["causal"] + cols[2:], check_rows)
    sec.table(f"{label}: masks through burst.attention", cols[:2] + ["mask"] + cols[2:], result["masks"])


def section_worlds(rep: Report) -> dict:
    """Returns {"backend": the backend that ran several ranks on this device, or None}."""
    found = {"backend": None}
    with rep.section("2", "The whole API on one rank, then several ranks on one device") as sec:
        sizes, kind = rep.sizes, rep.device.type
        one = "nccl" if kind == "cuda" else "gloo"
        result = spawn_world(
            _check_world,
            dataclasses.asdict(sizes),
            kind,
            None,
            nproc=1,
            backend=one,
            threads=sizes.threads,
            timeout=min(sec.left(), sizes.spawn_timeout * 2),
        )
        _world_table(sec, f"1 rank ({one})", result[0])
        candidates = ["nccl", "gloo"] if kind == "cuda" else ["gloo"]
        tried, first = [], sizes.world_ranks[0]
        for backend in candidates:  # NCCL refuses two ranks on one GPU; gloo may take CUDA tensors
            if sec.skip_for_time(f"probe {backend} with {first} ranks", 30):
                break
            try:
                limit = 90.0 if backend == "nccl" else sizes.spawn_timeout * 2  # NCCL is expected to refuse: fast
                got = spawn_world(
                    _probe_then_check,
                    dataclasses.asdict(sizes),
                    kind,
                    nproc=first,
                    backend=backend,
                    threads=sizes.threads,
                    timeout=max(10.0, min(limit, sec.left())),
                )[0]
                tried.append({"backend": backend, "ranks": first, "tensors": kind, **got["probe"], "result": "ran"})
            except Exception as err:  # noqa: BLE001 - the probe is there to find out
                tried.append({"backend": backend, "ranks": first, "tensors": kind, "result": first_line(err)[:160]})
                continue
            if got["check"] is not None:
                found["backend"] = backend
                sec.note(
                    f"several ranks on one device run with {backend}: communication is copies on the device "
                    "(with gloo, through host memory: comm/p2p.py), not a network"
                )
                _world_table(sec, f"{first} ranks ({backend})", got["check"])
                break
        sec.table(
            "several ranks on one device: what the backends took (exchange = burst.comm.p2p's isend/irecv)",
            ["backend", "ranks", "tensors", "all_reduce", "all_gather", "exchange", "result"],
            tried,
        )
        if found["backend"] is None:  # a failure, not a note: the several-rank checks asked for did not run
            sec.fail(
                f"no backend ran {first} ranks on one {kind} device with {kind} tensors (see the table); the "
                "several-rank checks did not run"
            )
            return found
        for ranks in sizes.world_ranks[1:]:
            if sec.skip_for_time(f"{ranks} ranks", 20):
                break
            result = spawn_world(
                _check_world,
                dataclasses.asdict(sizes),
                kind,
                None,
                nproc=ranks,
                threads=sizes.threads,
                backend=found["backend"],
                timeout=min(sec.left(), sizes.spawn_timeout * 2),
            )
            _world_table(sec, f"{ranks} ranks ({found['backend']})", result[0])
    return found
