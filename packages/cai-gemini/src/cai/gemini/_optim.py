"""GeminiOptimizer: Adam/AdamW on the fp32 master shards of every chunk, where each chunk's state lives."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from cai.gemini._chunk import Chunk
from cai.gemini._model import GeminiModel
from cai.gemini._state import gather_full, iter_pieces
from cai.kernels.optim import DynamicLossScaler, HostStepper, adam_step, adamw_mode
from cai.mesh import LocalShard, Read, ShardSpec, load_param_groups_state, param_groups_state

__all__ = ["GeminiOptimizer"]


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    ok = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or any(
        "adamw_mode" in g for g in optimizer.param_groups
    )
    if not ok:
        raise TypeError(
            f"GeminiOptimizer: {type(optimizer).__name__} is not supported; use torch.optim.Adam/AdamW or "
            "cai.kernels.optim.HybridAdam/CPUAdam/FusedAdam (the update runs on flat master shards)"
        )
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise ValueError(
                "GeminiOptimizer: amsgrad=True and maximize=True are not supported; set them False"
            )


class GeminiOptimizer(torch.optim.Optimizer):
    """Steps the fp32 master shards of a ``GeminiModel`` with the hyperparameters of ``optimizer``.

    Args:
        optimizer: ``torch.optim.Adam``/``AdamW`` or a ``cai.kernels.optim`` Adam over the model's parameters;
            its param groups (and an LR scheduler acting on them) drive the update. Its own state is unused.
        model: the ``GeminiModel`` owning the parameters.
        max_norm: clip the global gradient norm (default: ``model.config.max_norm``; 0 disables).
        norm_type: 2.0 or inf (default: ``model.config.norm_type``).

    Each chunk's shard is updated where its master weights live (host: the native CPU Adam; device: torch's fused
    kernels), then written back into the working-precision shard. Gradients accumulate over backward passes until
    ``zero_grad``. With fp16 the loss must go through ``backward(loss)`` (it applies the loss scale).

    Example::

        optimizer = GeminiOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model, max_norm=1.0)
        optimizer.backward(loss); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: GeminiModel,
        *,
        max_norm: float | None = None,
        norm_type: float | None = None,
    ) -> None:
        _check_optimizer(optimizer)
        self.optim = optimizer
        self.model = model
        self.max_norm = model.config.max_norm if max_norm is None else float(max_norm)
        self.norm_type = model.config.norm_type if norm_type is None else float(norm_type)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.scaler = DynamicLossScaler(model.config.loss_scale) if model.config.precision == "fp16" else None
        group_of: dict[int, int] = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) not in model.chunk_manager.info:
                    raise ValueError(
                        "GeminiOptimizer: the optimizer holds a parameter that the model does not own"
                    )
                group_of[id(p)] = gi
        # segments: (chunk, lo, hi) runs of one param group in each chunk's local shard
        self._segments: list[list[tuple[Chunk, int, int]]] = [[] for _ in self.param_groups]
        self._names: list[list[str]] = [[] for _ in self.param_groups]
        for c in model.chunks:
            for t in c.tensors:
                if id(t.param) in group_of:
                    self._names[group_of[id(t.param)]].append(t.name)
        for chunk, pc in iter_pieces(model.chunks):
            gi = group_of.get(id(pc.entry.param))
            if gi is None or chunk.master is None:
                continue
            segs = self._segments[gi]
            if segs and segs[-1][0] is chunk and segs[-1][2] == pc.start:
                segs[-1] = (chunk, segs[-1][1], pc.stop)
            else:
                segs.append((chunk, pc.start, pc.stop))
        # chunks whose every tensor is stepped: the update can write the new working-precision values straight
        # into the host transfer buffer (one pass instead of an update and a cast)
        covered: dict[int, int] = {}
        for c, lo, hi in (x for segs in self._segments for x in segs):
            covered[c.index] = covered.get(c.index, 0) + (hi - lo)
        self._direct = {
            c.index
            for c in model.chunks
            if c.master is not None
            and covered.get(c.index, 0) == sum(pc.stop - pc.start for _, pc in iter_pieces([c]))
        }
        self._by_chunk: dict[int, list[tuple[int, int, int]]] = {}
        for gi, segs in enumerate(self._segments):
            for c, lo, hi in segs:
                self._by_chunk.setdefault(c.index, []).append((gi, lo, hi))
        self._steps = [0] * len(self.param_groups)
        self._stepper: HostStepper | None = None  # created at the first overlapped host step
        self._early: dict[int, Future] = {}
        model.attach_optimizer(
            scaler=self.scaler, on_reduced=self._on_reduced if model.config.overlaps_host_step else None
        )
        self._chunk_state: dict[int, dict[str, torch.Tensor]] = {}
        self._warm = False
        self.last_grad_norm: float | None = None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on fp16 overflow (kept by the loss scaler, so a resumed run keeps counting)."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    # ---- the training-loop surface ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        if self._early:
            raise RuntimeError(self._second_backward())
        self.model.backward(loss)

    def _second_backward(self) -> str:
        return (
            "GeminiOptimizer: a second synchronised backward before step(), but host chunks were already updated "
            "from the first (the overlapped host step, on by default without clipping or fp16); accumulate "
            "micro-batches inside no_sync() (booster.no_sync(model, optimizer)), or set overlap_host_step=False "
            "(GeminiPlugin(enable_gradient_accumulation=True) does)"
        )

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        scale = self.model.loss_scale
        torch.autograd.backward(tensor, grad * scale if scale != 1.0 else grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._early:
            raise RuntimeError(
                "GeminiOptimizer.zero_grad: host chunks were already updated from this backward "
                "(overlap_host_step=True); call step() after every synchronised backward"
            )
        self.model.zero_grad()

    def no_sync(self):
        """The model's ``no_sync()`` (accumulate without collectives until the last micro-batch)."""
        return self.model.no_sync()

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Colossal-AI's name for ``clip_grad_norm_``."""
        return self.clip_grad_norm_(max_norm, norm_type)

    def _trainable(self) -> list[Chunk]:
        return [c for c in self.model.chunks if c.master is not None]

    def _state(self, c: Chunk) -> dict[str, torch.Tensor]:
        st = self._chunk_state.get(c.index)
        if st is None:
            assert c.master is not None
            st = {"exp_avg": torch.zeros_like(c.master), "exp_avg_sq": torch.zeros_like(c.master)}
            self.model.tracker.add(c.optim_location, "optim", 2 * c.master.numel() * 4)
            self._chunk_state[c.index] = st
        return st

    def _all_reduce(self, value: float, op: dist.ReduceOp) -> float:
        group = self.model.chunk_manager.group
        if not dist.is_initialized() or self.model.chunk_manager.world_size == 1:
            return value
        dev = self.model.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op, group=group)
        return float(t.item())

    def _grads(self, *, fp32: bool = False) -> list[tuple[Chunk, torch.Tensor]]:
        out = []
        for c in self._trainable():
            g = c.step_grad(fp32=fp32)
            if g is not None:
                out.append((c, g))
        return out

    def _grad_norm(self, grads: list[tuple[Chunk, torch.Tensor]], norm_type: float) -> float:
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for _, g in grads), default=0.0)
            return self._all_reduce(local, dist.ReduceOp.MAX)
        if norm_type != 2.0:
            raise ValueError(f"GeminiOptimizer: norm_type={norm_type} is not supported; use 2.0 or inf")
        local = sum(float(g.double().pow(2).sum()) for _, g in grads)
        return math.sqrt(self._all_reduce(local, dist.ReduceOp.SUM))

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """Global norm of the accumulated gradients, over every rank's shard of every trainable chunk.

        The gradients are taken as they are: with fp16 they carry the loss scale until ``step()`` unscales them.
        """
        self._check_norm_readable("grad_norm")
        return self._grad_norm(self._grads(), float(norm_type))

    def _check_norm_readable(self, name: str) -> None:
        if self.model.config.overlaps_host_step and self._trainable_on_host():
            raise ValueError(
                f"GeminiOptimizer.{name}: with the overlapped host step (overlap_host_step="
                f"{self.model.config.overlap_host_step}; None turns it on without clipping or fp16) the host "
                "chunks' gradients are consumed during backward, so no global norm exists after it; pass max_norm "
                "to the config (or plugin) to clip inside step(), or set overlap_host_step=False"
            )

    def _trainable_on_host(self) -> bool:
        return any(c.io is not None for c in self._trainable())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the accumulated gradients so their global norm is at most ``max_norm``; returns the norm."""
        self._check_norm_readable("clip_grad_norm_")
        grads = self._grads()
        norm = self._grad_norm(grads, float(norm_type))
        coef = min(1.0, max_norm / (norm + 1e-6))
        for _, g in grads:
            g.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every trainable chunk's shard (skipped, with the loss scale backed off, on fp16 overflow)."""
        loss = closure() if closure is not None else None
        # The wrapped optimizer's own step never runs (the chunks are updated here): set the mark its wrapped step
        # would set, so a torch LR scheduler built on it does not warn that it stepped first.
        self.optim._opt_called = True
        chunks = self._trainable()
        for c in chunks:
            if c.unreduced is not None:
                raise RuntimeError(
                    "GeminiOptimizer.step: called inside no_sync(); do the last backward outside it"
                )
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            bad = 0.0
            for _, g in self._grads(fp32=True):
                g.mul_(inv)
                bad = max(bad, float(not bool(torch.isfinite(g).all())))
            overflow = self._all_reduce(bad, dist.ReduceOp.MAX) > 0
            self.scaler.update(overflow)
            if overflow:
                self.model.zero_grad()
                return loss
        if self.max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(self.max_norm, self.norm_type)
        nxt = self._next_steps()
        for c in chunks:
            early = self._early.pop(c.index, None)
            if early is not None and early.result():  # updated (and copied up) in the background
                c.join_up()
                continue
            written = self._update_chunk(c, nxt) if early is None else c.index in self._direct
            c.write_back(written=written)
        self._steps = nxt
        if not self._warm:
            self._warm = True
            if self.model.placer is not None:
                for c in chunks:
                    self._state(c)
                self._chunk_state = self.model.placer.after_warmup(self._chunk_state)
            self.model.chunk_manager.end_step()
        return loss

    def _next_steps(self) -> list[int]:
        return [s + 1 if segs else s for s, segs in zip(self._steps, self._segments)]

    def _update_chunk(self, c: Chunk, steps: list[int], num_threads: int | None = None) -> bool:
        """Adam on every segment of one chunk's shard, where the chunk's master weights live. Returns whether it
        also wrote the new working-precision values (into ``io``, or into the device shard itself when the master
        is on the device: the update's own pass casts them, see [Note: device Adam] in cai-kernels)."""
        g = c.step_grad()
        st = self._state(c)
        assert c.master is not None and c.shard is not None
        direct = c.io is not None and c.index in self._direct
        in_place = c.io is None and c.shard.device == c.master.device
        if direct:
            c.wait_up()
        for gi, lo, hi in self._by_chunk.get(c.index, ()):
            group = self.param_groups[gi]
            adam_step(
                c.master[lo:hi],
                g[lo:hi] if g is not None else torch.zeros_like(c.master[lo:hi]),
                st["exp_avg"][lo:hi],
                st["exp_avg_sq"][lo:hi],
                group,
                step=steps[gi],
                adamw=adamw_mode(self.optim, group),
                # io: the gradient is read before the parameter is written
                out=c.io[lo:hi] if direct else c.shard[lo:hi] if in_place else None,  # type: ignore[index]
                num_threads=num_threads,
            )
        if direct:
            c.io_has_grad = False  # ``io`` now holds the new parameters, not the gradient
        return direct or in_place

    def _on_reduced(self, c: Chunk) -> None:
        # [Note: overlapped host step] the chunk's gradient is final (one synchronised backward per step, no
        # clipping, no loss scale): update its host shard on the stepper's worker while backward goes on, then
        # start the copy of the new parameters up on its side stream (see [Note: host Adam stepper] in
        # cai-kernels). The chunks reduced last in backward are the first the next forward needs, so the copies
        # of all the others are hidden behind the remaining host updates. ``step`` joins the worker and makes the
        # compute stream wait for the copies.
        if c.io is None or c.master is None:
            return
        if c.index in self._early:  # backward ran again without no_sync() after this chunk was updated
            raise RuntimeError(self._second_backward())
        if self._stepper is None:
            self._stepper = HostStepper(self.model.device, name="gemini-host-adam")
        self._state(c)  # allocate on the main thread
        after = c.mark_shard_reads()  # the compute stream's last read of the device shard, on this thread
        self._early[c.index] = self._stepper.submit(self._update_early, c, self._next_steps(), after)

    def _update_early(self, c: Chunk, steps: list[int], after: torch.cuda.Event | None) -> bool:
        """Worker thread: the chunk's update, then its copy up unless a collective is needed (step does it)."""
        self._update_chunk(c, steps, num_threads=HostStepper.worker_threads())
        if c.keep_gathered and c.world_size > 1:
            return False  # re-gathering is a collective: keep those on the main thread, in order
        assert self._stepper is not None
        c.write_back(
            written=c.index in self._direct, copy_up=functools.partial(self._stepper.copy_up, after=after)
        )
        return True

    # ---- state ----------------------------------------------------------------------------------------------
    def _group_index(self) -> dict[str, int]:
        return {n: gi for gi, names in enumerate(self._names) for n in names}

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        """This rank's pieces of ``<param>.exp_avg`` / ``.exp_avg_sq`` and a 0-d ``<param>.step`` (after a step)."""
        out: dict[str, LocalShard] = {}
        gidx = self._group_index()
        for chunk, pc in iter_pieces(self._trainable()):
            st = self._chunk_state.get(chunk.index)
            gi = gidx.get(pc.entry.name)
            if st is None or gi is None:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{pc.entry.name}.{key}"] = LocalShard(st[key][pc.start : pc.stop].detach(), pc.spec)
            out[f"{pc.entry.name}.step"] = LocalShard(
                torch.tensor(float(self._steps[gi])), ShardSpec.full(())
            )
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, read: Read) -> None:
        gidx = self._group_index()
        for chunk, pc in iter_pieces(self._trainable()):
            gi = gidx.get(pc.entry.name)
            if gi is None:
                continue
            st = self._state(chunk)
            for key in ("exp_avg", "exp_avg_sq"):
                st[key][pc.start : pc.stop].copy_(
                    read(f"{pc.entry.name}.{key}", pc.spec, torch.float32).reshape(-1)
                )
            self._steps[gi] = int(read(f"{pc.entry.name}.step", ShardSpec.full(()), torch.float32).item())

    def ensure_state(self) -> None:
        """Create every chunk's Adam state now (zeros), so a loader knows its keys before the first step."""
        for chunk in self._trainable():
            self._state(chunk)

    def param_groups_state(self) -> list[dict[str, Any]]:
        """JSON-able hyperparameters per group, with ``params`` as parameter names."""
        return param_groups_state(self.param_groups, self._names)

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None:
        """Restore :meth:`param_groups_state`; each group must hold the same parameter names as saved."""
        load_param_groups_state(self.param_groups, self._names, groups, owner="GeminiOptimizer")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Full optimizer state on the host by parameter name (one all-gather per chunk and state tensor)."""
        state: dict[str, dict[str, torch.Tensor]] = {}
        gidx = self._group_index()
        stepped = bool(self._chunk_state)
        for c in self._trainable():
            if not stepped:
                break
            # every rank gathers every chunk, including chunks whose local shard is only padding here
            st = self._state(c)
            fulls = {k: gather_full(c, v) for k, v in st.items()}
            for t in c.tensors:
                if t.name in gidx:
                    s = {k: f[t.offset : t.end].view(t.shape).clone() for k, f in fulls.items()}
                    s["step"] = torch.tensor(float(self._steps[gidx[t.name]]))
                    state[t.name] = s
        return {
            "state": state,
            "param_groups": self.param_groups_state(),
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state = state_dict["state"]
        self.load_param_groups_state(state_dict["param_groups"])

        def read(key: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
            name, _, k = key.rpartition(".")
            return spec.cut(state[name][k]).to(dtype)

        if state:
            self.load_sharded_state_dict(read)
        if self.scaler is not None and state_dict.get("loss_scaler"):
            self.scaler.load_state_dict(state_dict["loss_scaler"])
