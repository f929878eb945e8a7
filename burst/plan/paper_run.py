"""One measured figure of a paper as a `burst plan` configuration (Run), the record of
burst/plan/paper_runs.py's tables, and M and K, the token counts they are written in.
"""

from __future__ import annotations

from dataclasses import dataclass

M = 1 << 20
K = 1 << 10


@dataclass(frozen=True)
class Run:
    source: str
    label: str
    strategy: str
    gpus: int
    profile: str
    model: str
    seq_len: int
    metric: str  # tgs (tokens/s/GPU), step_s, prefill_s, mem_gb, fits, speedup, over_1gpu
    value: float
    group: str = ""  # runs whose time the paper compares (orderings)
    gpus_per_node: int = 8
    checkpointing: str = "remat"
    mode: str = "train"
    dp: int = 1
    fused_loss: bool = True
    fsdp: bool = True
    offload_optimizer: bool = False
    causal: bool = True
    layout: str = "zigzag"
    dtype_bytes: int | None = None
    inter_gbps: float | None = None
    intra_gbps: float | None = None
    attention_only: bool = False
    backward_overlap: bool = True  # False: LoongTrain's double ring (no backward overlap)
    counted: bool = True  # False: the same measurement printed again elsewhere, or an order only

    def argv(self) -> list[str]:
        """The `burst plan` flags of this configuration."""
        a = [
            "--gpus",
            str(self.gpus),
            "--gpus-per-node",
            str(self.gpus_per_node),
            "--profile",
            self.profile,
            "--model",
            self.model,
            "--seq-len",
            str(self.seq_len),
        ]
        if self.attention_only:
            a += ["--attention-only"] + (["--mode", "prefill"] if self.mode == "prefill" else [])
        else:
            a += ["--mode", "prefill"] if self.mode == "prefill" else ["--checkpointing", self.checkpointing]
            if self.dp > 1:
                a += ["--dp", str(self.dp)]
            if not self.fused_loss:
                a += ["--unfused-loss"]
            if not self.fsdp:
                a += ["--no-fsdp"]
            if self.offload_optimizer:
                a += ["--offload-optimizer"]
            if not self.backward_overlap:
                a += ["--no-backward-overlap"]
        if self.causal:
            a += ["--causal"]
        if self.layout != "zigzag":
            a += ["--layout", self.layout]
        if self.dtype_bytes:
            a += ["--dtype-bytes", str(self.dtype_bytes)]
        if self.inter_gbps:
            a += ["--inter-node-gbps", f"{self.inter_gbps:g}"]
        if self.intra_gbps:
            a += ["--intra-node-gbps", f"{self.intra_gbps:g}"]
        return a
