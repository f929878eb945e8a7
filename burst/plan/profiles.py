"""Hardware profiles: what one device computes and what its links carry.

`flops` is the attention throughput burst's kernel reaches (not the datasheet peak): about 60% of
dense bf16 peak on A100 (FlashAttention-2's published share there); on Hopper, what burst.attention
reached with cuDNN on an H200 (benchmarks/gpu/h200_cudnn_run1.md: 512-564 TFLOP/s fwd+bwd at head dim
128, 16K-128K tokens, beside SDPA's cuDNN backend; the H100 has the same compute, and issue 66's probe
measured cuDNN at 450-583 per tile there); bandwidths are per device and
per direction in bytes/s; latencies in seconds. `local` describes this repository's development
machine (2 CPU cores, gloo over loopback) and is replaced by `burst bench --calibrate`'s measurement
when one is saved (see calibrated_local()).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    flops: float  # attention FLOP/s one device sustains (fwd; bwd runs at the same rate)
    memory_bytes: float  # device memory
    intra_bw: float  # bytes/s per device per direction inside a node (NVLink)
    inter_bw: float  # bytes/s per device per direction across nodes (InfiniBand / RoCE)
    intra_latency: float = 5e-6
    inter_latency: float = 2e-5
    dtype_bytes: int = 2  # bf16 on GPUs
    gpus_per_node: int = 8

    def as_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, Profile] = {
    # NVLink 3: 600 GB/s bidirectional; HDR InfiniBand 200 Gb/s per GPU.
    "A100": Profile("A100", flops=0.6 * 312e12, memory_bytes=80 * 2**30, intra_bw=300 * GB, inter_bw=25 * GB),
    # A800: NVLink capped at 400 GB/s bidirectional.
    "A800": Profile("A800", flops=0.6 * 312e12, memory_bytes=80 * 2**30, intra_bw=200 * GB, inter_bw=25 * GB),
    # NVLink 4: 900 GB/s bidirectional; NDR InfiniBand 400 Gb/s per GPU.
    # cuDNN's fused attention on Hopper, through burst: ~540 TFLOP/s fwd+bwd measured (FlashAttention-2: ~300)
    "H100": Profile("H100", flops=540e12, memory_bytes=80 * 2**30, intra_bw=450 * GB, inter_bw=50 * GB),
    "H200": Profile("H200", flops=540e12, memory_bytes=141 * 2**30, intra_bw=450 * GB, inter_bw=50 * GB),
    # This machine: ~110 GFLOP/s fp32 per core for the CPU flash op (DESIGN.md: ~220 on 2 cores),
    # gloo over loopback; replaced by a calibration when one is saved.
    "local": Profile(
        "local",
        flops=110e9,
        memory_bytes=24 * 2**30,
        intra_bw=2 * GB,
        inter_bw=2 * GB,
        intra_latency=5e-5,
        inter_latency=5e-5,
        dtype_bytes=4,
        gpus_per_node=2,
    ),
}

CALIBRATION_FILE = os.path.join(os.path.expanduser("~"), ".cache", "burst", "calibration.json")


def calibrated_local(path: str = CALIBRATION_FILE) -> Profile:
    """The `local` profile, with the measured FLOP/s and loopback bandwidth when a calibration exists."""
    base = PROFILES["local"]
    if not os.path.exists(path):
        return base
    measured = _read_calibration(path)
    return replace(
        base,
        flops=measured["flops"],
        intra_bw=measured["bandwidth"],
        inter_bw=measured["bandwidth"],
        intra_latency=measured.get("latency", base.intra_latency),
        inter_latency=measured.get("latency", base.inter_latency),
    )


def _read_calibration(path: str) -> dict:
    """The saved calibration; ValueError naming the file when it is not what `burst bench --calibrate` writes
    (positive FLOP/s and bandwidth, a latency >= 0 if any): a bad one had planned negative or infinite times."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"the calibration {path!r} cannot be read ({err}); run `burst bench --calibrate` again"
        ) from None
    positive = ("flops", "bandwidth")
    if not isinstance(measured, dict) or not all(_number(measured.get(k)) and measured[k] > 0 for k in positive):
        raise ValueError(
            f"the calibration {path!r} needs positive 'flops' and 'bandwidth', got {measured!r}; run `burst bench "
            "--calibrate` again"
        )
    if "latency" in measured and not (_number(measured["latency"]) and measured["latency"] >= 0):
        raise ValueError(f"the calibration {path!r} has latency {measured['latency']!r}, not seconds >= 0")
    return measured


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def profile(name: str) -> Profile:
    if name == "local":
        return calibrated_local()
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; known: {tuple(PROFILES)}")
    return PROFILES[name]
