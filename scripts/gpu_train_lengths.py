"""llama3-8b on one GPU: the longest sequence one training step completes, and its speed, against transformers.

    scripts/gpu_train_lengths.sh OUT [--budget 530] [--modes full,selective,remat,none] [--no-hf] [--no-hf-burst]
                                 [--dry-run]
    python scripts/gpu_train_lengths.py OUT --cpu       # the same code, a tiny model at tiny lengths (the test)

Each trial is one process (a fresh device, its own peak memory, an out-of-memory that ends only it):
a training step (forward, backward, optimizer) of `burst train`'s engine with a memory option
(plan/lengths.py's MEMORY_OPTIONS, the planner's names and flags), or of transformers'
LlamaForCausalLM of the same shapes (sdpa attention, gradient checkpointing, bf16 weights and AdamW
state: what fits an 8B model on one GPU without offloading). Each records step, forward + backward
and optimizer seconds, tokens/s, MFU (torchtitan's FLOPs, burst/plan/flops.py, over forward +
backward; the dense bf16 peak), peak GPU memory (the allocator's) and peak host memory (the
process's resident set).

The planner picks the lengths: speed at 32K and 128K (burst, full checkpointing, host optimizer);
transformers from 8K up, doubling until a step fails; the same LlamaForCausalLM on burst's backend with
fused_loss=True (SequenceParallel at one rank, as SequenceParallelTrainer runs it) from twice plain
transformers' longest, doubling (--no-hf-burst skips it); then, per checkpointing mode, 0.9 x the
planner's longest (0.7 x after a failure). A trial runs only when the time it is expected to take
(the planner's step time, scaled by how far the first trial's measurement was from it, plus the
measured start-up) fits in what is left of --budget seconds, so one command stays under 10
minutes; the report lists what was skipped. Writes OUT/report.md, OUT/results.json (rewritten after
each trial) and the trials' logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

K = 1024
CPU_MODEL = dict(dim=64, layers=2, heads=4, kv_heads=1, ffn_dim=224, vocab_size=512)  # llama3-8b's kind, tiny


def model_config(cpu: bool):
    from burst.plan.models import PRESETS

    base = PRESETS["llama3-8b"]
    return dataclasses.replace(base, **CPU_MODEL) if cpu else base


# --- one trial, in its own process -------------------------------------------------------------


def run_trial(spec: dict) -> dict:
    import torch

    from burst.memory import peak_bytes
    from burst.plan.flops import peak_flops_of, train_flops_per_token

    cpu, n = spec["cpu"], spec["seq_len"]
    device = torch.device("cpu" if cpu else "cuda")
    m = model_config(cpu)
    if spec.get("gpu_mem_gib") and not cpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["gpu_mem_gib"] * 2**30 / total), device)
    start = time.perf_counter()
    if spec["engine"] == "burst":
        step = burst_step(m, n, device, spec)
    else:
        step = hf_step(m, n, device, through_burst=spec["engine"] == HF_BURST)
    setup_s, rows = time.perf_counter() - start, []
    try:
        for _ in range(spec["steps"]):
            rows.append(step())
    except torch.OutOfMemoryError as err:
        return {"ok": False, "why": "out of memory: " + str(err).splitlines()[0][:160], "setup_s": setup_s}
    last = rows[-1]
    peak = peak_flops_of(torch.cuda.get_device_name(device)) if not cpu else 0.0
    flops = train_flops_per_token(m, n) * n
    return {
        "ok": True,
        "setup_s": setup_s,
        **last,
        "tokens_per_s": n / last["step_s"],
        "mfu": flops / last["compute_s"] / peak if peak else None,
        "peak_gpu_bytes": peak_bytes(device) if not cpu else None,
        "peak_host_bytes": peak_bytes(torch.device("cpu")),
        "device": "cpu" if cpu else torch.cuda.get_device_name(device),
    }


def _timed(fn_forward_backward, optimizer_step, sync):
    sync()
    t0 = time.perf_counter()
    loss = fn_forward_backward()
    sync()
    t1 = time.perf_counter()
    extra = optimizer_step()  # seconds of optimizer work done inside the backward (HostAdamW), else 0
    sync()
    t2 = time.perf_counter()
    optimizer_s = t2 - t1 + extra
    return {"loss": loss, "step_s": t2 - t0, "optimizer_s": optimizer_s, "compute_s": t2 - t0 - optimizer_s}


def burst_step(m, n, device, spec):
    import torch

    import burst.engine.train as engine
    from burst.plan.models import PRESETS

    PRESETS["llama3-8b-trial"] = m
    fields = spec["fields"]
    cfg = engine.TrainConfig(
        model="llama3-8b-trial",
        seq_len=n,
        steps=spec["steps"],
        lr=1e-5,
        warmup=1,
        dtype="float32" if spec["cpu"] else "bfloat16",
        device=device.type,
        progress=False,
        checkpointing=fields.get("checkpointing", "none"),
        ffn_chunk=fields.get("ffn_chunk", 0),
        fused_loss=fields.get("fused_loss", True),
        offload_activations=fields.get("offload_activations", False),
        offload_layers=fields.get("offload_layers", 0),
        offload_optimizer=fields.get("offload_optimizer", False),
    )
    model = engine.build(cfg, None, device)
    optimizer = engine.make_optimizer(model, cfg)
    data, count = engine.TokenSource(cfg, m.vocab_size), [0]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the step's peak, not the fp32 weights it was drawn as

    def step():
        timings, count[0] = {}, count[0] + 1
        sync()
        start = time.perf_counter()
        loss = engine.train_step(model, optimizer, data.batch(count[0]), cfg, timings=timings)  # synchronizes
        step_s = time.perf_counter() - start
        return {
            "loss": loss,
            "step_s": step_s,
            "optimizer_s": timings["optimizer_s"],
            "compute_s": step_s - timings["optimizer_s"],
        }

    return step


HF_BURST = "transformers + burst"  # LlamaForCausalLM on burst's backend, fused loss, one rank (issue 70 item 4)


def hf_step(m, n, device, through_burst: bool = False):
    """LlamaForCausalLM (sdpa, gradient checkpointing); through_burst: the path a transformers user takes,
    SequenceParallel (burst's backend, at one rank) with fused_loss=True, as SequenceParallelTrainer runs it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = m.rope_scaling
    config = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        max_position_embeddings=max(n, 131072),
        rms_norm_eps=m.norm_eps,
        use_cache=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": m.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_positions,
        },
        attn_implementation="sdpa",
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.set_default_dtype(dtype)  # bf16 weights from the start: an fp32 8B model would not fit beside its state
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    if through_burst:
        from burst.integrations.transformers import SequenceParallel

        sp = SequenceParallel(model, fused_loss=True)
        loss_of = lambda ids: sp.loss(model, {"input_ids": ids, "labels": ids})  # noqa: E731
    else:
        loss_of = lambda ids: model(input_ids=ids, labels=ids).loss  # noqa: E731

    def forward_backward():
        ids = torch.randint(0, m.vocab_size, (1, n), generator=gen).to(device)
        loss = loss_of(ids)
        loss.backward()
        return loss.item()

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return 0.0

    return lambda: _timed(forward_backward, optimizer_step, sync)


