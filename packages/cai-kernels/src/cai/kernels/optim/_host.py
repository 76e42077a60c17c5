"""The host Adam stepper: updates of fp32 master shards kept in host memory, run on a worker thread while backward
goes on, with the new working-precision parameters copied back to the device on a side stream.

[Note: host Adam stepper]
An offloaded optimizer (cai-zero's ``cpu_offload``, cai-gemini's host chunks) lands each reduced gradient shard in a
pinned host buffer and updates its fp32 master shard with ``adam_update(..., out=pinned working-dtype buffer)``,
which writes the new parameters, already cast, in the same pass. Overlapped with backward, each shard's update
starts on the one worker thread as soon as its gradient has landed (the native CPU Adam releases the GIL; the
worker leaves one core to the Python thread that feeds the GPU), and the worker starts the copy of the result up
on a side stream, after an event that marks the compute stream's last read of the destination when there is one.
The main thread later makes the compute stream wait for that copy (``join``), without a host wait. Collectives stay
on the main thread, so every rank issues them in the same order. The owners keep their own buffers and lifecycles
(buckets, chunks); this is what they share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from cai.kernels.optim._functional import adam_update

__all__ = ["HostStepper", "adam_step", "adamw_mode"]


def adamw_mode(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    """True when ``optimizer``'s ``group`` decays weights decoupled (AdamW), False for Adam's L2 penalty."""
    if "adamw_mode" in group:  # cai.kernels HybridAdam / CPUAdam / FusedAdam
        return bool(group["adamw_mode"])
    if isinstance(optimizer, torch.optim.AdamW):
        return True
    return bool(group.get("decoupled_weight_decay", False))


def adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    group: Mapping[str, Any],
    *,
    step: int | float | torch.Tensor,
    adamw: bool,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """``adam_update`` of a flat master shard with the hyperparameters of a torch or cai.kernels param group."""
    beta1, beta2 = group["betas"]
    adam_update(
        master, grad, exp_avg, exp_avg_sq,
        step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), adamw_mode=adamw,
        bias_correction=bool(group.get("bias_correction", True)), out=out, num_threads=num_threads,
    )  # fmt: skip


class HostStepper:
    """The worker thread and the copy-up stream of an offloaded optimizer (see [Note: host Adam stepper]).

    Args:
        device: the compute device the results go up to (no stream off CUDA, where copies are synchronous).
        name: the worker thread's name prefix.

    Example::

        stepper = HostStepper(torch.device("cuda", 0), name="my-host-adam")
        future = stepper.submit(update_and_send_up, shard)         # during backward
        ...
        future.result(); stepper.join(event)                        # in step(): no host wait for the copy
    """

    def __init__(self, device: torch.device, *, name: str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        # created here, on the main thread, not lazily from the worker
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    @staticmethod
    def worker_threads() -> int:
        """CPU threads for an update on the worker: all but one, which the thread feeding the GPU keeps."""
        return max(1, torch.get_num_threads() - 1)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the worker thread (one thread: submissions run in order)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        return self._pool.submit(fn, *args, **kwargs)

    def copy_up(
        self,
        src: torch.Tensor,
        *,
        into: torch.Tensor | None = None,
        after: torch.cuda.Event | None = None,
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy ``src`` (pinned host memory) to the device on the side stream, once ``after`` has passed.

        Returns the device tensor (``into``, or a new one allocated on the side stream: ``join`` it with that tensor)
        and an event recorded after the copy. Off CUDA the copy is synchronous and the event None.
        """
        if self._stream is None:
            return (into.copy_(src) if into is not None else src.to(self.device)), None
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            if into is None:
                out = src.to(self.device, non_blocking=True)
            else:
                out = into.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return out, done

    def join(self, event: torch.cuda.Event | None, allocated: torch.Tensor | None = None) -> None:
        """Order the current stream after a ``copy_up`` (no host wait); ``allocated``: the tensor it allocated,
        from now on read on this stream."""
        if event is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_event(event)
        if allocated is not None:
            allocated.record_stream(main)
