"""`burst train`'s settings (TrainConfig): each option's default, and the checks a run would otherwise
hit only after starting, made before any process starts (every rank would raise alike), with how a
token file stores its ids (token_dtype, token_count), which --data's check reads. The loop that runs
them is engine/train.py's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..layout import local_multiple
from .checkpointing import check_settings
from .model import PRESETS
from .parallel import check_dp, check_sharding

SPLIT_WITHOUT_SELECTIVE = "--checkpoint-split: the share `--checkpointing selective` recomputes: give that too"
TRAIN_DTYPES = ("float32", "bfloat16")  # bfloat16 as autocast; float16 would need loss scaling


@dataclass
class TrainConfig:
    model: str = "tiny"
    seq_len: int = 1024
    batch: int = 1  # sequences per data-parallel replica per step
    steps: int = 4
    seed: int = 0
    data: str = "synthetic"
    strategy: str = "burst"
    layout: str = "zigzag"
    lr: float = 3e-3
    warmup: int = 2
    weight_decay: float = 0.1
    metrics: str | None = None
    peak_flops: float = 0.0  # per device, for MFU; 0 = unknown: mfu is None (n/a)
    dp: int = 1  # data-parallel replicas; sequence-parallel ranks = world / dp
    fsdp: str = "none"  # none | dp | mesh (engine/parallel.py)
    cpu_offload: bool = False
    offload_activations: bool = False  # what checkpointing keeps, in host memory (engine/offload.py)
    offload_layers: int = 0  # with offload_activations: the first N layers' only (0: every layer's)
    offload_optimizer: bool = False  # AdamW's master weights and moments in host memory, stepped there
    checkpointing: str = "none"  # none | full | remat | selective (engine/checkpointing.py)
    checkpoint_split: float = 0.5  # the fraction of the sequence `selective` recomputes
    ffn_chunk: int = 0  # blockwise feedforward: tokens per chunk, 0 = off
    fused_loss: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume_step: int | None = None
    keep: int = 0  # checkpoints kept (the newest; 0 = all), older ones deleted once a new one is complete
    progress: bool = True
    device: str = "auto"  # auto | cpu | cuda (devices.resolve_device: auto = cuda when every local rank has a GPU)
    # float32 | bfloat16 (any spelling devices.DTYPE_ALIASES reads: fp32, bf16): bfloat16 runs as autocast,
    # weights, gradients and optimizer state stay float32
    dtype: str = "float32"

    def check(self, world: int) -> None:
        """Errors a run would otherwise hit only after starting (every rank raises alike), before any
        process starts. Each ValueError names its command-line option first: "--dp: ...".
        """
        self._check_values()
        check_dp(self.dp, world)
        sp = world // self.dp
        need = sp * local_multiple(self.layout)
        if self.seq_len % need:
            raise ValueError(
                f"--seq-len: {self.seq_len} does not split over {sp} sequence-parallel ranks with "
                f"layout {self.layout!r} (use a multiple of {need})"
            )
        preset = PRESETS[self.model]
        if self.seq_len > preset.max_seq_len:
            raise ValueError(f"--seq-len: {self.seq_len} exceeds model {self.model!r}'s {preset.max_seq_len} positions")
        self._check_attention(sp, preset)
        self._check_device(world)
        self._check_data(preset.vocab_size)
        try:
            check_sharding(self.fsdp, self.cpu_offload)
        except ValueError as err:
            option = "--cpu-offload" if str(err).startswith("--cpu-offload") else "--fsdp"
            raise ValueError(f"{option}: {str(err).removeprefix(option + ' ')}") from None
        self._check_offload(world)
        if self.resume_step is not None:
            from .resume import check_resumable

            check_resumable(self)

    def _check_values(self) -> None:
        """Each setting on its own."""
        if self.model not in PRESETS:
            raise ValueError(f"--model: unknown preset {self.model!r} (presets: {', '.join(PRESETS)})")
        for option, value in (("--steps", self.steps), ("--batch", self.batch), ("--seq-len", self.seq_len)):
            if value < 1:
                raise ValueError(f"{option}: must be at least 1, got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr: must be a positive number, got {self.lr}")
        for option, value in (
            ("--warmup", self.warmup),
            ("--peak-flops", self.peak_flops),
            ("--checkpoint-every", self.checkpoint_every),
            ("--ffn-chunk", self.ffn_chunk),
            ("--offload-layers", self.offload_layers),
            ("--keep", self.keep),
            ("weight_decay", self.weight_decay),
        ):
            if not value >= 0:
                raise ValueError(f"{option}: must be 0 or more, got {value}")
        for option, settings in (
            ("--checkpointing", (self.checkpointing, 0.5, 0)),
            ("--checkpoint-split", ("none", self.checkpoint_split, 0)),
        ):
            try:
                check_settings(*settings)
            except ValueError as err:
                raise ValueError(f"{option}: {err}") from None
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every: needs --checkpoint-dir (where to write them)")
        if self.keep and not self.checkpoint_dir:
            raise ValueError("--keep: needs --checkpoint-dir (whose checkpoints it keeps)")
        if self.checkpoint_split != 0.5 and self.checkpointing != "selective":
            raise ValueError(SPLIT_WITHOUT_SELECTIVE)

    def _check_offload(self, world: int) -> None:
        if self.offload_activations and self.checkpointing == "none":
            raise ValueError(
                "--offload-activations: moves what checkpointing keeps: give --checkpointing full, remat or selective"
            )
        if self.offload_activations and self.fsdp != "none":
            raise ValueError("--offload-activations: runs without FSDP (--fsdp none)")
        if self.offload_layers and not self.offload_activations:
            raise ValueError("--offload-layers: how many layers --offload-activations moves: give it too")
        if self.offload_layers > PRESETS[self.model].layers:
            raise ValueError(
                f"--offload-layers: {self.offload_layers} exceeds the {PRESETS[self.model].layers} layers of "
                f"model {self.model!r}"
            )
        if self.offload_optimizer and (world > 1 or self.fsdp != "none"):
            raise ValueError(
                "--offload-optimizer: one rank without FSDP; on several ranks use --fsdp dp|mesh "
                "--cpu-offload (FSDP2's offload)"
            )
        if self.offload_optimizer and self.checkpoint_dir:
            raise ValueError("--offload-optimizer: checkpoints (--checkpoint-dir) do not save its host state yet")

    def memory_options(self) -> dict:
        """Which memory options this run uses (each step's metrics say it)."""
        return {
            "checkpointing": self.checkpointing,
            "ffn_chunk": self.ffn_chunk,
            "fused_loss": self.fused_loss,
            "offload_activations": self.offload_activations,
            "offload_layers": self.offload_layers,
            "offload_optimizer": self.offload_optimizer,
            "fsdp": self.fsdp,
            "fsdp_cpu_offload": self.cpu_offload,
        }

    def _check_device(self, world: int) -> None:
        from ..devices import DTYPES, canonical_dtype, check_dtype, dtype_listing, local_ranks, resolve_device

        device = resolve_device(self.device, local_ranks(world))
        name = canonical_dtype(self.dtype)  # any spelling --dtype takes ("bf16" as "bfloat16")
        if name not in TRAIN_DTYPES:
            why = ": float16 would need loss scaling, which burst train does not do" if name == "float16" else ""
            raise ValueError(
                f"--dtype: training takes {dtype_listing(TRAIN_DTYPES)} (bfloat16 as autocast), not {self.dtype!r}{why}"
            )
        check_dtype(DTYPES[name], device)

    def _check_attention(self, sp: int, preset) -> None:
        """The strategy takes the model's causal attention in this layout (burst.attention's checks)."""
        from ..plan.takes import check_call

        try:
            check_call(
                sp,
                self.seq_len,
                preset.heads,
                preset.kv_heads,
                preset.head_dim,
                strategy=self.strategy,
                layout=self.layout,
                batch=self.batch,
                causal=True,
            )
        except (ValueError, TypeError) as err:
            raise ValueError(f"--strategy: {err}") from None

    def _check_data(self, vocab: int) -> None:
        if self.data == "synthetic":
            return
        if not os.path.isfile(self.data):
            raise ValueError(f"--data: {self.data!r} is not a file (a token file, a text file, or 'synthetic')")
        count = token_count(self.data)
        if count < self.seq_len + 1:  # also an empty file, which numpy cannot map
            raise ValueError(
                f"--data: {self.data!r} holds {count} tokens, fewer than --seq-len + 1 = "
                f"{self.seq_len + 1} (a longer file, or a shorter --seq-len)"
            )
        try:
            largest = int(np.memmap(self.data, dtype=token_dtype(self.data), mode="r").max())
        except ValueError as err:  # numpy's words: a .bin whose size is not whole ids
            raise ValueError(
                f"--data: {self.data!r} cannot be read as token ids ({err}); a .bin file holds uint16 ids "
                "(2 bytes each), a .u32.bin uint32 (4), any other file bytes"
            ) from None
        check_token_ids(self.data, largest, vocab)  # one read of the file before any rank starts


def check_token_ids(path: str, largest: int, vocab: int) -> None:
    if largest >= vocab:
        raise ValueError(f"--data: {path!r} has token ids up to {largest}, beyond the model's vocabulary of {vocab}")


def token_dtype(path: str):
    """How a token file stores its ids: .u32.bin uint32, other .bin uint16, anything else bytes."""
    if path.endswith(".u32.bin"):
        return np.uint32
    return np.uint16 if path.endswith(".bin") else np.uint8


def token_count(path: str) -> int:
    return os.path.getsize(path) // np.dtype(token_dtype(path)).itemsize
