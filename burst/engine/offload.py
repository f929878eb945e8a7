"""Memory moved to the host with the numbers unchanged: checkpointed layer inputs, and the optimizer.

ALST (arXiv 2506.13996) trains Llama-8B at 500K tokens on one H100 by moving to host memory what a
step keeps but does not compute with: the activation checkpoints between forward and backward, and
the fp32 master weights with Adam's moments. Both are here, each a copy to the host and back:

- `offloaded_checkpoint(run, x, cos, sin)`: a layer checkpointed at its input, the input kept in
  (pinned) host memory from the forward to the backward instead of on the device (the layer's
  other stored tensors, remat's attention output, follow it: checkpointing.StoredAttention). The
  backward copies the input back, re-runs the layer and back-propagates through it (the recompute
  torch.utils.checkpoint does, by hand, since that one keeps its inputs where they are).
- `HostAdamW`: AdamW whose fp32 master weights and two moments live in host memory; each
  parameter is stepped there the moment its gradient is complete in the backward (a
  post-accumulate-grad hook: gradient down, AdamW on the host, weights up), so no device gradient
  outlives its layer's backward and no host gradient buffer exists. The device keeps one copy of the
  weights in the compute dtype (bfloat16 weights under --dtype bfloat16: a 16 GB 8B model). Both
  copies cross PCIe in that dtype through one pinned buffer (`HostStaging`); on an H200 the first
  version (pageable float32 copies) spent 24.2 s a step on llama3-8b's host side, the staged one is
  not yet measured.

On the CPU both copies are copies within host memory, and the arithmetic is the very same
(torch.optim.AdamW over float32 tensors, the same layer ops): tests/test_train_memory.py holds every
step's loss and gradients equal to the run without them.
"""

from __future__ import annotations

import time

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned, copied without a sync, when t is on a GPU; a plain clone on the CPU)."""
    if t.device.type == "cpu":
        return t.detach().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=True)


class _OffloadedCheckpoint(torch.autograd.Function):
    """run(x, cos, sin) without autograd in the forward, its input kept on the host; the backward
    recomputes it under the forward's autocast and back-propagates through it (parameters' gradients
    accumulate there, as in a reentrant checkpoint)."""

    @staticmethod
    def forward(ctx, run, x, cos, sin):
        ctx.run, ctx.device, ctx.host = run, x.device, to_host(x)
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(cos, sin)
        with torch.no_grad():
            return run(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        x = ctx.host.to(ctx.device, non_blocking=True).detach().requires_grad_(True)
        ctx.host = None  # the host copy is no longer needed: free it before the recompute's memory
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
            out = ctx.run(x, cos, sin)
        torch.autograd.backward(out, grad)
        return None, x.grad, None, None


def offloaded_checkpoint(run, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """run(x, cos, sin) checkpointed at x, x held in host memory until the backward.

    x: (batch, seq, dim), the layer's input; cos, sin: rotary tables (no gradient)."""
    return _OffloadedCheckpoint.apply(run, x, cos, sin)


class HostStaging:
    """A device parameter's gradient to the host in float32, and float32 weights back, crossing PCIe in
    the parameter's own dtype through one pinned buffer: half the bytes of float32 for bf16, and
    pinned memory's DMA speed instead of a pageable copy's (`tensor.to("cpu", torch.float32)` converts
    on the device first and moves float32). The numbers are the plain copies': a cast rounds the same
    on either side. On the CPU (no device), the plain copies."""

    def __init__(self):
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def _staged(self, like: torch.Tensor) -> torch.Tensor:
        """The pinned buffer for `like`'s dtype, viewed as `like` (grown to the largest parameter seen)."""
        buffer = self._buffers.get(like.dtype)
        if buffer is None or buffer.numel() < like.numel():
            buffer = torch.empty(like.numel(), dtype=like.dtype, pin_memory=torch.cuda.is_available())
            self._buffers[like.dtype] = buffer
        return buffer[: like.numel()].view(like.shape)

    def gradient_to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """grad (any shape, on the device) -> a float32 host copy."""
        if grad.device.type == "cpu":
            return grad.to(torch.float32)
        staged = self._staged(grad)
        staged.copy_(grad)  # waits for the copy: the buffer is read next
        return staged.to(torch.float32)

    def weights_to_device(self, master: torch.Tensor, param: torch.Tensor) -> None:
        """param <- master (float32 on the host), rounded to param's dtype on the host."""
        if param.device.type == "cpu":
            param.data.copy_(master)
            return
        staged = self._staged(param)
        staged.copy_(master)
        # asynchronous: the next gradient_to_host's copy into this buffer runs on the same stream, after it
        param.data.copy_(staged, non_blocking=True)


class HostAdamW:
    """torch.optim.AdamW over fp32 master copies of `params` in host memory, each stepped as soon as
    its gradient is complete in the backward (see the module docstring).

    The training loop sets `param_groups[i]["lr"]` before the step's backward (the step happens
    inside it); `step()` has nothing left to do. `optimizer_s` accumulates the
    seconds spent in the host steps and their copies (the device is synchronized first, so the
    backward's own time is not counted), `reset_timer()` zeroes it."""

    def __init__(self, params, lr: float, weight_decay: float, compute_dtype: torch.dtype = torch.float32):
        self.params = list(params)
        on_gpu = any(p.device.type == "cuda" for p in self.params)
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        # a fused CPU kernel where the copies are real; on the CPU, the very AdamW of the run without offload
        self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, fused=True if on_gpu else None)
        self.param_groups = self.inner.param_groups
        self.staging = HostStaging()
        self.optimizer_s = 0.0
        for i, p in enumerate(self.params):
            if compute_dtype != p.dtype:
                p.data = p.data.to(compute_dtype)
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._step_one(i))

    def _step_one(self, i: int) -> None:
        p, master = self.params[i], self.master[i]
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        start = time.perf_counter()
        master.grad = self.staging.gradient_to_host(p.grad)
        p.grad = None
        self.inner.step()  # AdamW skips every parameter without a gradient: only this one moves
        master.grad = None
        self.staging.weights_to_device(master, p)
        self.optimizer_s += time.perf_counter() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Nothing left to do: every parameter with a gradient was stepped in the backward (one
        without is left as it is, as torch.optim.AdamW leaves it)."""

    def reset_timer(self) -> None:
        self.optimizer_s = 0.0

    def state_bytes(self) -> int:
        """Host bytes of the master weights and moments."""
        moments = sum(
            t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values() if torch.is_tensor(t)
        )
        return moments + sum(m.numel() * m.element_size() for m in self.master)
