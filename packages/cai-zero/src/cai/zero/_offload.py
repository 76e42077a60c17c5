"""The host half of ``cpu_offload=True``: gradient landing buffers, the CPU optimizer step, the copy back.

[Note: offload pipeline]
Each reduced gradient shard is copied device-to-host (pinned, asynchronous, on the stream that reduced it) into a
per-bucket landing buffer that becomes the master shard's ``.grad`` as is (bf16 stays bf16: cai.kernels' CPU Adam
reads low-precision gradients directly, so there is no host upcast pass). With a cai.kernels Adam the step runs
bucket by bucket through ``adam_update(..., out=pinned working-dtype buffer)``, which writes the new parameters,
already cast, in the same pass; bucket i's host-to-device copy and all-gather then overlap bucket i+1's CPU step.
With ``overlap_cpu_step`` each bucket's CPU step starts on cai.kernels' ``HostStepper`` worker as soon as its
gradient has landed, i.e. during backward, and starts its host-to-device copy on the stepper's side stream (see
[Note: host Adam stepper] in cai-kernels); ``step()`` then only orders the compute stream after those copies and
all-gathers. Backward reduces the last buckets first, so every copy but the last bucket's hides behind the CPU
steps still running. Collectives are issued on the main thread only, so every rank keeps the same collective order.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from cai.kernels.optim import CPUAdam, HostStepper, accumulate_grad_shard, adam_state, adam_step, adamw_mode
from cai.zero._bucket import Bucket


class HostOffload:
    """Host masters' gradients, steps and copies back for ``optim`` (stepping the buckets' master shards).

    ``overlap``: step each bucket on the worker during backward; ``scaled``: an fp16 loss scale is in use.
    """

    def __init__(
        self, optim: torch.optim.Optimizer, *, device: torch.device, overlap: bool, scaled: bool
    ) -> None:
        self.optim = optim
        self.device = device
        self.cuda = device.type == "cuda"
        # our own bucket-wise step with the copy-out fused in; other optimizers run their own step() on the host
        self.fast = isinstance(optim, CPUAdam)
        if overlap and (not self.fast or scaled):
            raise ValueError(
                "ZeroOptimizer: overlap_cpu_step=True needs cai.kernels.optim.CPUAdam/HybridAdam and bf16/fp32 "
                f"parameters (got {type(optim).__name__}, loss scaling {scaled})"
            )
        self.stepper = HostStepper(device, name="cai-zero-cpu-step") if overlap else None
        self._grad_buf: dict[int, torch.Tensor] = {}
        self._param_buf: dict[int, torch.Tensor] = {}
        self._landed: dict[int, torch.cuda.Event] = {}
        self._copied_back: dict[int, torch.cuda.Event] = {}
        self._sent_up: dict[int, torch.Tensor] = {}  # device shards copied up by the worker, not yet gathered
        self._futures: dict[int, Future] = {}
        # buckets whose pinned parameter buffer holds the latest step's output
        self._written: set[int] = set()
        self._threads = HostStepper.worker_threads() if overlap else None

    def _buffer(self, cache: dict, b: Bucket, dtype: torch.dtype) -> torch.Tensor:
        buf = cache.get(b.index)
        if buf is None or buf.dtype != dtype:
            buf = cache[b.index] = torch.empty(b.shard, dtype=dtype, pin_memory=self.cuda)
        return buf

    def land(self, b: Bucket, shard: torch.Tensor, inv_scale: float) -> None:
        """Bring a reduced gradient shard to the host and add it to the master shard's gradient."""
        if b.grad_shard is None and inv_scale == 1.0 and (self.fast or shard.dtype == torch.float32):
            buf = self._buffer(self._grad_buf, b, shard.dtype)
            buf.copy_(shard, non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record()  # on the stream that reduced the shard
                self._landed[b.index] = event
            b.grad_shard = buf
            if self.stepper is not None:
                self._futures[b.index] = self.stepper.submit(self.step_bucket, b, send_up=True)
            return
        if self.stepper is not None:
            raise RuntimeError(
                "ZeroOptimizer: overlap_cpu_step=True allows one synchronising backward per step; accumulate the "
                "other micro-steps under no_sync()"
            )
        self.settle(b)
        b.grad_shard = accumulate_grad_shard(
            b.grad_shard, shard.to("cpu", torch.float32, copy=True), scale=inv_scale
        )

    def settle(self, b: Bucket) -> None:
        """Wait until the bucket's device-to-host gradient copy has finished."""
        event = self._landed.pop(b.index, None)
        if event is not None:
            event.synchronize()

    def step_bucket(self, b: Bucket, *, send_up: bool = False) -> None:
        """One Adam step of the bucket's master shard, writing the working-dtype copy into a pinned buffer
        (``send_up``: and start its copy to the device on the stepper's side stream)."""
        self.settle(b)
        done = self._copied_back.pop(b.index, None)
        if done is not None:
            done.synchronize()  # the previous step's copy back still reads the pinned buffer
        if b.grad_shard is None:
            return
        group = self.optim.param_groups[b.group_index]
        state = adam_state(self.optim, b.master)
        state["step"] += 1
        buf = self._buffer(self._param_buf, b, b.dtype)
        adam_step(
            b.master, b.grad_shard, state["exp_avg"], state["exp_avg_sq"], group,
            step=state["step"].item(), adamw=adamw_mode(self.optim, group), out=buf, num_threads=self._threads,
        )  # fmt: skip
        self._written.add(b.index)
        if send_up and self.stepper is not None and self.cuda:
            self._written.discard(b.index)
            self._sent_up[b.index], self._copied_back[b.index] = self.stepper.copy_up(buf)

    def device_shard(self, b: Bucket) -> torch.Tensor:
        """The updated shard in the working dtype, on the device (asynchronous from pinned memory)."""
        sent = self._sent_up.pop(b.index, None)
        if sent is not None:  # copied up on the side stream by the worker
            self.stepper.join(self._copied_back[b.index], sent)  # type: ignore[union-attr]
            return sent
        buf = self._buffer(self._param_buf, b, b.dtype)
        if b.index in self._written:
            self._written.discard(b.index)
        else:
            done = self._copied_back.pop(b.index, None)
            if done is not None:
                done.synchronize()
            buf.copy_(b.master)
        shard = buf.to(self.device, non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied_back[b.index] = event
        return shard

    def step(self, buckets: list[Bucket], gather: Callable[[Bucket], None]) -> None:
        """Update every bucket and ``gather`` it, bucket by bucket (CPU step of i+1 overlaps the copy of i)."""
        if not self.fast:
            for b in buckets:
                b.master.grad = b.grad_shard  # fp32: land() only aliases other dtypes for the fast path
            self.optim.step()
            for b in buckets:
                b.master.grad = None
        for b in buckets:
            if self.fast:
                future = self._futures.pop(b.index, None)
                future.result() if future is not None else self.step_bucket(b)
            gather(b)

    def wait_all(self, buckets: list[Bucket]) -> None:
        if self._futures:
            raise RuntimeError(
                "ZeroOptimizer: with overlap_cpu_step=True the CPU step already ran during backward; call step() "
                "before zero_grad()"
            )
        for b in buckets:
            self.settle(b)
