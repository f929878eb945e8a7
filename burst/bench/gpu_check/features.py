"""Section 5: what only CUDA shows: FSDP2 CPU offload in `burst train`, bf16 autocast, `burst check`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

import burst
from burst.kernels import reference
from burst.launch import spawn_world
from burst.masks import MaskSpec

from .cases import Sizes, compare, float64_reference, random_inputs, rank_device
from .memory import train_steps
from .report import Report, Section, first_line, repo_root


def _fsdp_world(rank, world, sizes_dict, device_kind):
    """FSDP2 CPU offload on a one-rank world: first through `burst train`'s own entry point
    (engine.train.train), then through the engine's pieces (engine.parallel.shard_parameters over an
    explicit (dp, sp) mesh) with the model's steps on this device. On the CPU offload is refused by
    design, so there the second runs FSDP2 without it. Returns feature rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from burst.engine.parallel import Parallel, shard_parameters
    from burst.engine.train import TrainConfig, build, train

    sizes, device = Sizes(**sizes_dict), rank_device(device_kind)
    rows = []
    cfg = TrainConfig(model="tiny", seq_len=256, steps=2, fsdp="dp", cpu_offload=True, progress=False)
    feature = "burst train --fsdp dp --cpu-offload on 1 rank (engine.train.train)"
    try:
        got = train(rank, world, cfg)
        rows.append(
            {"feature": feature, "status": "ok", "detail": "losses " + ", ".join(f"{r['loss']:.3f}" for r in got)}
        )
    except Exception as err:  # noqa: BLE001 - recorded
        refused = device_kind == "cpu" and isinstance(err, ValueError)
        rows.append(
            {
                "feature": feature,
                "status": "refused on CPU (as designed)" if refused else "FAIL",
                "detail": first_line(err)[:200],
            }
        )
    offload = device_kind == "cuda"
    feature = f"engine model, FSDP2 over a (1, 1) mesh{', CPU offload' if offload else ''}, steps on {device_kind}"
    try:
        mesh = init_device_mesh(device_kind, (1, 1), mesh_dim_names=("dp", "sp"))
        tcfg = TrainConfig(model=sizes.train_model, seq_len=sizes.train_start, progress=False)
        model = shard_parameters(build(tcfg), Parallel(fsdp="dp", mesh=mesh), cpu_offload=offload)
        if not offload:
            model.to(device)
        where = next(model.parameters()).device
        got = train_steps(sizes, device, "none", sizes.train_start, model=model)
        peak = torch.cuda.max_memory_allocated() / 2**20 if offload else None
        kept_on_host = where.type == "cpu"  # what offload promises; without it they follow the model
        rows.append(
            {
                "feature": feature,
                "status": "ok" if kept_on_host or not offload else "FAIL",
                "detail": f"parameters on {where}; losses "
                + ", ".join(f"{x:.3f}" for x in got["losses"])
                + (f"; GPU peak {peak:.0f} MiB" if peak is not None else ""),
            }
        )
    except Exception as err:  # noqa: BLE001 - recorded
        rows.append({"feature": feature, "status": "FAIL", "detail": first_line(err)[:200]})
    return rows


def section_features(rep: Report) -> None:
    with rep.section("5", "CUDA-only features: FSDP2 CPU offload, bf16 autocast, burst check") as sec:
        sizes, device = rep.sizes, rep.device
        rows = []
        for what, need, feature in (
            ("FSDP2 CPU offload", 40, _fsdp_rows),
            ("bf16 autocast", 2, _autocast_rows),
            ("MLA latent", 5, _latent_rows),
            ("burst check", 30, _cli_rows),
        ):
            if sec.skip_for_time(what, need):
                continue
            try:
                rows += feature(sec, sizes, device, rep.outdir)
            except Exception as err:  # noqa: BLE001 - recorded; the next feature still runs
                rows.append({"feature": what, "status": "FAIL", "detail": first_line(err)[:200]})
        for row in rows:
            if row["status"] == "FAIL":
                sec.fail(f"{row['feature']}: {row['detail']}")
        import inspect

        from burst.launch import run_world

        if device.type == "cuda" and inspect.signature(run_world).parameters["backend"].default == "gloo":
            sec.note(
                "burst check starts its world with launch.run_world's default backend, gloo, and burst.check "
                "puts tensors on the CPU for a gloo group: as shipped, `burst check` checks the CPU path even "
                "on a GPU machine (section 2 runs burst.check on NCCL and CUDA instead)"
            )
        sec.table("features", ["feature", "status", "detail"], rows)


def _fsdp_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """FSDP2 CPU offload on a one-rank world (_fsdp_world)."""
    return spawn_world(
        _fsdp_world,
        dataclasses.asdict(sizes),
        device.type,
        nproc=1,
        threads=sizes.threads,
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=max(10.0, min(sec.left(), sizes.spawn_timeout)),
    )[0]


