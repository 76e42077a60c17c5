"""ZeroOptimizer: ZeRO-1/2 (or stage 0, unsharded) around any torch optimizer, over one data-parallel group."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.kernels.optim import (
    CPUAdam,
    DynamicLossScaler,
    FusedAdam,
    LossScaleConfig,
    accumulate_grad_shard,
    adam_state,
    adam_step,
    adamw_mode,
)
from cai.mesh import (
    LocalShard,
    Read,
    all_gather_into_tensor,
    debug_checks_on,
    flat_pieces,
    fp8_all_reduce,
    fp8_reduce_scatter_tensor,
    load_param_groups_state,
    param_groups_state,
    reduce_scatter_tensor,
    register_grad_hooks_weakly,
)
from cai.zero import _state
from cai.zero._bucket import Bucket, plan_buckets
from cai.zero._config import ZeroConfig
from cai.zero._offload import HostOffload

logger = logging.getLogger("cai.zero")

_CAST_WINDOW_BYTES = 1 << 30  # fp32 gradient copies alive at once in a step with low-precision gradients

NamedParams = nn.Module | Iterable[tuple[str, nn.Parameter]]

_NONE: Mapping[str, Any] = MappingProxyType({})  # the default of ``replicas`` and ``shared``


class ZeroOptimizer:
    """Shard a torch optimizer's state and fp32 master weights (stage 1) and gradients (stage 2) over a group,
    or keep them whole on every rank with fp32 masters and bucketed all-reduces (stage 0).

    Args:
        optimizer: any elementwise torch optimizer (AdamW, Adam, SGD, ``cai.kernels.optim`` ones) built on the
            model's parameters and holding no state yet. Its ``param_groups`` are kept (LR schedulers built on it
            keep working); their ``params`` become this rank's fp32 master shards.
        model: the model (or its ``named_parameters()``); names key the layout-independent state. Cast it to the
            working dtype (bf16, fp16 or fp32) before wrapping.
        config: :class:`ZeroConfig` (stage, bucket size, comm dtype, overlap, offload, max_norm).
        loss_scale: :class:`LossScaleConfig` for fp16 working parameters (default one if None); must be None
            for bf16 and fp32, which are never scaled.
        group: data-parallel process group (default: the world; a single process without torch.distributed).
        norm_groups: extra process groups the gradient norm is summed over (tensor/pipeline parallel). With them the
            optimizer may hold nothing to train (a frozen pipeline stage); without them that raises.
        replicas: parameter name -> k, the number of ranks across ``norm_groups`` and ``extra_groups`` that hold an
            identical gradient of it (a layer norm weight replicated over a tensor-parallel group of size t: k = t;
            a tied embedding on two pipeline stages: k = 2; both: the product). The gradient norm counts its
            squared norm divided by k on each rank, so the global norm counts it once. Default: none.
        shared: parameter name -> process group of ranks that each hold a copy of it which must take the same step
            (a tied input embedding and LM head on the first and last pipeline stage). Its gradient shard is
            summed over that group once per step (see [Note: shared parameters]). Default: none.
        grad_divisor: the reduced gradient is the group's sum divided by this; default (None) the group's size,
            an average, as DDP. Pass the number of data-parallel replicas when the group also spans ranks whose
            gradients are parts of one replica's gradient that must be summed (sequence parallelism: each rank of a
            replica's sp group holds the gradient of its own tokens), so one collective both sums and averages.
        reduce_groups: parameter name -> the process group its gradient is averaged and its state sharded over,
            instead of ``group`` (the experts of a mixture-of-experts layer, each owned by one expert-parallel rank:
            over the data-parallel group of their own, where ``group`` spans dp x ep). At stages 1 and 2 the
            gradient norm still sums every shard over ``group``, which is right when the ranks of ``group`` outside
            a parameter's reduce group hold other parameters of that name (other experts) rather than copies. At
            stage 0 it sums over no reduction group (every rank holds whole gradients): give the expert-parallel
            group in ``norm_groups`` and the other parameters' copies over it in ``replicas``.

    Example::

        model = build().to(torch.bfloat16)
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model,
                            config=ZeroConfig(stage=2, max_norm=1.0))
        for step, batches in enumerate(loader):       # batches: k micro-batches
            for i, (x, y) in enumerate(batches):
                ctx = opt.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
                with ctx:
                    opt.backward(model.loss(model(x), y) / len(batches))
            opt.step()
            opt.zero_grad()

    Notes:
        Gradients are averaged over the group (summed, divided by its size), like DDP. Micro-steps are summed:
        with a loss that is a mean over each micro-batch, divide it by the number of micro-steps k to get the
        update of one step on the k-times larger batch. ``no_sync()`` keeps each rank's gradients in local flat
        buckets (full size, also for stage 2) and the next backward outside it, or ``step()``, reduces them once.
        Working ``param.grad`` is None after backward: gradients live in the buckets and master shards; use
        :meth:`clip_grad_norm` rather than ``torch.nn.utils.clip_grad_norm_``.
        One reduction's gradient shard stays in the dtype it was reduced in (bf16 for bf16 parameters unless
        ``comm_dtype=torch.float32``): its values exactly, at half the memory of fp32. A second micro-step sums in
        fp32. With a cai.kernels Adam (CPUAdam, HybridAdam, FusedAdam) ``step()`` updates bucket by bucket with
        ``adam_step``, which reads that gradient as it is and writes the working parameters in the same pass (the
        wrapped ``step()`` still runs once, with no gradients, for its hooks and LR schedulers). Other optimizers
        get fp32 gradients, cast about 1 GiB at a time, with their ``step()`` called once per such window (each
        parameter is still updated once; step hooks run per window).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: NamedParams,
        config: ZeroConfig | None = None,
        loss_scale: LossScaleConfig | None = None,
        group: dist.ProcessGroup | None = None,
        norm_groups: Iterable[dist.ProcessGroup] = (),
        replicas: Mapping[str, int] = _NONE,
        shared: Mapping[str, dist.ProcessGroup] = _NONE,
        grad_divisor: int | None = None,
        reduce_groups: Mapping[str, dist.ProcessGroup] = _NONE,
    ) -> None:
        self.optim = optimizer
        self.config = config = config or ZeroConfig()
        self.group = group
        self.norm_groups = tuple(norm_groups)
        # the groups whose ranks hold disjoint gradient shards (their squared norms add up); not at stage 0, where
        # every rank of the group holds the same whole gradients
        self._shard_groups: tuple = () if config.stage == 0 else (group,)
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world_size, self.rank = 1, 0
        if grad_divisor is not None and (
            not isinstance(grad_divisor, int) or not 1 <= grad_divisor <= self.world_size
        ):
            raise ValueError(
                f"ZeroOptimizer: grad_divisor={grad_divisor!r} must be an int in [1, {self.world_size}] (the group size)"
            )
        self.grad_divisor = grad_divisor or self.world_size
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("ZeroOptimizer: the optimizer already has state; wrap it before its first step")
        # the reduction groups: index 0 is `group`, then those of reduce_groups in first-seen order (Bucket.comm)
        self._groups: list[dist.ProcessGroup | None] = [group]
        for g in reduce_groups.values():
            if all(g is not h for h in self._groups):
                self._groups.append(g)

        items = list(model.named_parameters() if isinstance(model, nn.Module) else model)
        names = {id(p): name for name, p in items}
        unknown = sorted(set(replicas) - set(names.values()))
        if unknown:
            raise ValueError(
                f"ZeroOptimizer: replicas names {unknown}, which are not parameters of the model"
            )
        bad = {n: k for n, k in replicas.items() if not isinstance(k, int) or isinstance(k, bool) or k < 1}
        if bad:
            raise ValueError(f"ZeroOptimizer: replicas {bad}: each count must be an int >= 1")
        groups: list[list[tuple[str, nn.Parameter]]] = []
        self._group_names: list[list[str]] = []
        for gi, pg in enumerate(optimizer.param_groups):
            named = []
            for p in pg["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"ZeroOptimizer: a parameter of shape {tuple(p.shape)} in param group {gi} is not among "
                        "the model's named parameters; pass the model the optimizer was built on"
                    )
                if p.requires_grad:
                    named.append((names[id(p)], p))
            groups.append(named)
            self._group_names.append([n for n, _ in named])
        trainable = [p for named in groups for _, p in named]
        if not trainable and not self.norm_groups:
            # with norm_groups this rank holds one part of a model (an all-frozen pipeline stage): it has nothing
            # to update but still joins the norm's and the overflow check's reductions
            raise ValueError("ZeroOptimizer: the optimizer has no parameter with requires_grad=True")
        unknown = sorted(set(reduce_groups) - {n for named in self._group_names for n in named})
        if unknown:
            raise ValueError(
                f"ZeroOptimizer: reduce_groups names {unknown}, which are not trainable parameters of the optimizer"
            )
        unknown = sorted(set(shared) - {n for named in self._group_names for n in named})
        if unknown:
            # a shared parameter this rank does not step would leave its group's other ranks waiting for its sum
            raise ValueError(
                f"ZeroOptimizer: shared names {unknown}, which are not trainable parameters of the optimizer"
            )
        if shared and config.overlap_cpu_step:
            raise ValueError(
                f"ZeroOptimizer: shared parameters {sorted(shared)} need overlap_cpu_step=False: the overlapped CPU "
                "step runs during backward, before their gradients are summed over their groups"
            )
        # nothing to train (a frozen pipeline stage): the device of its frozen parameters, for the reductions
        self.device = (trainable or [p for _, p in items] or [torch.empty(0)])[0].device
        dtypes = {p.dtype for p in trainable}
        if any(p.device != self.device for p in trainable):
            raise ValueError(
                f"ZeroOptimizer: parameters are on several devices { ({p.device for p in trainable}) }"
            )
        if not all(d in (torch.float32, torch.bfloat16, torch.float16) for d in dtypes):
            raise ValueError(f"ZeroOptimizer: working dtypes {dtypes}; use float32, bfloat16 or float16")
        if torch.float16 in dtypes or (not trainable and loss_scale is not None):
            # an empty part of an fp16 model keeps the scaler its other parts keep, to join their overflow checks
            self.scaler: DynamicLossScaler | None = DynamicLossScaler(loss_scale or LossScaleConfig())
        elif loss_scale is not None:
            raise ValueError(f"ZeroOptimizer: loss_scale is only for fp16 parameters; these are {dtypes}")
        else:
            self.scaler = None
        self._master_device = torch.device("cpu") if config.cpu_offload else self.device
        self._stream = (
            torch.cuda.Stream(device=self.device)
            if self.device.type == "cuda" and config.overlap_comm
            else None
        )

        # stage 0 plans every bucket as if the group had one rank (see [Note: bucket layout])
        whole = config.stage == 0
        self.buckets = plan_buckets(
            groups,
            bucket_numel=config.bucket_numel,
            world_size=1 if whole else self.world_size,
            rank=0 if whole else self.rank,
            replicated=whole,
            alone=set(shared),
            comm={
                n: (
                    next(i for i, h in enumerate(self._groups) if h is g),
                    dist.get_world_size(g),
                    dist.get_rank(g),
                )
                for n, g in reduce_groups.items()
            },
        )
        for b in self.buckets:
            self._materialize(b)
        for gi, pg in enumerate(optimizer.param_groups):
            pg["params"] = [b.master for b in self.buckets if b.group_index == gi]
        optimizer.state.clear()
        self._slots = {s.name: (b, s) for b in self.buckets for s in b.slots}
        # [lo, hi)-pieces of replicated gradients and their weight 1/k: the correction grad_norm applies
        self._replicated = [
            (b, pc.start, pc.stop, 1.0 / replicas[pc.entry.name])
            for b in self.buckets
            for pc in flat_pieces(b.slots, b.lo, b.hi)
            if replicas.get(pc.entry.name, 1) > 1
        ]
        self._shared = [(self._slots[n][0], g) for n, g in shared.items()]  # in the caller's order
        self._shared_summed = False  # the shared gradients of this step window have been summed
        self._frozen = {
            n: p
            for n, p in (model.named_parameters() if isinstance(model, nn.Module) else [])
            if n not in self._slots
        }

        self._host = (
            HostOffload(
                optimizer, device=self.device, overlap=config.overlap_cpu_step, scaled=self.scaler is not None
            )
            if config.cpu_offload
            else None
        )
        self._sync = True
        self._accumulated = False  # a no_sync() backward left gradients in buckets since the last reduction
        self._in_backward = False
        self._backward_ends = 0
        self._next_bucket = 0
        self._step_count = 0
        # by bucket and slot index, so that the hooks keep no bucket alive (see [Note: hooks hold their owner weakly])
        self._hooks = register_grad_hooks_weakly(
            self,
            ZeroOptimizer._on_grad,
            ((s.param, (bi, si)) for bi, b in enumerate(self.buckets) for si, s in enumerate(b.slots)),
        )
        if config.overlap_allgather:
            if not isinstance(model, nn.Module):
                raise ValueError(
                    "ZeroOptimizer: overlap_allgather=True needs the model (an nn.Module) for its hooks"
                )
            self._install_gather_waits(model)

    # ---- layout -------------------------------------------------------------------------------------------
    def _materialize(self, b: Bucket) -> None:
        """Move the bucket's parameters into one flat working buffer and cut this rank's fp32 master shard."""
        b.working = torch.zeros(b.padded, dtype=b.dtype, device=self.device)
        for s in b.slots:
            view = b.working[s.offset : s.offset + s.numel]
            view.copy_(s.param.detach().reshape(-1))
            s.param.data = view.view(s.shape)
        # host masters stay in ordinary memory: only the working-dtype transfer buffers cross PCIe
        master = torch.empty(b.shard, dtype=torch.float32, device=self._master_device)
        master.copy_(b.working[b.lo : b.hi])
        b.master = master

    def update_master_params(self) -> None:
        """Refresh the fp32 master shards from the working parameters, e.g. after ``model.load_state_dict``.

        A parameter whose ``.data`` was replaced (rather than copied into) is copied back into its bucket first.
        """
        self._wait_gather(self.buckets)
        for b in self.buckets:
            for s in b.slots:
                view = b.working[s.offset : s.offset + s.numel]
                if s.param.data_ptr() != view.data_ptr():
                    view.copy_(s.param.detach().reshape(-1))
                    s.param.data = view.view(s.shape)
            b.master.copy_(b.working[b.lo : b.hi])

    def _install_gather_waits(self, model: nn.Module) -> None:
        owner = {id(s.param): b for b in self.buckets for s in b.slots}
        for module in model.modules():
            mine = {
                owner[id(p)].index: owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner
            }
            if mine:
                buckets = list(mine.values())
                self._hooks.append(
                    module.register_forward_pre_hook(lambda _m, _a, bs=buckets: self._wait_gather(bs))
                )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> dict:
        return self.optim.state

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    # ---- backward -----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with the fp16 loss scale applied; reduces the buckets unless inside ``no_sync()``."""
        ends = self._backward_ends
        (loss * self.scaler.scale if self.scaler else loss).backward(**kwargs)
        if self._backward_ends == ends:
            # no hook ran on this rank (every gradient was None): still issue the same collectives as the others
            self._end_of_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, for the backwards run inside the context."""
        old, self._sync = self._sync, False
        self._accumulated = True
        try:
            yield
        finally:
            self._sync = old

    def _on_grad(self, p: nn.Parameter, bucket: int, slot_index: int) -> None:
        b = self.buckets[bucket]
        slot = b.slots[slot_index]
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if p.grad is None:
            return
        if b.grad is None:
            # uninitialised: each slot's first gradient is copied in, which costs two thirds of adding it to zeros
            b.grad = torch.empty(b.padded, dtype=self.config.comm_dtype or b.dtype, device=self.device)
            b.grad[b.numel :].zero_()
            b.unwritten = set(range(len(b.slots)))
        view = b.grad[slot.offset : slot.offset + slot.numel]
        if slot_index in b.unwritten:
            view.copy_(p.grad.reshape(-1))
            b.unwritten.discard(slot_index)
        else:
            view.add_(p.grad.reshape(-1))
        p.grad = None
        b.received += 1
        if self._sync:
            # Buckets are reduced strictly in index order so every rank issues the same collectives in the same
            # order, even when a parameter gets no gradient on some rank (it is then flushed at the end).
            while self._next_bucket < len(self.buckets):
                nb = self.buckets[self._next_bucket]
                if nb.received < len(nb.slots):
                    break
                self._reduce(nb)
                self._next_bucket += 1

    def _end_of_backward(self) -> None:
        self._backward_ends += 1
        if self._sync:
            for b in self.buckets[self._next_bucket :]:
                self._reduce(b)
            self._accumulated = False
        self._wait_comm()
        for b in self.buckets:
            b.received = 0
        self._next_bucket = 0
        self._in_backward = False

    # ---- communication ------------------------------------------------------------------------------------
    def _reduce(self, b: Bucket) -> None:
        grad = b.grad
        if grad is None:
            grad = torch.zeros(b.padded, dtype=self.config.comm_dtype or b.dtype, device=self.device)
        for i in b.unwritten:  # parameters that got no gradient
            grad[b.slots[i].offset : b.slots[i].offset + b.slots[i].numel].zero_()
        b.grad, b.unwritten = None, set()
        b.reduced_in_window += 1
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            group = self._groups[b.comm]
            size = self.world_size if b.comm == 0 else b.world_size
            if size > 1:
                # before the sum, so fp16 gradients do not overflow in it
                grad.div_(self.grad_divisor if b.comm == 0 else size)
                fp8 = self.config.fp8_communication
                if self.config.stage == 2:
                    out = torch.empty(b.shard, dtype=grad.dtype, device=self.device)
                    (fp8_reduce_scatter_tensor if fp8 else reduce_scatter_tensor)(out, grad, group=group)
                else:
                    (fp8_all_reduce if fp8 else dist.all_reduce)(grad, group=group)
                    # stage 0 keeps the whole reduced bucket, stage 1 its own slice
                    out = grad if b.replicated else grad[b.lo : b.hi]
            else:
                out = grad
            self._add_master_grad(b, out, owned=out is grad or self.config.stage == 2)
        if stream is not None:
            grad.record_stream(stream)
            out.record_stream(stream)

    def _add_master_grad(self, b: Bucket, shard: torch.Tensor, *, owned: bool = True) -> None:
        """Add one reduction's gradient shard; ``owned``: nothing else uses ``shard``'s memory (not a view)."""
        if self._shared_summed and any(sb is b for sb, _ in self._shared):
            raise RuntimeError(
                f"ZeroOptimizer: a backward reduced the gradient of shared parameter {b.slots[0].name!r} after "
                "grad_norm()/clip_grad_norm() summed it over its group in this step; call step() or zero_grad() "
                "before the next backward"
            )
        inv = 1.0 / self.scaler.scale if self.scaler else 1.0
        if self._host is not None:
            self._host.land(b, shard, inv)
        else:
            # one reduction's gradient stays in the dtype it was reduced in (see [Note: working-precision gradient
            # shard] in cai-kernels); a view into an all-reduced bucket is copied, so the bucket is not kept alive
            b.grad_shard = accumulate_grad_shard(b.grad_shard, shard, scale=inv, owned=owned)

    def _wait_comm(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _finish_window(self) -> None:
        """Reduce whatever no backward has reduced yet (no_sync accumulation, or no backward at all)."""
        if self._in_backward:
            raise RuntimeError(
                "ZeroOptimizer: step()/clip_grad_norm() called while backward is still running"
            )
        for b in self.buckets:
            if b.reduced_in_window == 0 or self._accumulated:
                self._reduce(b)
        self._accumulated = False
        self._wait_comm()
        if self._host is not None:
            for b in self.buckets:
                self._host.settle(b)
        if not self._shared_summed:
            self._sum_shared()
            self._shared_summed = True

    # [Note: shared parameters]
    # A parameter in ``shared`` has a copy on other ranks (a tied embedding on the first and last pipeline stage),
    # each receiving part of its gradient; both copies must take the step of the summed gradient. Each copy has a
    # bucket of its own, so with the same data-parallel size its shard, [lo, hi) and padding are the same on every
    # rank of its group, and the shards can be summed elementwise. The sum runs once per step window, in
    # _finish_window: after the data-parallel reduction of every bucket (no_sync accumulation included) and before
    # the overflow check, clipping and the update, whichever of grad_norm / clip_grad_norm / step comes first
    # (``_shared_summed`` keeps it from running twice; step() and zero_grad() end the window). It sums in fp32:
    # the ranks' shards may be in different dtypes (one reduction stays in the working dtype, two sum in fp32) and
    # fp32 keeps the sum of the copies exact to rounding. A rank that got no gradient for its copy contributes the
    # zeros its reduction produced, and the sums run in the order of the caller's ``shared`` mapping: every rank
    # of a group must pass its shared parameters in the same order (their names may differ between stages).
    def _sum_shared(self) -> None:
        for b, group in self._shared:
            g = b.grad_shard
            if g is None:
                g = torch.zeros(b.shard, dtype=torch.float32, device=self._master_device)
            # on the device, where NCCL sums (host shards of cpu_offload travel there and back)
            total = g.to(self.device, torch.float32)
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
            b.grad_shard = total.to(self._master_device)

    def _check_shared(self) -> None:
        """With the debug checks on (``cai.mesh.debug_checks_on``): every copy of each shared parameter holds the
        same bits after the step, else it raises naming the parameter and the ranks that differ."""
        for b, group in self._shared:
            if not dist.is_initialized() or dist.get_world_size(group) == 1:
                continue
            self._wait_gather([b])
            mine = b.working.to(self.device)
            copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, mine, group=group)
            differ = [
                dist.get_global_rank(group, i) for i, c in enumerate(copies) if not torch.equal(c, mine)
            ]
            if differ:
                raise RuntimeError(
                    f"ZeroOptimizer: after step {self._step_count} the copies of shared parameter "
                    f"{b.slots[0].name!r} differ between rank {dist.get_rank()} and rank(s) {differ}; they must "
                    "take the same step of the summed gradient ([Note: shared parameters])"
                )

    def _gather(self, b: Bucket, *, async_op: bool, shard: torch.Tensor | None = None) -> None:
        """All-gather the updated master shard into the bucket's working buffer (the parameters' storage).
        ``shard``: the update already wrote it in the working dtype (into the working buffer itself at one rank)."""
        # the parameters are views set through .data, whose writes torch does not count: count them, so that
        # what is keyed on a parameter's version (cai-kernels' kept FP8 weights) sees the new values
        torch.autograd.graph.increment_version([s.param for s in b.slots])
        if b.world_size == 1 and self._host is None:  # one rank, or stage 0: the master is the whole bucket
            if shard is None:
                b.working.copy_(b.master)
            return
        if shard is None:
            shard = self._host.device_shard(b) if self._host is not None else b.master.to(dtype=b.dtype)
        if b.world_size == 1:
            b.working.copy_(shard)
            return
        work = all_gather_into_tensor(b.working, shard, group=self._groups[b.comm], async_op=async_op)
        if async_op:
            b.gather_work = [work, shard]

    def wait_for_params(self) -> None:
        """Wait for every outstanding post-step all-gather (``overlap_allgather=True``).

        Each module's forward waits for its own parameters; code that reads parameters outside a forward after
        ``step()`` (evaluation by hand, comparisons, exports) calls this first.
        """
        self._wait_gather(self.buckets)

    def _wait_gather(self, buckets: Iterable[Bucket]) -> None:
        for b in buckets:
            if b.gather_work:
                b.gather_work[0].wait()
                b.gather_work = []

    def _gather_all(self, written: Mapping[int, torch.Tensor]) -> None:
        for b in self.buckets:
            self._gather(b, async_op=self.config.overlap_allgather, shard=written.get(b.index))

    # ---- step ---------------------------------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets if b.grad_shard is not None]

    def _all_reduce_scalar(self, t: torch.Tensor, op: dist.ReduceOp, groups: Iterable) -> torch.Tensor:
        t = t.to(self.device)
        for g in groups:
            if dist.is_initialized() and dist.get_world_size(g) > 1:
                dist.all_reduce(t, op=op, group=g)
        return t

    def _overflowed_groups(self) -> list[int]:
        flags = torch.zeros(len(self.optim.param_groups), dtype=torch.float32, device=self._master_device)
        for b in self.buckets:
            if b.grad_shard is not None:
                flags[b.group_index] += (~torch.isfinite(b.grad_shard)).any().float()
        # over the data-parallel group at stage 0 too: a MAX of equal flags, but it guarantees one decision
        flags = self._all_reduce_scalar(flags, dist.ReduceOp.MAX, (self.group, *self.norm_groups))
        return [i for i, f in enumerate(flags.tolist()) if f > 0]

    def grad_norm(self, extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients over the data-parallel group, ``norm_groups`` and
        ``extra_groups``; a parameter in ``replicas`` counts once however many of those ranks hold it."""
        self._finish_window()
        sq = torch.zeros((), dtype=torch.float32, device=self._master_device)
        for g in self._master_grads():
            sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        # One norm per shard above, then the pieces of replicated parameters corrected from weight 1 to 1/k. The
        # result is at least 1/k of what is subtracted from, so the difference costs about k ulps at most.
        for b, start, stop, weight in self._replicated:
            if b.grad_shard is not None:
                piece = torch.linalg.vector_norm(b.grad_shard[start:stop], dtype=torch.float32).square()
                sq -= (1.0 - weight) * piece
        # stage 0: every rank of the data-parallel group holds the same whole gradients, summed once
        groups = (*self._shard_groups, *self.norm_groups, *extra_groups)
        return self._all_reduce_scalar(sq, dist.ReduceOp.SUM, groups).sqrt()

    def clip_grad_norm(self, max_norm: float, extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
        """Scale gradients so that their global L2 norm is at most ``max_norm``; returns the norm before clipping.

        The norm covers every rank's shards of the data-parallel group, plus the groups passed at construction
        (``norm_groups``) and ``extra_groups``, over which partial squared norms are summed; ``replicas`` says which
        parameters several of those ranks hold, so that they count once.
        """
        norm = self.grad_norm(extra_groups)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in self._master_grads():
            g.mul_(coef.to(g.device))
        return norm

    def step(self, closure: None = None) -> None:
        """Reduce what is pending (and sum shared gradients), skip on fp16 overflow, clip, update the shards and
        all-gather them (stage 0: copy them into the working parameters)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step: closures are not supported")
        self._wait_gather(self.buckets)
        self._finish_window()
        if self.scaler is not None:
            bad = self._overflowed_groups()
            old = self.scaler.scale
            self.scaler.update(bool(bad))
            if bad:
                logger.warning(
                    "fp16 gradient overflow in param group(s) %s at step %d: step skipped, loss scale %g -> %g "
                    "(%d overflow(s) so far)",
                    bad, self._step_count, old, self.scaler.scale, self.scaler.skipped_steps,
                )  # fmt: skip
                self.zero_grad()
                return
        if self.config.max_norm > 0:
            self.clip_grad_norm(self.config.max_norm)
        if self._host is not None:
            # steps and gathers bucket by bucket
            self._host.step(self.buckets, lambda b: self._gather(b, async_op=self.config.overlap_allgather))
        else:
            self._gather_all(self._device_step())
        self._step_count += 1
        for b in self.buckets:
            b.grad_shard = None
            b.reduced_in_window = 0
        self._shared_summed = False
        if self._shared and debug_checks_on():
            self._check_shared()

    def _device_step(self) -> dict[int, torch.Tensor]:
        """The wrapped optimizer's step on the master shards; returns the working-dtype shards it wrote, by bucket.

        A cai.kernels Adam (CPUAdam, HybridAdam, FusedAdam) steps bucket by bucket through ``adam_step``, which
        reads the gradient in the dtype it was reduced in and writes the new values in the working dtype in the
        same pass (into the working buffer itself at one rank; see [Note: device Adam] in cai-kernels). Other
        optimizers get fp32 gradients: those kept in a lower precision are cast a window of buckets at a time
        (one ``optimizer.step()`` per window), so an fp32 copy of every gradient never exists at once; the
        optimizer updates each parameter once per step either way (elementwise optimizers step exactly the
        parameters that have a gradient)."""
        if isinstance(self.optim, (CPUAdam, FusedAdam)):
            return self._adam_step()
        window: list[Bucket] = []
        cast = 0
        for b in self.buckets:
            g = b.grad_shard
            if g is not None and g.dtype != b.master.dtype:
                g = g.to(b.master.dtype)
                cast += g.numel() * g.element_size()
            b.master.grad = g
            window.append(b)
            if cast >= _CAST_WINDOW_BYTES:
                self._step_window(window)
                window, cast = [], 0
        self._step_window(window)
        return {}

    def _adam_step(self) -> dict[int, torch.Tensor]:
        # The wrapped step first, with no master holding a gradient: it updates nothing, but its hooks and the
        # counters an LR scheduler put on it see one step.
        self.optim.step()
        written = {}
        for b in self.buckets:
            if b.grad_shard is None:
                continue
            group = self.optim.param_groups[b.group_index]
            state = adam_state(self.optim, b.master)
            state["step"] += 1
            out = b.working[b.lo : b.hi] if b.world_size == 1 else torch.empty_like(b.master, dtype=b.dtype)
            adam_step(
                b.master, b.grad_shard, state["exp_avg"], state["exp_avg_sq"], group, step=state["step"],
                adamw=adamw_mode(self.optim, group), out=out,
            )  # fmt: skip
            written[b.index] = out
        return written

    def _step_window(self, window: list[Bucket]) -> None:
        if any(b.master.grad is not None for b in window):
            self.optim.step()
        for b in window:
            b.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: master shards, buckets (including no_sync accumulation) and working params."""
        self._wait_comm()
        if self._host is not None:
            self._host.wait_all(self.buckets)
        for b in self.buckets:
            b.grad_shard = None
            b.grad = None
            b.reduced_in_window = 0
            b.received = 0
            for s in b.slots:
                s.param.grad = None
        self._accumulated = False
        self._shared_summed = False
        self._in_backward = False  # in case a backward raised half-way
        self._next_bucket = 0

    # ---- state: the layout-independent protocol (cai.mesh.ShardedOptimizerState) and full state dicts -------
    def sharded_state_dict(self) -> dict[str, LocalShard]:
        """This rank's optimizer state as ``{"<param name>.<key>": LocalShard}`` (views; copy before mutating)."""
        self._wait_gather(self.buckets)
        return _state.optimizer_pieces(self.optim, self.buckets)

    def load_sharded_state_dict(self, read: Read) -> None:
        """Fill this rank's optimizer state from ``read(name, spec, dtype)``, whatever layout wrote it."""
        _state.load_optimizer_pieces(self.optim, self.buckets, read)

    def model_sharded_state_dict(self) -> dict[str, LocalShard]:
        """fp32 master pieces of the trainable parameters and the frozen parameters whole, by name."""
        return _state.master_pieces(self.buckets, self._frozen)

    def load_model_sharded_state_dict(self, read: Read) -> None:
        """Load master shards (and frozen parameters) by name, then refresh the working parameters from them."""
        self._wait_gather(self.buckets)
        _state.load_master_pieces(self.buckets, self._frozen, read)
        for b in self.buckets:
            self._gather(b, async_op=False)

    def ensure_state(self) -> None:
        """Create the optimizer state now (before the first step), so a loader knows its keys."""
        _state.ensure_state(self.optim, self.buckets)

    def param_groups_state(self) -> list[dict[str, Any]]:
        """Hyperparameters of each param group (JSON-able), with ``params`` as the list of parameter names."""
        return param_groups_state(self.optim.param_groups, self._group_names)

    def load_param_groups_state(self, groups: list[dict[str, Any]]) -> None:
        """Restore hyperparameters saved by :meth:`param_groups_state`; groups must hold the same parameter names."""
        load_param_groups_state(self.optim.param_groups, self._group_names, groups, owner="ZeroOptimizer")

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state by parameter name (all-gathered on every rank, on the CPU), for plain users.

        ``{"state": {name: {key: tensor}}, "param_groups": [...], "loss_scaler": {...} | None}``; a collective call.
        """
        if len(self._groups) > 1:
            raise NotImplementedError(
                "ZeroOptimizer.state_dict: parameters with their own reduce_groups are sharded over other groups; "
                "save through cai.ckpt.save_optimizer (the state protocol) instead"
            )
        self._wait_gather(self.buckets)
        state = _state.full_state(self.optim, self.buckets, device=self.device, group=self.group)
        return {
            "state": state,
            "param_groups": self.param_groups_state(),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` (written under any data-parallel size)."""
        self.load_sharded_state_dict(_state.reader(sd["state"]))
        self.load_param_groups_state(sd["param_groups"])
        if self.scaler is not None and sd.get("loss_scaler"):
            self.scaler.load_state_dict(sd["loss_scaler"])
