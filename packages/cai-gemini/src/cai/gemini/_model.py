"""GeminiModel: runs a module whose parameters live in chunks, gathering them around each module's forward and
backward through module and autograd hooks (no forward is replaced)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from cai.gemini._chunk import Chunk, TensorInfo, TensorState
from cai.gemini._config import GeminiConfig
from cai.gemini._manager import BWD, FWD, AutoPlacer, ChunkManager
from cai.gemini._memory import CudaMemoryTracker, MemoryTracker
from cai.gemini._state import gather_full, iter_pieces, source_shard
from cai.kernels.optim import DynamicLossScaler
from cai.mesh import LocalShard, Read, ShardSpec, all_gather_into_tensor, register_grad_hooks_weakly

__all__ = ["GeminiModel"]


def _in_backward() -> bool:
    # recomputation under activation checkpointing runs forwards inside the backward pass
    return torch._C._current_graph_task_id() != -1


class GeminiModel(nn.Module):
    """Chunked ZeRO-3 wrapper: ``module``'s parameters become views into chunks sharded over ``group``.

    Args:
        module: the model (its parameters may live on the host; each chunk is built from them and they are freed).
        config: placement, precision, chunk layout and prefetch (see ``GeminiConfig``).
        group: the data-parallel group that shards the chunks (None: the default group, or one process).
        device: the compute device (default: the current CUDA device, else the CPU).
        memory: the memory tracker (default: a CUDA tracker on CUDA, an unlimited one on CPU); inject a
            ``MemoryTracker(device_capacity=...)`` to simulate a device budget.

    Example::

        model = GeminiModel(model, config=GeminiConfig(precision="bf16", offload_optim_frac=1.0))
        loss = loss_fn(model(input_ids), labels)
        optimizer.backward(loss)   # or model.backward(loss); plain loss.backward() works except with fp16

    Notes:
        Parameters keep their identity (``model.module.layers[0].mlp.up_proj.weight`` is the same object), so an
        optimizer built before or after wrapping refers to the same tensors. Their storage is empty while the
        chunk is released: read weights through ``state_dict()`` or ``sharded_state_dict()``.
        A parameter must be used inside the module that registers it (true of every nn layer and every Hugging
        Face model); functional uses elsewhere would see an empty tensor.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: GeminiConfig | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        memory: MemoryTracker | None = None,
    ) -> None:
        super().__init__()
        self.config = config or GeminiConfig()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.tracker = memory or (
            CudaMemoryTracker(self.device) if self.device.type == "cuda" else MemoryTracker()
        )
        self.module = module
        named = list(module.named_parameters())  # tied parameters appear once, under their first name
        for name, buf in list(module.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            mod = module.get_submodule(owner) if owner else module
            mod._buffers[leaf] = buf.to(self.device)
        with torch.no_grad():
            self.chunk_manager = ChunkManager(
                named, config=self.config, device=self.device, group=group, tracker=self.tracker
            )
        self.placer = (
            AutoPlacer(self.chunk_manager, self.config, self.tracker)
            if self.config.placement_policy == "auto"
            else None
        )
        self._scaler: DynamicLossScaler | None = None  # see attach_optimizer
        self._on_reduced: Callable[[Chunk], None] | None = None
        self._sync = True
        self._backward_active = False
        self._warmup_started = False
        self._handles: list[Any] = []
        self._mod_chunks: dict[nn.Module, list[Chunk]] = {}
        self._mod_tensors: dict[nn.Module, list[TensorInfo]] = {}
        for m in module.modules():
            params = list(m.parameters(recurse=False))
            chunks = self.chunk_manager.chunks_of(params)
            if not chunks:
                continue
            self._mod_chunks[m] = chunks
            self._mod_tensors[m] = [self.chunk_manager.info[id(p)][1] for p in params]
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._root_post_forward))
        # held weakly, or every chunk would live as long as the parameters (see [Note: hooks hold their owner weakly])
        self._handles += register_grad_hooks_weakly(
            self, GeminiModel._grad_hook, ((p, ()) for _, p in named if p.requires_grad)
        )

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.chunk_manager.holding and torch.is_grad_enabled():
            raise RuntimeError(
                "GeminiModel.gathered(): the forwards inside it run without gradients (generation, evaluation "
                "under torch.no_grad()); run training forwards outside it"
            )
        if not self._warmup_started:
            self._warmup_started = True
            self.tracker.begin_warmup()
        if not _in_backward():
            self.chunk_manager.begin_phase(FWD)
        if self.config.cast_inputs and self.config.precision != "fp32":
            dtype = self.config.working_dtype

            def cast(x: Any) -> Any:
                return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and not self.chunk_manager.holding:
            self.chunk_manager.release_all()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Gather every chunk once, keep them gathered for the forwards inside, and release them on exit.

        For generation and evaluation: ``model.generate`` calls the model once per token, and each call would
        otherwise all-gather every chunk again. The whole model must fit on the device in the working dtype
        beside what is there. Forwards inside run without gradients (``generate`` turns them off itself); a
        training forward raises. Every rank of the group enters it, as every rank joins each all-gather.
        """
        manager = self.chunk_manager
        if manager.holding:  # nested: the outer context releases
            yield
            return
        with torch.no_grad():
            manager.gather_all()
        manager.holding = True
        try:
            yield
        finally:
            manager.holding = False
            manager.release_all()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        phase = BWD if _in_backward() else FWD
        self.chunk_manager.access(self._mod_chunks[module], phase, self.placer)
        for t in self._mod_tensors[module]:
            if t.state in (TensorState.HOLD, TensorState.HOLD_AFTER_BWD):
                t.state = TensorState.COMPUTE

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        for t in self._mod_tensors[module]:
            if t.state is TensorState.COMPUTE:
                t.state = TensorState.HOLD
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, module)
            for out in tree_flatten(output)[0]:
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(hook)
        return output

    # ---- backward -----------------------------------------------------------------------------------------
    def _pre_backward(self, module: nn.Module, grad: torch.Tensor) -> None:
        if not self._backward_active:
            self._backward_active = True
            self.chunk_manager.begin_phase(BWD)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.chunk_manager.access(self._mod_chunks[module], BWD, self.placer)

    def _grad_hook(self, param: torch.Tensor) -> None:
        chunk, info = self.chunk_manager.info[id(param)]
        grad = param.grad
        param.grad = None  # the chunk's buffer owns the gradient from here on
        if grad is None:
            return
        if not self._backward_active:  # a grad hook can be the first hook of a backward pass
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if chunk.accept_grad(info, grad):
            chunk.reduce(sync=self._sync)
            if not chunk.in_compute:
                chunk.release()
            if self._sync and self._on_reduced is not None:
                self._on_reduced(chunk)

    def _end_backward(self) -> None:
        for c in self.chunk_manager.chunks:
            if c.grad_buffer is not None:  # some parameters took no part in this pass
                c.reduce(sync=self._sync)
                if self._sync and self._on_reduced is not None:
                    self._on_reduced(c)
        self.chunk_manager.release_all()
        self._backward_active = False

    # ---- the optimizer's side ----------------------------------------------------------------------------
    def attach_optimizer(
        self, *, scaler: DynamicLossScaler | None, on_reduced: Callable[[Chunk], None] | None
    ) -> None:
        """How the optimizer that steps this model's chunks talks to it (called once, by ``GeminiOptimizer``).

        ``scaler``: the fp16 loss scaler whose current scale ``backward`` applies (None: no scaling).
        ``on_reduced(chunk)``: called after each synchronised reduction of a chunk's gradient, during backward
        (the overlapped host step starts there); None when nothing needs it.
        """
        self._scaler = scaler
        self._on_reduced = on_reduced

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``backward`` multiplies the loss by (1.0 without an fp16 optimizer)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the fp16 loss scale applied (see ``attach_optimizer``)."""
        scale = self.loss_scale
        (loss * scale if scale != 1.0 else loss).backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (in fp32, full chunk size) without collectives; the first backward
        outside the context reduces them with its own. Plain accumulation (no context) also works: every
        backward reduce-scatters and the shards accumulate until ``zero_grad``."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.chunk_manager.chunks:
            c.zero_grad()

    # ---- introspection ------------------------------------------------------------------------------------
    @property
    def chunks(self) -> list[Chunk]:
        return self.chunk_manager.chunks

    def memory_report(self) -> dict[str, int]:
        """Model-data bytes on the device and host now, the peaks, and the bytes moved between them."""
        return self.tracker.report()

    def sharded_grads(self) -> dict[str, LocalShard]:
        """This rank's pieces of the accumulated (mean-reduced, fp32) gradients, by parameter name."""
        out: dict[str, LocalShard] = {}
        grads = {c.index: c.step_grad() for c in self.chunks if c.master is not None}
        for chunk, pc in iter_pieces(self.chunks):
            g = grads.get(chunk.index)
            if g is not None:
                out[pc.entry.name] = LocalShard(g[pc.start : pc.stop].detach().float().cpu().clone(), pc.spec)
        return out

    # ---- state ----------------------------------------------------------------------------------------------
    def _buffers_by_name(self) -> Iterator[tuple[str, torch.Tensor]]:
        non_persistent = {
            f"{mn}.{b}" if mn else b
            for mn, m in self.module.named_modules()
            for b in m._non_persistent_buffers_set
        }
        for name, buf in self.module.named_buffers():
            if name not in non_persistent:
                yield name, buf

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        """This rank's pieces of every parameter (fp32 master values when trainable) and the persistent buffers,
        keyed by the unwrapped module's names (tied parameters once)."""
        out: dict[str, LocalShard] = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host copies of shards may still be landing
        for chunk, pc in iter_pieces(self.chunks):
            out[pc.entry.name] = LocalShard(source_shard(chunk)[pc.start : pc.stop].detach(), pc.spec)
        for name, buf in self._buffers_by_name():
            out[name] = LocalShard(buf.detach(), ShardSpec.full(buf.shape))
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, read: Read) -> None:
        """Fill this rank's pieces from ``read(name, spec, dtype)`` (any saved layout can answer it)."""
        self.chunk_manager.release_all()
        for c, pc in iter_pieces(self.chunks):
            value = read(pc.entry.name, pc.spec, torch.float32).reshape(-1)
            if c.master is not None:
                c.master[pc.start : pc.stop].copy_(value)
            assert c.shard is not None
            c.shard[pc.start : pc.stop].copy_(value)
        for c in self.chunks:
            if c.keep_gathered and c.world_size > 1:
                assert c.full is not None and c.shard is not None
                all_gather_into_tensor(c.full, c.shard.clone(), group=c.group)
        for name, buf in self._buffers_by_name():
            buf.copy_(read(name, ShardSpec.full(buf.shape), buf.dtype))

    @torch.no_grad()
    def state_dict(  # type: ignore[override]
        self,
        destination: dict[str, torch.Tensor] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        *,
        only_rank_0: bool = False,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """The full model on the host, keyed like the unwrapped module's own ``state_dict()``.

        Every rank must call it (one all-gather per chunk). Values are unpadded, in the precision that is the
        source of truth (the fp32 master weights of trainable parameters, frozen ones in the working dtype) unless
        ``dtype`` casts them; tied parameters appear under each of their names, sharing one tensor, and persistent
        buffers are included. Every rank gets the full dict; with ``only_rank_0=True`` (the default of Colossal-AI's
        ``GeminiDDP`` and of a model boosted by cai-booster's ``GeminiPlugin``) the other ranks of the group get an
        empty dict and keep no gathered copy.
        ``keep_vars`` is accepted for ``nn.Module`` compatibility: the values are always detached copies.
        """
        out = destination if destination is not None else {}
        keep = not only_rank_0 or self.chunk_manager.rank == 0
        by_id = self._gathered_params(keep)
        if not keep:
            return out
        if dtype is not None:  # cast once per parameter, so that tied names still share one tensor
            by_id = {k: v.to(dtype) if v.is_floating_point() else v for k, v in by_id.items()}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            out[prefix + name] = by_id[id(p)]
        for name, buf in self._buffers_by_name():
            out[prefix + name] = buf.detach().to("cpu", copy=True)
        return out

    def _gathered_params(self, keep: bool) -> dict[int, torch.Tensor]:
        """id(parameter) -> its full value on the host, gathered chunk by chunk; empty when ``keep`` is False (the
        rank still joins every all-gather)."""
        by_name: dict[str, torch.Tensor] = {}
        for c in self.chunks:
            full = gather_full(c, source_shard(c))
            if keep:
                for t in c.tensors:
                    by_name[t.name] = full[t.offset : t.end].view(t.shape).clone()
        return {id(p): by_name[n] for n, p in self.module.named_parameters()} if keep else {}

    def load_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> Any:  # type: ignore[override]
        """Load a full state dict (the unwrapped module's names, as ``state_dict()`` returns) into this rank's
        pieces; every rank needs the full dict (the names a tied parameter has besides its first are accepted)."""
        aliases = set(dict(self.module.named_parameters(remove_duplicate=False))) - set(
            dict(self.module.named_parameters())
        )
        expected = {t.name for c in self.chunks for t in c.tensors} | {n for n, _ in self._buffers_by_name()}
        missing = sorted(expected - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected - aliases)
        if strict and (missing or unexpected):
            hint = (
                " (an empty dict: state_dict(only_rank_0=True) returns one on ranks other than 0; give every rank "
                "the full dict, or save and load with booster.save_model/load_model)"
                if not state_dict
                else ""
            )
            raise KeyError(
                f"GeminiModel.load_state_dict: missing keys {missing}, unexpected keys {unexpected}{hint}"
            )
        # strict=False: a missing name keeps this rank's current piece (copied onto itself), with no collective
        current = self.sharded_state_dict() if missing else {}

        def read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
            if name in state_dict:
                return spec.cut(state_dict[name]).to(dtype)
            return current[name].tensor.to(dtype, copy=True)

        self.load_sharded_state_dict(read)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
