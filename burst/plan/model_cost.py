"""Whole-model cost: one training step (or one prefill) of a LLaMA-style decoder, per device.

Units: seconds, bytes. The model runs on `gpus` devices: `dp` data-parallel replicas of a
sequence-parallel group of sp = gpus / dp devices; each replica takes `batch` sequences of
`seq_len` tokens, split over its group by `strategy` (cost.py models that attention). FSDP (ZeRO-3)
shards weights, gradients and optimizer state over all `gpus` devices.

Time, per device:

- matmuls (projections, SwiGLU FFN, LM head): 2 FLOPs per weight per token forward, twice that
  backward, at GEMM_SHARE_OF_PEAK of the profile's peak; attention's FLOPs and ring come from
  cost.estimate (one formula: cost.attention_flops);
- checkpointing recomputes in the backward (engine/checkpointing.py's modes, same names): `full`
  the whole layer (attention's forward and its ring too), `remat` the matmuls only, `selective`
  the matmuls plus attention over the first `split` of the sequence (split² of causal work);
- overlap as it is: every second a transfer runs under compute slows that compute by CONTENTION
  seconds (NCCL kernels take SMs and HBM bandwidth); FSDP's gathers and reduce-scatters use the
  links only while attention's ring leaves them idle, the rest is exposed; each layer's forward,
  backward and recompute end in a wait for the slowest rank (LAYER_SYNC_S); the step ends with the
  gradient-norm all-reduce and the optimizer (STEP_SYNC_S plus Adam's HBM traffic, or the PCIe
  round trip and host Adam when the optimizer is offloaded).

Memory, per device (the peak the allocator hands out; `fits` adds FRAMEWORK_RESERVE_BYTES):
weights + gradients + Adam state / gpus (FSDP), two gathered layers and the gathered embedding or
LM head, the activations each checkpointing mode keeps for every layer, one layer's full
activations during its backward, the attention strategy's own buffers for one layer
(cost.estimate), and the LM head's logits (unfused) or one chunk of them (fused loss).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost import Cluster, Estimate, Workload, estimate
from .flops import DENSE_BF16_PEAK
from .models import check_dp, model_presets

# --- constants: one value for every paper and profile; each a physical quantity ---
GEMM_SHARE_OF_PEAK = 0.70  # share of dense peak that large bf16 GEMMs sustain (cuBLAS on A100/H100)
ATTENTION_SHARE_OF_PEAK = 0.60  # profiles.py's flash-attention share: peak = profile.flops / this, for a
# device without a datasheet peak in flops.DENSE_BF16_PEAK
CONTENTION = 0.15  # compute seconds lost per second of transfer running under it
LAYER_SYNC_S = 3e-3  # per layer and pass: launch gaps and the wait for the slowest rank
STEP_SYNC_S = 0.05  # per step: gradient-norm all-reduce, optimizer launch, data
HBM_BYTES_PER_S = 1.6e12  # device memory bandwidth the optimizer's elementwise kernels reach
HOST_LINK_BYTES_PER_S = 12e9  # PCIe 4.0 x16 per device, one direction, as DMA reaches it
HOST_ADAM_PARAMS_PER_S = 0.37e9  # host Adam updates/s for one device's shard: llama3-8b's 24.2 s on an H200 host
# (16 cores; benchmarks/gpu/h200_llama3_8b_run1.md), less its PCIe share
ADAM_STATE_BYTES = 12  # fp32 master weights, first and second moments
FUSED_LOSS_CHUNK = 4096  # tokens of logits the fused LM head + loss holds at once
FRAMEWORK_RESERVE_BYTES = 3 * 2**30  # CUDA context, NCCL buffers, allocator fragmentation
HOST_RESERVE_BYTES = 8 * 2**30  # the process on the host: Python, torch, CUDA's host side, pinned staging

MODES = ("train", "prefill")
CHECKPOINTING = ("none", "full", "remat", "selective")


def model_config(name: str):
    presets = model_presets()
    if name not in presets:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(presets)}")
    return presets[name]


@dataclass(frozen=True)
class Training:
    """What one step runs. model: a burst.engine.model.ModelConfig."""

    model: object
    seq_len: int
    batch: int = 1  # sequences per data-parallel replica
    dp: int = 1  # data-parallel replicas; sp = gpus / dp
    mode: str = "train"  # train | prefill
    checkpointing: str = "none"  # none | full | remat | selective (burst train's default)
    split: float = 0.5  # selective: share of the sequence whose attention is recomputed
    fused_loss: bool = True  # LM head + loss a chunk of tokens at a time
    fsdp: bool = True  # shard weights, gradients, optimizer state over all devices
    offload_optimizer: bool = False  # Adam state and step on the host
    causal: bool = True
    layout: str = "zigzag"
    dtype_bytes: int | None = None  # default: the profile's
    backward_overlap: bool = True  # False: the backward's ring transfers wait (LoongTrain's double ring)
    # burst train's host offloads (engine/offload.py) and blockwise feedforward:
    optimizer_in_backward: bool = False  # with offload_optimizer: each parameter stepped on the host as its
    #                                      gradient completes (HostAdamW): one layer's gradients on the device
    offload_activations: bool = False  # what checkpointing keeps per layer, in host memory (copied each way)
    offload_layers: int = 0  # with offload_activations: the first N layers' only (0: every layer's)
    ffn_chunk: int = 0  # the SwiGLU a chunk of tokens at a time (0: whole)
    host_memory_bytes: float | None = None  # host memory that decides fits (None: not checked)

    def check(self, gpus: int) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {MODES}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing {self.checkpointing!r}: one of {CHECKPOINTING}")
        check_dp(self.dp, gpus)
        if self.offload_activations and self.checkpointing == "none":
            raise ValueError("offload_activations moves what checkpointing keeps: needs a checkpointing mode")
        if self.offload_layers < 0 or (self.offload_layers and not self.offload_activations):
            raise ValueError(f"offload_layers={self.offload_layers}: 0 or more, with offload_activations")

    @property
    def offloaded_layers(self) -> int:
        """How many layers keep their checkpoints in host memory (the first ones)."""
        if self.mode != "train" or not self.offload_activations:
            return 0
        return min(self.offload_layers, self.model.layers) if self.offload_layers else self.model.layers


def layer_weights(m) -> int:
    """Matmul weights of one decoder layer (q, k, v, o projections and the SwiGLU FFN)."""
    return m.dim * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 3 * m.dim * m.ffn_dim


def activation_bytes_per_token(m, checkpointing: str, dtype_bytes: int, split: float = 0.5) -> float:
    """Bytes one layer keeps per token from its forward to its backward (engine/checkpointing.py)."""
    d, kv, f, b = m.dim, m.kv_heads * m.head_dim, m.ffn_dim, dtype_bytes
    lse = 4 * m.heads
    if checkpointing == "none":
        # input, norm out, q, k, v, attention out (+lse), residual, FFN norm out, w1, w3, silu, product
        return b * (6 * d + 2 * kv + 4 * f) + lse
    if checkpointing == "full":
        return b * d
    if checkpointing == "remat":
        return 2 * b * d + lse
    return b * d + (1 - split) * (b * d + lse)  # selective: attention output of the later part only


def whole_model(strategy: str, cluster: Cluster, t: Training, memory_bytes: float | None = None) -> Estimate:
    """The cost of one step of `t` with attention by `strategy`: an Estimate whose wall_s and
    mem_bytes_per_device are the whole model's; extra holds step_s, tokens_per_s_per_device and
    the attention-only figures."""
    t.check(cluster.gpus)
    m, p = t.model, cluster.profile
    b = t.dtype_bytes or p.dtype_bytes
    sp = cluster.gpus // t.dp
    sp_cluster = replace(cluster, gpus=sp, gpus_per_node=min(sp, cluster.gpus_per_node))
    train = t.mode == "train"
    attn_w = Workload(
        seq_len=t.seq_len,
        heads=m.heads,
        head_dim=m.head_dim,
        kv_heads=m.kv_heads,
        batch=t.batch,
        layers=m.layers,
        causal=t.causal,
        dtype_bytes=b,
        layout=t.layout,
        forward_only=not train,
    )
    attn = estimate(strategy, sp_cluster, attn_w)
    fwd_only = estimate(strategy, sp_cluster, replace(attn_w, forward_only=True))
    one_layer = estimate(strategy, sp_cluster, replace(attn_w, layers=1))

    tokens = t.batch * t.seq_len / sp  # per device
    peak = DENSE_BF16_PEAK.get(p.name, p.flops / ATTENTION_SHARE_OF_PEAK)
    gemm_rate = peak * GEMM_SHARE_OF_PEAK * (2 / b if b > 2 else 1)
    layer_fwd = 2 * layer_weights(m) * tokens * m.layers / gemm_rate
    head_fwd = 2 * m.dim * m.vocab_size * tokens / gemm_rate
    # attention: cost.estimate's wall (ring overlap inside), plus what checkpointing recomputes
    recompute_attn = (
        {"full": fwd_only.wall_s, "selective": fwd_only.compute_s * t.split**2}.get(t.checkpointing, 0.0)
        if train
        else 0.0
    )
    if train and not t.backward_overlap:  # every backward transfer waits for its compute to end
        attn.wall_s += (attn.comm_s - attn.exposed_comm_s) - (fwd_only.comm_s - fwd_only.exposed_comm_s)
    recompute_layers = layer_fwd if train and t.checkpointing != "none" else 0.0
    if train and t.ffn_chunk and tokens > t.ffn_chunk:  # each chunk's SwiGLU runs once more in the backward
        recompute_layers += 2 * 3 * m.dim * m.ffn_dim * tokens * m.layers / gemm_rate
    passes = (3 if t.checkpointing != "none" else 2) if train else 1
    matmul = (3 if train else 1) * (layer_fwd + head_fwd) + recompute_layers
    kept_per_layer = activation_bytes_per_token(m, t.checkpointing, b, t.split) * tokens if train else 0.0
    # offloaded checkpoints: down in the forward, up in the backward, on the compute stream (not hidden)
    offload_s = 2 * kept_per_layer * t.offloaded_layers / HOST_LINK_BYTES_PER_S

    # FSDP: each layer's weights gathered for the forward and again for the backward, gradients
    # reduce-scattered; prefill gathers once. Ring collectives over all devices.
    g, per_node = cluster.gpus, min(cluster.gpus, cluster.gpus_per_node)
    shard = g if t.fsdp else 1
    weights = layer_weights(m) * m.layers + 2 * m.vocab_size * m.dim
    fsdp_s = 0.0
    if t.fsdp and g > 1:
        volume = weights * b * (3 if train else 1) * (g - 1) / g
        fsdp_s = max(cluster.t_intra(volume), cluster.t_inter(volume / per_node) if cluster.nodes > 1 else 0.0)
        fsdp_s += (3 if train else 1) * m.layers * (g - 1) * (p.inter_latency if cluster.nodes > 1 else p.intra_latency)
    compute = matmul + attn.compute_s + recompute_attn
    busy_links = attn.comm_s + (fwd_only.comm_s if t.checkpointing == "full" and train else 0.0)
    wall_no_fsdp = matmul + attn.wall_s + recompute_attn
    # FSDP overlaps layer by layer (the next layer's gather under this layer's compute): per pass,
    # each layer's collectives hide behind that layer's time minus its own ring's link time.
    collectives = 3 if train else 1
    per_collective = fsdp_s / collectives / m.layers if m.layers else 0.0
    fwd_layer = (layer_fwd + fwd_only.wall_s) / m.layers  # one layer's forward
    fwd_idle = max(0.0, fwd_layer - fwd_only.comm_s / m.layers)
    exposed_fsdp = m.layers * max(0.0, per_collective - fwd_idle)
    if train:  # one layer's backward (recompute included): the step less every forward and the LM head
        bwd_layer = (wall_no_fsdp - fwd_layer * m.layers - 3 * head_fwd) / m.layers
        bwd_idle = max(0.0, bwd_layer - (busy_links - fwd_only.comm_s) / m.layers)
        exposed_fsdp += m.layers * max(0.0, 2 * per_collective - bwd_idle)  # a gather and a reduce-scatter
    hidden = (busy_links - attn.exposed_comm_s) + (fsdp_s - exposed_fsdp)
    sync = passes * m.layers * LAYER_SYNC_S + (STEP_SYNC_S if train else 0.0)
    optimizer = 0.0
    if train:
        local = weights / shard
        if t.offload_optimizer and t.optimizer_in_backward:  # on the host while the backward runs (HostAdamW)
            host = 2 * local * b / HOST_LINK_BYTES_PER_S + local / HOST_ADAM_PARAMS_PER_S
            backward = wall_no_fsdp - fwd_layer * m.layers - head_fwd
            optimizer = max(host / max(1, m.layers), host - backward)  # what outlasts it, the last layer's at least
        elif t.offload_optimizer:  # gradients down and weights up at once over PCIe, then host Adam
            optimizer = local * b / HOST_LINK_BYTES_PER_S + local / HOST_ADAM_PARAMS_PER_S
        else:  # Adam reads and writes its state, the weights and the gradients once
            optimizer = local * 2 * (ADAM_STATE_BYTES + 2 * b) / HBM_BYTES_PER_S
    step = wall_no_fsdp + exposed_fsdp + CONTENTION * min(hidden, compute) + sync + optimizer + offload_s

    # memory
    grads = b if train and not (t.offload_optimizer and t.optimizer_in_backward) else 0
    # fp32 runs: the weights are the master copy, Adam adds its two moments
    adam = 0 if not train or t.offload_optimizer else (ADAM_STATE_BYTES if b <= 2 else 8)
    state = weights * (b + grads + adam) / shard
    if train and not grads:  # stepped in the backward: one layer's gradients (or the LM head's) at a time
        state += max(layer_weights(m), m.vocab_size * m.dim) * b
    gathered = (2 * layer_weights(m) + m.vocab_size * m.dim) * b if t.fsdp else 0.0
    # a prefill keeps nothing between layers
    # offloaded: the layer being copied and the next (its copy waits on the stream) stay on the device
    kept = kept_per_layer * (m.layers - t.offloaded_layers + min(2, t.offloaded_layers))
    working = activation_bytes_per_token(m, "none", b) * tokens
    if t.ffn_chunk and tokens > t.ffn_chunk:  # the SwiGLU's four ffn-wide tensors of one chunk, not of every token
        working -= 4 * m.ffn_dim * b * (tokens - t.ffn_chunk)
    attn_buffers = one_layer.mem_bytes_per_device
    # unfused: the logits in the model's dtype, their gradient written over them (BurstEngine Table
    # 2's unfused-to-fused step: 7.5 GB for 32K x 120K logits; engine/loss.py's unfused baseline also
    # keeps an fp32 log-softmax, twice that); fused: one fp32 chunk; a prefill: the last token's
    logits = (
        (min(tokens, FUSED_LOSS_CHUNK) * 4 if t.fused_loss else tokens * b) * m.vocab_size
        if train
        else m.vocab_size * 4 * t.batch
    )
    mem = state + gathered + kept + working + attn_buffers + logits
    capacity = memory_bytes or p.memory_bytes
    est = Estimate(
        strategy,
        compute_s=compute,
        comm_s=busy_links + fsdp_s,
        exposed_comm_s=step - compute,
        wall_s=step,
        mem_bytes_per_device=mem,
        inter_node_bytes_per_device=attn.inter_node_bytes_per_device,
        intra_node_bytes_per_device=attn.intra_node_bytes_per_device,
        fits=attn.fits,
        note=attn.note,
    )
    if not attn.fits and "does not fit" in attn.note:
        est.fits, est.note = True, attn.note.replace("does not fit in device memory", "").strip("; ")
    if mem + FRAMEWORK_RESERVE_BYTES > capacity:
        est.fits = False
        est.note = (est.note + "; " if est.note else "") + "does not fit in device memory"
    host = host_bytes(t, weights / shard, kept_per_layer * t.offloaded_layers)
    if t.host_memory_bytes is not None and host > t.host_memory_bytes:
        est.fits = False
        est.note = (est.note + "; " if est.note else "") + "does not fit in host memory"
    est.extra = {
        **attn.extra,
        "scope": "whole model",
        "step_s": step,
        "tokens_per_s_per_device": tokens / step,
        "attention_wall_s": attn.wall_s,
        "attention_mem_bytes_per_device": attn.mem_bytes_per_device,
        "host_mem_bytes": host,
        "optimizer_s": optimizer,
        "memory": {
            "states": state,
            "gathered_weights": gathered,
            "kept_activations": kept,
            "layer_working": working,
            "attention_buffers": attn_buffers,
            "logits": logits,
        },
        "time": {
            "matmul": matmul,
            "attention": attn.wall_s,
            "recompute_attention": recompute_attn,
            "fsdp_exposed": exposed_fsdp,
            "contention": CONTENTION * min(hidden, compute),
            "sync": sync,
            "optimizer": optimizer,
            "offload": offload_s,
        },
    }
    return est


def host_bytes(t: Training, local_weights: float, offloaded: float) -> float:
    """Host memory one device's process needs: HOST_RESERVE_BYTES, AdamW's fp32 masters and moments
    (and one fp32 gradient) when offloaded, and the `offloaded` bytes of checkpoints."""
    host = HOST_RESERVE_BYTES
    if t.mode == "train" and t.offload_optimizer:
        host += local_weights * ADAM_STATE_BYTES + max(layer_weights(t.model), t.model.vocab_size * t.model.dim) * 4
    return host + offloaded


def attention_step(strategy: str, cluster: Cluster, w: Workload) -> Estimate:
    """Attention alone under the same overlap terms as whole_model: cost.estimate's time plus
    CONTENTION on the hidden transfers and LAYER_SYNC_S per layer and pass (`burst plan` without
    a model, and strategy="auto")."""
    est = estimate(strategy, cluster, w)
    hidden = est.comm_s - est.exposed_comm_s
    est.wall_s += CONTENTION * min(hidden, est.compute_s) + (1 if w.forward_only else 2) * w.layers * LAYER_SYNC_S
    tokens = w.batch * w.seq_len / cluster.gpus
    est.extra = {
        **est.extra,
        "step_s": est.wall_s,
        "tokens_per_s_per_device": tokens / est.wall_s if est.wall_s else 0.0,
    }
    return est