def _autocast_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """float32 q, k, v under torch.autocast(bf16): burst.attention runs in bf16, as SDPA does."""
    n = sizes.world_len
    q, k, v, dout = random_inputs(
        1, n, sizes.world_heads, sizes.world_kv_heads, sizes.world_dim, torch.float32, device, seed=3
    )
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out, lse = burst.attention(qq, kk, vv, causal=True, return_lse=True)
    out.float().backward(dout)
    as_bf16 = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    errors, ok = compare(
        (out, lse, qq.grad, kk.grad, vv.grad),
        float64_reference(*as_bf16, MaskSpec(causal=True), sizes.world_dim**-0.5),
        "bfloat16",
    )
    ok = ok and out.dtype == torch.bfloat16 and qq.grad.dtype == torch.float32
    return [
        {
            "feature": "burst.attention under torch.autocast(bf16)",
            "status": "ok" if ok else "FAIL",
            "detail": f"out {out.dtype}, dq {qq.grad.dtype}; errors "
            + ", ".join(f"{x} {e:.1e}" for x, e in errors.items()),
        }
    ]


def _latent_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """burst.attention(q, latent=LatentKV(...)) on one rank, causal, in the speed section's dtype
    (DeepSeek-V3's head: nope 128 + rope 64, values 128, scaled down on the CPU) against float64
    attention over the expanded heads: out and the gradients of q, the latent, the rotary key and
    the expansion's weight."""
    dtype = getattr(torch, sizes.speed_dtype)
    if device.type == "cuda":
        n, heads, nope, rope_dim, vdim, rank = 2048, 8, 128, 64, 128, 512
    else:
        n, heads, nope, rope_dim, vdim, rank = sizes.world_len, 2, 8, 8, 8, 16
    g = torch.Generator().manual_seed(5)
    draw = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device)
    q, c, r = draw(1, n, heads, nope + rope_dim), draw(1, n, rank), draw(1, n, rope_dim)
    w, dout = draw(heads * (nope + vdim), rank, scale=rank**-0.5), draw(1, n, heads, vdim)
    ours = [t.to(dtype).requires_grad_() for t in (q, c, r, w)]
    out = burst.attention(ours[0], latent=burst.LatentKV(ours[1], ours[2], ours[3], nope, vdim), causal=True)
    out.backward(dout.to(dtype))
    ref = [t.to(dtype).double().requires_grad_() for t in (q, c, r, w)]  # the inputs as burst saw them
    kv = (ref[1] @ ref[3].t()).view(1, n, heads, nope + vdim)
    k = torch.cat([kv[..., :nope], ref[2][:, :, None].expand(1, n, heads, rope_dim)], -1)
    scores = torch.einsum("bqhd,bkhd->bhqk", ref[0], k) * (nope + rope_dim) ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    ref_out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), kv[..., nope:])
    ref_out.backward(dout)
    errors = {
        name: float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for name, a, b in zip(
            ("out", "dq", "dlatent", "drope", "dweight"),
            (out, *(t.grad for t in ours)),
            (ref_out, *(t.grad for t in ref)),
        )
    }
    bound = reference.BOUNDS[sizes.speed_dtype]
    ok = all(e <= bound for e in errors.values()) and out.shape == (1, n, heads, vdim)
    return [
        {
            "feature": f"MLA: burst.attention(latent=) {sizes.speed_dtype}, {n} tokens, {heads} heads, nope {nope} + "
            f"rope {rope_dim}, v {vdim}, rank {rank}",
            "status": "ok" if ok else "FAIL",
            "detail": "errors " + ", ".join(f"{x} {e:.1e}" for x, e in errors.items()) + f" (bound {bound:g})",
        }
    ]


def _cli_rows(sec: Section, sizes: Sizes, device, outdir) -> list:
    """`burst check` as a user runs it, in a subprocess."""
    command = [
        sys.executable,
        "-m",
        "burst",
        "check",
        "--nproc",
        "1",
        "--seq-len",
        str(min(sizes.world_len, 1024)),
        "--heads",
        str(sizes.world_heads),
        "--head-dim",
        str(sizes.world_dim),
        "--dtype",
        "float32,bfloat16",
        "--strategies",
        "burst,ring,allgather",
        "--json",
        os.path.join(outdir, "burst_check.json"),
    ]
    feature = "`" + " ".join(["python -m burst"] + command[3:-2]) + "`"
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=max(10.0, min(sec.left(), 150)),
            env={**os.environ, "PYTHONPATH": repo_root()},
        )
    except subprocess.TimeoutExpired:
        return [{"feature": feature, "status": "FAIL", "detail": "timed out"}]
    text = (done.stdout + done.stderr).strip()
    detail = f"exit {done.returncode}: " + (text.splitlines()[-1][:200] if text else "")
    if done.returncode:
        sec.note(f"burst check output: {text[-500:]}")
    return [{"feature": feature, "status": "ok" if done.returncode == 0 else "FAIL", "detail": detail}]
