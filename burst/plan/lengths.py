"""The longest sequence a training step fits, for each of `burst train`'s memory options.

`longest_length(strategy, cluster, t)`: the largest multiple of `granule` tokens at which
model_cost.whole_model says t's step fits in device (and, when t says how much, host) memory; the
step's memory grows with the length, so a bisection finds it. `option_rows(...)`: that length and
the modelled speed there for each entry of MEMORY_OPTIONS (`burst plan --longest`, the OOM line of
`burst train`, scripts/gpu_train_lengths.py's choice of lengths to try), host activations on as many
layers as make the longest step fit (`best_split`).
"""

from __future__ import annotations

from dataclasses import replace

from .flops import DENSE_BF16_PEAK, train_flops_per_token
from .model_cost import Training, whole_model

FFN_CHUNK = 8192  # tokens per blockwise-feedforward chunk in the options below: ~1 GB of SwiGLU activations at 8B

# name -> (Training fields, the `burst train` flags that run it). Fused loss unless said otherwise.
MEMORY_OPTIONS: dict[str, tuple[dict, str]] = {
    "plain": (dict(checkpointing="none", fused_loss=False), "--checkpointing none --no-fused-loss"),
    "full": (dict(checkpointing="full", ffn_chunk=FFN_CHUNK), f"--checkpointing full --ffn-chunk {FFN_CHUNK}"),
}
for _mode in ("none", "full", "remat", "selective"):
    _flags = f"--checkpointing {_mode} --ffn-chunk {FFN_CHUNK} --offload-optimizer"
    MEMORY_OPTIONS[f"{_mode} + host optimizer"] = (
        dict(checkpointing=_mode, ffn_chunk=FFN_CHUNK, offload_optimizer=True, optimizer_in_backward=True),
        _flags,
    )
    if _mode != "none":
        MEMORY_OPTIONS[f"{_mode} + host optimizer + host activations"] = (
            dict(
                checkpointing=_mode,
                ffn_chunk=FFN_CHUNK,
                offload_optimizer=True,
                optimizer_in_backward=True,
                offload_activations=True,
            ),
            _flags + " --offload-activations",
        )


def longest_length(strategy: str, cluster, t: Training, granule: int = 1024, limit: int | None = None) -> int:
    """The longest multiple of `granule` (<= limit: the model's max_seq_len by default, which `burst
    train` refuses to pass) whose step fits; 0 when not even `granule` does."""
    limit = limit or model_limit(t.model)
    fits = lambda n: whole_model(strategy, cluster, replace(t, seq_len=n)).fits  # noqa: E731
    if not fits(granule):
        return 0
    low, high = 1, limit // granule  # fits(low * granule); find the last k that does
    if fits(high * granule):
        return high * granule
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * granule) else (low, mid)
    return low * granule


def model_limit(model) -> int:
    """The longest sequence the search goes to: the model's max_seq_len, else 2**23 tokens."""
    return int(getattr(model, "max_seq_len", None) or 1 << 23)


def best_split(strategy: str, cluster, t: Training) -> Training:
    """t with host activations on the first `offload_layers` layers only, as many as make the longest
    step fit (ties: the fewest, each one's copies cost time); t itself without host activations.
    Every layer's checkpoints on the host can fill a host that holds AdamW's state too (8B: ~100 GiB
    of 128) while the device has room left: the split keeps the rest on the device."""
    if not t.offload_activations:
        return t
    best, longest = t.model.layers, -1
    for n in range(1, t.model.layers + 1):
        fits = longest_length(strategy, cluster, replace(t, offload_layers=n))
        if fits > longest:
            best, longest = n, fits
    return replace(t, offload_layers=best)


def split_flags(t: Training) -> str:
    """`burst train`'s flag for t's split (best_split), or nothing when every layer's checkpoints go."""
    n = t.offloaded_layers
    return f" --offload-layers {n}" if t.offload_activations and n < t.model.layers else ""


def speed_at(strategy: str, cluster, t: Training) -> dict:
    """Modelled step time, optimizer time, tokens/s per device and MFU (torchtitan's FLOPs over the
    forward + backward time, the dense bf16 peak) of t, with device and host memory."""
    est = whole_model(strategy, cluster, t)
    step, optimizer = est.extra["step_s"], est.extra["optimizer_s"]
    tokens = t.batch * t.seq_len / (cluster.gpus // t.dp)
    peak = DENSE_BF16_PEAK.get(cluster.profile.name, 0.0)
    flops = train_flops_per_token(t.model, t.seq_len) * tokens
    return {
        "seq_len": t.seq_len,
        "fits": est.fits,
        "step_s": step,
        "optimizer_s": optimizer,
        "tokens_per_s_per_device": tokens / step,
        "mfu": flops / (step - optimizer) / peak if peak else None,
        "mem_bytes": est.mem_bytes_per_device,
        "host_mem_bytes": est.extra["host_mem_bytes"],
    }


def option_rows(
    model,
    cluster,
    host_memory_bytes: float | None = None,
    options=None,
    strategy: str = "burst",
    dtype_bytes: int | None = None,
) -> list[dict]:
    """Per memory option (MEMORY_OPTIONS by default): its name, `burst train` flags, the longest
    length that fits and speed_at() there. One sequence per step on cluster.gpus devices (sp), no FSDP
    on one device."""
    rows = []
    for name, (fields, flags) in (options or MEMORY_OPTIONS).items():
        t = Training(
            model, 1024, fsdp=cluster.gpus > 1, host_memory_bytes=host_memory_bytes, dtype_bytes=dtype_bytes, **fields
        )
        t = best_split(strategy, cluster, t)
        longest = longest_length(strategy, cluster, t)
        row = {"option": name, "flags": flags + split_flags(t), "longest": longest}
        row["at_model_limit"] = longest >= model_limit(model) - 1023
        if longest:
            row.update(speed_at(strategy, cluster, replace(t, seq_len=longest)))
        rows.append(row)
    return rows