# --- the search, in the parent -----------------------------------------------------------------


def gpu_profile() -> str:
    """H200 or H100 by nvidia-smi's name for GPU 0 (the parent holds no CUDA context: the trials get it all)."""
    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return "H200" if "H200" in name.upper() else "H100"


class Search:
    def __init__(self, args):
        from burst.plan import Cluster, profile

        self.args, self.cpu = args, args.cpu
        self.m = model_config(args.cpu)
        if args.cpu:
            prof = dataclasses.replace(profile("local"), memory_bytes=(3 + args.cpu_mem_gib) * 2**30)
        else:
            prof = profile(args.profile if args.profile != "auto" else gpu_profile())
            if args.gpu_mem_gib:
                prof = dataclasses.replace(prof, memory_bytes=args.gpu_mem_gib * 2**30)
        self.cluster = Cluster(gpus=1, gpus_per_node=1, profile=prof)
        self.host = args.host_mem_gib * 2**30
        self.results, self.skipped, self.start = [], [], time.monotonic()
        self.factor, self.setup_s = 1.5, 30.0 if args.cpu else 90.0  # until the first trial measures them
        self.oom = None

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def training(self, option: str, n: int):
        """The planner's Training of `option` at n tokens, host activations on its best split."""
        from burst.plan import Training
        from burst.plan.lengths import MEMORY_OPTIONS, best_split

        fields = MEMORY_OPTIONS[option][0]
        t = Training(self.m, n, fsdp=False, host_memory_bytes=self.host, dtype_bytes=4 if self.cpu else 2, **fields)
        return best_split("burst", self.cluster, t)

    def fields(self, option: str) -> dict:
        """What a trial of `option` runs: MEMORY_OPTIONS' fields, with the split best_split chose."""
        from burst.plan.lengths import MEMORY_OPTIONS

        return {**MEMORY_OPTIONS[option][0], "offload_layers": self.training(option, K).offload_layers}

    def predicted(self, option: str, n: int) -> dict:
        from burst.plan.lengths import speed_at

        return speed_at("burst", self.cluster, self.training(option, n))

    def longest(self, option: str) -> int:
        from burst.plan.lengths import longest_length

        return longest_length("burst", self.cluster, self.training(option, K), granule=64 if self.cpu else 8 * K)

    def trial(self, engine: str, option: str, n: int, steps: int, purpose: str) -> dict | None:

        guess = self.predicted(option if engine == "burst" else "full", n)
        expected = self.setup_s + steps * guess["step_s"] * self.factor * (1 if engine == "burst" else 1.5)
        entry = {
            "engine": engine,
            "option": option,
            "seq_len": n,
            "steps": steps,
            "purpose": purpose,
            "predicted": guess if engine == "burst" else None,
            "expected_s": expected,
            "offload_layers": self.fields(option)["offload_layers"] if engine == "burst" else 0,
        }
        if expected > self.left() - 5 or self.args.dry_run:
            self.skipped.append(
                {
                    **entry,
                    "why": "dry run"
                    if self.args.dry_run
                    else f"expected {expected:.0f} s, {max(0, self.left()):.0f} s left",
                }
            )
            return None
        spec = {
            "engine": engine,
            "seq_len": n,
            "steps": steps,
            "cpu": self.cpu,
            "gpu_mem_gib": self.args.gpu_mem_gib,
            "fields": self.fields(option) if engine == "burst" else {},
        }
        began = time.monotonic()
        log = os.path.join(self.args.out, f"trial-{len(self.results):02d}.log")
        try:
            with open(log, "w") as f:
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--trial", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=f,
                    text=True,
                    timeout=max(5, self.left()),
                )
            lines = done.stdout.strip().splitlines()
            result = (
                json.loads(lines[-1])
                if done.returncode == 0 and lines
                else {"ok": False, "why": f"exit {done.returncode} (see {os.path.basename(log)})"}
            )
        except subprocess.TimeoutExpired:
            result = {"ok": False, "why": "out of time (the budget)"}
        entry.update(result, wall_s=time.monotonic() - began)
        if (
            result.get("ok")
            and engine == "burst"
            and not any(r.get("ok") and r["engine"] == "burst" for r in self.results)
        ):
            self.factor = max(0.5, result["step_s"] / guess["step_s"])  # the planner, as this device runs it
            self.setup_s = entry["wall_s"] - steps * result["step_s"] + 5  # start-up: imports, weights, state
        self.results.append(entry)
        self.write()
        print(
            f"gpu_train_lengths: {engine} {option} {n}: {'ok' if result.get('ok') else result['why']} "
            f"({entry['wall_s']:.0f} s, {max(0, self.left()):.0f} s left)",
            file=sys.stderr,
            flush=True,
        )
        return entry

    def run(self):
        best = "full + host optimizer"
        speed = (64,) if self.cpu else (32 * K, 128 * K)  # one speed point on the CPU: each trial is a process
        if self.args.speed:
            self.trial("burst", best, speed[0], 2, "speed")
        if self.args.hf:  # transformers from 8K up, doubling, until a step fails
            n = 64 if self.cpu else 8 * K
            while n <= (128 if self.cpu else 256 * K):
                got = self.trial("transformers", "sdpa + gradient checkpointing", n, 2 if n in speed else 1, "longest")
                if not (got and got["ok"]):
                    break
                n *= 2
        if self.args.hf and self.args.hf_burst:  # the transformers path on burst: from 2x plain's longest, doubling
            theirs = [r["seq_len"] for r in self.results if r["engine"] == "transformers" and r.get("ok")]
            n = 64 if self.cpu else 2 * max(theirs, default=4 * K)
            while n <= (64 if self.cpu else 512 * K):
                got = self.trial(HF_BURST, "burst backend + fused loss + gradient checkpointing", n, 1, "longest")
                if not (got and got["ok"]):
                    break
                n *= 2
        if self.args.speed and len(speed) > 1:
            self.trial("burst", best, speed[1], 1, "speed")
        searched = [f"{mode} + host optimizer" for mode in self.args.modes]
        searched += [f"{mode} + host optimizer + host activations" for mode in self.args.host_activations]
        for option in searched:  # 0.9 x the planner's longest, 0.7 x after a failure
            longest = self.longest(option)
            for share in (0.9, 0.7):
                grain = 64 if self.cpu else 8 * K
                n = max(grain, int(longest * share) // grain * grain)
                if any(r.get("ok") and r["option"] == option and r["seq_len"] >= n for r in self.results):
                    break  # already proven at least this long
                got = self.trial("burst", option, n, 1, "longest")
                if got is None or got["ok"]:
                    break
        if self.args.oom_check:
            self.out_of_memory_line()

    def out_of_memory_line(self):
        """`burst train` at 4x the planner's longest without checkpointing (host optimizer): it fails in its
        first layers, so the check costs little more than the start-up; it must end with one line, exit 1."""
        option = "none + host optimizer"
        n = 4 * self.longest(option)
        # a fresh CLI process: imports, the 8B model built and the host optimizer's state made, about twice a
        # trial's start-up (the H200 run of 2026-11 was killed at 83 s with setup_s's estimate)
        expected = 2 * self.setup_s + 0.1 * self.predicted(option, n)["step_s"] * self.factor
        entry = {
            "engine": "burst train (CLI)",
            "option": option,
            "seq_len": n,
            "purpose": "out of memory line",
            "expected_s": expected,
            "predicted": None,
            "steps": 1,
        }
        if expected > self.left() - 5 or self.args.dry_run:
            self.skipped.append(
                {
                    **entry,
                    "why": "dry run"
                    if self.args.dry_run
                    else f"expected {expected:.0f} s, {max(0, self.left()):.0f} s left",
                }
            )
            return
        from burst.comm import shm

        before = shm.names()
        from burst.plan.lengths import MEMORY_OPTIONS

        cmd = [
            sys.executable,
            "-m",
            "burst",
            "train",
            "--model",
            "llama3-8b",
            "--nproc",
            "1",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--seq-len",
            str(n),
            "--steps",
            "1",
            "--no-progress",
            *MEMORY_OPTIONS[option][1].split(),
        ]
        env = dict(os.environ)
        if self.cpu:  # nothing runs out of memory here: the tiny preset with CUDA's error simulated (the test's)
            cmd[cmd.index("llama3-8b")], cmd[cmd.index("cuda")], cmd[cmd.index("bfloat16")] = "tiny", "cpu", "float32"
            cmd[cmd.index("--ffn-chunk") + 1] = "16"
            site = os.path.join(ROOT, "tests", "clients", "oom_site")
            env["PYTHONPATH"] = os.pathsep.join([site, ROOT, env.get("PYTHONPATH", "")])
        began = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5, self.left()), env=env)
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            left = sorted(shm.left_by_dead() - before)  # files of processes still running are in use
            ok = done.returncode == 1 and len(lines) == 1 and "out of memory at --seq-len" in lines[0]
            entry.update(
                ok=ok,
                why=f"exit {done.returncode}, {len(lines)} stderr line(s): {lines[-1][:600] if lines else ''}"
                f"; left in /dev/shm by exited processes: {left or 'nothing'}",
            )
        except subprocess.TimeoutExpired:
            entry.update(ok=False, why="out of time (the budget)")
        entry["wall_s"] = time.monotonic() - began
        self.oom = entry
        self.write()

    def write(self):
        import torch

        meta = {
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "torch": torch.__version__,
            "budget_s": self.args.budget,
            "host_mem_gib": self.args.host_mem_gib,
            "profile": self.cluster.profile.name,
            "gpu_mem_gib": self.cluster.profile.memory_bytes / 2**30,
        }
        with open(os.path.join(self.args.out, "results.json"), "w") as f:
            json.dump(
                {"meta": meta, "results": self.results, "skipped": self.skipped, "out_of_memory": self.oom},
                f,
                indent=1,
                default=str,
            )
        with open(os.path.join(self.args.out, "report.md"), "w") as f:
            f.write(report(meta, self.results, self.skipped, self))


