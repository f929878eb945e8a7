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
  parameter is stepped there once its gradient is complete in the backward (a post-accumulate-grad
  hook: gradient down, AdamW on the host, weights up), so no device gradient outlives its layer's
  backward and no host gradient buffer exists. The host steps run on a thread of their own and the
  copies on a stream of their own, in the compute dtype through pinned buffers (`HostStaging`), so the
  backward goes on meanwhile; `step()` waits for the last of them. The device keeps one copy of the
  weights in the compute dtype (bfloat16 weights under --dtype bfloat16: a 16 GB 8B model). On an
  H200 the first version (each step in the hook, the device synchronized, pageable float32 copies)
  spent 24.2 s a step on llama3-8b's host side; this one is not yet measured on a GPU.

On the CPU both copies are copies within host memory, and the arithmetic is the very same
(torch.optim.AdamW over float32 tensors, the same layer ops): tests/test_train_memory.py holds every
step's loss and gradients equal to the run without them.
"""

from __future__ import annotations

import queue
import threading
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
    """A device parameter's gradient to the host and its new weights back, crossing PCIe in the
    parameter's own dtype through pinned buffers on a stream of their own, so that the backward goes on
    meanwhile: half the bytes of float32 for bf16, and pinned memory's DMA speed (`tensor.to("cpu",
    torch.float32)`, the first version's, converts on the device and copies float32 from pageable
    memory). The host rounds the weights as the device would. On the CPU, plain copies.

    POOL buffers, each as large as the largest parameter, are taken by a gradient on its way down and
    given back once its weights are up: a backward that outruns the host waits for one (and that wait
    counts as the optimizer's, HostAdamW.optimizer_s)."""

    POOL = 3

    def __init__(self, params: list):
        device = params[0].device if params else torch.device("cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.free: queue.Queue = queue.Queue()
        if self.stream is not None:
            largest = max(p.numel() * p.element_size() for p in params)
            for _ in range(self.POOL):
                self.free.put(torch.empty(largest, dtype=torch.uint8, pin_memory=True))

    def gradient_down(self, grad: torch.Tensor) -> "_Down":
        """Start grad's copy to the host (after the work that made it); its float32 value is
        `.wait()`'s. The caller may drop grad at once."""
        if self.stream is None:
            return _Down(grad.to(torch.float32), None, None, None)
        made = torch.cuda.current_stream(grad.device).record_event()
        buffer = self.free.get()
        staged = buffer[: grad.numel() * grad.element_size()].view(grad.dtype).view(grad.shape)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(made)
            staged.copy_(grad, non_blocking=True)
            grad.record_stream(self.stream)  # its memory is not reused before the copy has read it
            arrived = self.stream.record_event()
        return _Down(None, staged, buffer, arrived)

    def weights_up(self, master: torch.Tensor, param: torch.Tensor, down: "_Down") -> None:
        """param <- master (float32 on the host), rounded to param's dtype on the host, through down's
        buffer (its gradient already read); the buffer is free again once the copy is done."""
        if self.stream is None:
            param.data.copy_(master)
            return
        try:
            down.staged.copy_(master)
            with torch.cuda.stream(self.stream):
                param.data.copy_(down.staged, non_blocking=True)
                self.stream.record_event().synchronize()
        finally:
            self.release(down)

    def release(self, down: "_Down") -> None:
        """down's buffer is free again (a step that ends without its weights going up)."""
        if down.buffer is not None:
            self.free.put(down.buffer)

    def before_next_use(self) -> None:
        """The device's current stream waits for every weight copied up so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class _Down:
    """A gradient on its way to the host (HostStaging.gradient_down)."""

    def __init__(self, value, staged, buffer, arrived):
        self.value, self.staged, self.buffer, self.arrived = value, staged, buffer, arrived

    def wait(self) -> torch.Tensor:
        """The gradient in float32 on the host, once its copy has arrived."""
        if self.arrived is not None:
            self.arrived.synchronize()
            return self.staged.to(torch.float32)
        return self.value


class _HostWorker:
    """One thread running the host's steps in the order they were queued; an error is kept and raised
    by drain() (the steps after it are skipped, their buffers given back)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="burst-host-adamw", daemon=True).start()

    def _run(self):
        while True:
            job, on_skip = self.jobs.get()
            try:
                if self.error is None:
                    job()
                else:
                    on_skip()
            except BaseException as err:  # noqa: BLE001 - handed to the training loop by drain()
                self.error = err
            finally:
                self.jobs.task_done()

    def submit(self, job, on_skip) -> None:
        self.jobs.put((job, on_skip))

    def drain(self) -> None:
        self.jobs.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("a host optimizer step failed") from error


class HostAdamW:
    """torch.optim.AdamW over fp32 master copies of `params` in host memory, each stepped on the host
    as soon as its gradient is complete in the backward, while the backward goes on (see the module
    docstring).

    The training loop sets `param_groups[i]["lr"]` before the step's backward (the steps happen
    during it); `step()` waits for the last of them and makes the device wait for their weights.
    `optimizer_s` accumulates the seconds the backward waited for a free transfer buffer (the
    optimizer's share of the step outside step() itself), `reset_timer()` zeroes it."""

    def __init__(self, params, lr: float, weight_decay: float, compute_dtype: torch.dtype = torch.float32):
        self.params = list(params)
        on_gpu = any(p.device.type == "cuda" for p in self.params)
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        # a fused CPU kernel where the copies are real; on the CPU, the very AdamW of the run without offload
        self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, fused=True if on_gpu else None)
        self.param_groups = self.inner.param_groups
        for i, p in enumerate(self.params):
            if compute_dtype != p.dtype:
                p.data = p.data.to(compute_dtype)
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._gradient_ready(i))
        self.staging = HostStaging(self.params)
        self.worker = _HostWorker()
        self.optimizer_s = 0.0

    def _gradient_ready(self, i: int) -> None:
        """Parameter i's gradient is complete: its copy down starts and its host step is queued."""
        start = time.perf_counter()
        down = self.staging.gradient_down(self.params[i].grad)
        self.params[i].grad = None
        self.optimizer_s += time.perf_counter() - start
        self.worker.submit(lambda: self._host_step(i, down), lambda: self.staging.release(down))

    def _host_step(self, i: int, down: _Down) -> None:
        master = self.master[i]
        try:
            master.grad = down.wait()
            self.inner.step()  # AdamW skips every parameter without a gradient: only this one moves
        except BaseException:
            self.staging.release(down)
            raise
        finally:
            master.grad = None
        self.staging.weights_up(master, self.params[i], down)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Wait for the host steps the backward queued (every parameter with a gradient; one without
        is left as it is, as torch.optim.AdamW leaves it) and make the device wait for their weights."""
        self.worker.drain()
        self.staging.before_next_use()

    def reset_timer(self) -> None:
        self.optimizer_s = 0.0

    def state_bytes(self) -> int:
        """Host bytes of the master weights and moments."""
        moments = sum(
            t.numel() * t.element_size() for s in self.inner.state.values() for t in s.values() if torch.is_tensor(t)
        )
        return moments + sum(m.numel() * m.element_size() for m in self.master)