def _option(r: dict, layers: int) -> str:
    """A trial's option, with the layers whose checkpoints its host activations moved when not all."""
    n = r.get("offload_layers") or 0
    return f"{r['option']} (first {n} of {layers} layers)" if 0 < n < layers else r["option"]


def _gib(n) -> str:
    return "" if n is None else f"{n / 2**30:.1f}"


def report(meta: dict, results: list, skipped: list, search: Search) -> str:
    lines = [
        "# llama3-8b: the longest training step on one GPU, and its speed",
        "",
        f"Command: `{meta['command']}` (torch {meta['torch']}); planner profile {meta['profile']} "
        f"({meta['gpu_mem_gib']:.0f} GiB), host memory {meta['host_mem_gib']} GiB. One sequence per step; "
        "MFU: torchtitan's FLOPs (burst/plan/flops.py) over forward + backward seconds, the dense bf16 peak.",
        "",
        "| engine | memory option | seq | result | step s | fwd+bwd s | optimizer s | tokens/s | MFU "
        "| peak GPU GiB | peak host GiB | planner: step s, GPU GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        plan = r.get("predicted") or {}
        planned = f"{plan['step_s']:.3g}, {_gib(plan['mem_bytes'])}" if plan else ""
        if not r.get("ok"):
            label = _option(r, search.m.layers)
            lines.append(f"| {r['engine']} | {label} | {r['seq_len']} | {r['why']} | | | | | | | | {planned} |")
            continue
        mfu = "" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        if plan:  # measured over planned: the planner is within 25% when this lies in 0.8-1.25
            planned += (
                f" (measured {r['step_s'] / plan['step_s']:.2f}x, {r['peak_gpu_bytes'] / plan['mem_bytes']:.2f}x)"
                if r.get("peak_gpu_bytes")
                else f" (measured {r['step_s'] / plan['step_s']:.2f}x)"
            )
        lines.append(
            f"| {r['engine']} | {_option(r, search.m.layers)} | {r['seq_len']} | ok | {r['step_s']:.3g} | "
            f"{r['compute_s']:.3g} | {r['optimizer_s']:.3g} | {r['tokens_per_s']:.4g} | {mfu} | "
            f"{_gib(r.get('peak_gpu_bytes'))} | {_gib(r.get('peak_host_bytes'))} | {planned} |"
        )
    lines += ["", "## Longest step completed", ""]
    for engine in ("burst", "transformers", HF_BURST):
        ok = [r for r in results if r["engine"] == engine and r.get("ok")]
        by = {}
        for r in ok:
            by[r["option"]] = max(by.get(r["option"], 0), r["seq_len"])
        for option, n in by.items():
            planned = search.longest(option) if engine == "burst" else None
            lines.append(f"- {engine}, {option}: {n} tokens" + (f" (planner's longest: {planned})" if planned else ""))
    lines += ["", "## Against transformers", ""]
    ok = [r for r in results if r.get("ok")]
    for n in sorted({r["seq_len"] for r in ok if r["purpose"] == "speed"}):
        ours = max((r["tokens_per_s"] for r in ok if r["engine"] == "burst" and r["seq_len"] == n), default=None)
        theirs = max(
            (r["tokens_per_s"] for r in ok if r["engine"] == "transformers" and r["seq_len"] == n), default=None
        )
        said = lambda v: "did not run or fit" if v is None else f"{v:.4g} tokens/s"  # noqa: E731
        ratio = f": {ours / theirs:.2f}x" if ours and theirs else ""
        lines.append(f"- {n} tokens: burst {said(ours)}, transformers {said(theirs)}{ratio}")
    longest_ours = max((r["seq_len"] for r in ok if r["engine"] == "burst"), default=0)
    longest_theirs = max((r["seq_len"] for r in ok if r["engine"] == "transformers"), default=0)
    if longest_ours and longest_theirs:
        lines.append(
            f"- longest step: burst {longest_ours}, transformers {longest_theirs}: {longest_ours / longest_theirs:.2f}x"
        )
    longest_path = max((r["seq_len"] for r in ok if r["engine"] == HF_BURST), default=0)
    if longest_path and longest_theirs:
        lines.append(
            f"- longest step through transformers: on burst's backend with fused_loss {longest_path}, plain "
            f"{longest_theirs}: {longest_path / longest_theirs:.2f}x"
        )
    if search.oom:
        o = search.oom
        lines += [
            "",
            "## Out of memory from `burst train`",
            "",
            f"At --seq-len {o['seq_len']} ({o['option']}): "
            f"{'as it should be' if o.get('ok') else 'NOT as it should be'}"
            f" ({o['wall_s']:.0f} s): {o['why']}",
        ]
    if skipped:
        lines += ["", "## Not run (the budget)", ""]
        for s in skipped:
            label = _option(s, search.m.layers)
            lines.append(f"- {s['engine']} {label} at {s['seq_len']} (expected {s['expected_s']:.0f} s): {s['why']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=530, help="seconds for the whole search (default 530)")
    p.add_argument("--modes", default="full,selective,remat,none", help="checkpointing modes to find the longest of")
    p.add_argument(
        "--host-activations",
        default="full",
        help="then the modes to find the longest of with host activations too, on the planner's split "
        "(the first N layers' checkpoints on the host; '' for none)",
    )
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--no-hf-burst", dest="hf_burst", action="store_false", help="skip transformers on burst's backend")
    p.add_argument("--no-speed", dest="speed", action="store_false", help="skip the 32K and 128K speed trials")
    p.add_argument("--profile", default="auto", help="planner profile: H100, H200, or auto (GPU 0's, by nvidia-smi)")
    p.add_argument(
        "--gpu-mem-gib",
        type=float,
        default=None,
        help="cap the GPU's memory (an H200 run as an H100: 80) for the trials and the planner",
    )
    p.add_argument("--host-mem-gib", type=float, default=128, help="host memory the planner assumes (default 128)")
    p.add_argument(
        "--no-oom-check",
        dest="oom_check",
        action="store_false",
        help="skip the last trial: `burst train` far past the longest, which must end with one line",
    )
    p.add_argument("--cpu", action="store_true", help="tiny model, tiny lengths, on the CPU (the test)")
    p.add_argument("--cpu-mem-gib", type=float, default=0.02, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="list the trials and their expected seconds, run none")
    args = p.parse_args(argv)
    if args.trial:
        print(json.dumps(run_trial(json.loads(args.trial)), default=str))
        return 0
    if not args.out:
        p.error("OUT: the folder for report.md and results.json")
    args.modes = [m for m in args.modes.split(",") if m]
    args.host_activations = [m for m in args.host_activations.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    search = Search(args)
    search.run()
    search.write()
    print(open(os.path.join(args.out, "report.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
