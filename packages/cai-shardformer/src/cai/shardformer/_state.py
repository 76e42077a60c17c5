"""The state protocol of a tensor-parallel model (see the repo's DESIGN.md): each parameter and persistent buffer
is reported under its Hugging Face name as this rank's block of the global tensor, so cai-ckpt writes the
unsharded Hugging Face layout and any layout can read it back.

Vocabulary padding is outside every block (see [Note: vocabulary padding]); replicated kv heads report the same
block on each replica, which a writer keeps once. A fused projection whose rank holds several separate row blocks
(GPT-2's `c_attn`: its heads of q, of k and of v) reports them as a list of pieces under its one name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import LocalShard, ShardSpec
from cai.shardformer._linear import ParallelModule

Rename = Callable[[str], str]


def _same(key: str) -> str:
    return key


def _entries(
    model: nn.Module, rename: Rename = _same
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, ShardSpec]]:
    """(name, local tensor, the view of it that the spec describes, spec) for every block of every state-dict
    entry: one per entry, except a fused projection's, which gives one per piece (see [Note: pieces]).

    Names are ``rename(state-dict key)``; two keys renamed to one name (a tied weight that a pipeline rank holds in
    two chunks) are one entry, reported once."""
    keys = set(model.state_dict(keep_vars=True))
    reported: dict[str, torch.Tensor] = {}
    # A parameter tied to a parallel layer's (BERT's `cls.predictions.bias` is its decoder's bias) is a shard
    # under every name: each name is reported through the layer that owns it.
    owner = {
        id(p): (m, n)
        for m in model.modules()
        if isinstance(m, ParallelModule)
        for n, p in m.named_parameters(recurse=False)
    }
    for mname, owning in model.named_modules():
        own = [*owning.named_parameters(recurse=False), *owning.named_buffers(recurse=False)]
        for name, local in own:
            key = f"{mname}.{name}" if mname else name
            if key not in keys or local is None:
                continue
            key = rename(key)
            if key in reported:
                if reported[key] is not local:
                    raise ValueError(
                        f"{key}: two different tensors of the model are renamed to this one name"
                    )
                continue
            reported[key] = local
            module, pname = owner.get(id(local), (owning, name))
            dim = module.split_dims.get(pname) if isinstance(module, ParallelModule) else None
            if dim is None:
                yield key, local, local, ShardSpec.full(local.shape)
                continue
            shape = list(local.shape)
            shape[dim] = module.full_size(pname)
            for p in module.pieces(pname, dist.get_rank(module.process_group)):
                offsets = [p.global_ if d == dim else 0 for d in range(local.dim())]
                block = [p.length if d == dim else s for d, s in enumerate(local.shape)]
                spec = ShardSpec(global_shape=tuple(shape), offsets=tuple(offsets), block_shape=tuple(block))
                yield key, local, local.narrow(dim, p.local, p.length), spec


def sharded_state_dict(model: nn.Module, rename: Rename = _same) -> dict[str, LocalShard | list[LocalShard]]:
    """Name -> (this rank's block, its ShardSpec) for every parameter and persistent buffer of `model`; a list of
    blocks for a fused projection that holds several on this rank (cai-ckpt writes each where it belongs).

    `rename` maps the model's state-dict keys to the names written (a pipeline stage's keys to the full model's)."""
    out: dict[str, list[LocalShard]] = {}
    for key, _, view, spec in _entries(model, rename):
        out.setdefault(key, []).append(LocalShard(view.detach(), spec))
    return {key: shards[0] if len(shards) == 1 else shards for key, shards in out.items()}


def load_sharded_state_dict(
    model: nn.Module, read: Callable[[str, ShardSpec, torch.dtype], torch.Tensor], rename: Rename = _same
) -> None:
    """Fill every block of `model` with `read(name, spec, dtype)` (what cai-ckpt's reader provides).

    A tied weight is read once, under its first name: a checkpoint may store it under that name only (Hugging
    Face's `save_pretrained` does)."""
    first: dict[int, str] = {}
    with torch.no_grad():
        for key, local, view, spec in _entries(model, rename):
            if first.setdefault(id(local), key) == key:
                view.copy_(read(key, spec, view.dtype))


def enable_state_protocol(model: nn.Module) -> nn.Module:
    """Give `model` the `sharded_state_dict()` / `load_sharded_state_dict(read)` methods that cai-ckpt looks
    for, bound to this instance only."""
    model.sharded_state_dict = lambda: sharded_state_dict(model)
    model.load_sharded_state_dict = lambda read: load_sharded_state_dict(model, read)
    return model


# [Note: tp blocks under a flat optimizer shard]
# An optimizer that shards fp32 masters over the data-parallel axis (cai-zero) reports each parameter as a flat
# range of the rank's *local* tp tensor (`global_shape` = the local shape). The checkpoint wants ranges of the
# global tensor. When the tp block is a prefix of the local tensor's flattening (a split along dim 0 starting at
# local row 0, possibly followed by vocabulary padding rows; or the whole local tensor, as for a row-parallel split
# along dim 1), a flat range of the local tensor is the same flat range of the block: the composed spec is the tp
# block with that flat_range, cut at the block's end (the padding). Other layouts are refused.
def _prefix_numel(key: str, local: torch.Tensor, view: torch.Tensor) -> int:
    if view.data_ptr() != local.data_ptr() or not view.is_contiguous():
        raise NotImplementedError(
            f"{key}: the tp block of shape {tuple(view.shape)} is not a prefix of the local tensor of shape "
            f"{tuple(local.shape)}, so a flat optimizer shard of it is not a flat range of the checkpoint tensor"
        )
    return view.numel()


_Tp = dict[str, tuple[torch.Tensor, torch.Tensor, ShardSpec]]  # name -> (local tensor, tp block view, spec)


def _tp_entries(model: nn.Module, rename: Rename) -> _Tp:
    out: _Tp = {}
    for key, local, view, spec in _entries(model, rename):
        if key in out:
            # Several row blocks of one tensor on a rank: a flat range of the local tensor crosses them.
            raise NotImplementedError(
                f"{key}: a fused projection holds several row blocks of the global tensor on each tp rank, so a "
                "flat optimizer shard of it is not one range of the checkpoint tensor; tp x ZeRO checkpoints "
                "need separate projections (or save with zero_stage=0)"
            )
        out[key] = (local, view, spec)
    return out


def _block_range(spec: ShardSpec, start: int, stop: int) -> ShardSpec:
    return ShardSpec(
        global_shape=spec.global_shape,
        offsets=spec.offsets,
        block_shape=spec.block_shape,
        flat_range=(start, stop),
    )


def _to_global(tp: _Tp, param: str, shard: LocalShard) -> LocalShard | None:
    """A flat piece of `param`'s local tp tensor as a piece of the global tensor; None when it is all padding."""
    local, view, spec = tp[param]
    start, stop = shard.spec.flat_range or (0, local.numel())
    end = _prefix_numel(param, local, view)
    if start >= end:
        return None
    stop = min(stop, end)
    return LocalShard(shard.tensor.reshape(-1)[: stop - start], _block_range(spec, start, stop))


def _read_local(
    tp: _Tp, param: str, read, name: str, local_spec: ShardSpec, dtype: torch.dtype
) -> torch.Tensor:
    """What `read` gives for a flat piece of `param`'s local tp tensor (vocabulary padding zero)."""
    local, view, spec = tp[param]
    start, stop = local_spec.flat_range or (0, local.numel())
    end = _prefix_numel(param, local, view)
    out = torch.zeros(stop - start, dtype=dtype)
    if start < end:
        out[: min(stop, end) - start] = read(name, _block_range(spec, start, min(stop, end)), dtype).reshape(
            -1
        )
    return out if local_spec.flat_range else out.reshape(local_spec.block_shape)


class _MasterState:
    """`tp_model_state`'s object: the state protocol of a tp model whose masters live in an optimizer."""

    def __init__(self, model: nn.Module, optimizer, rename: Rename) -> None:
        self.model, self.optimizer, self.rename = model, optimizer, rename

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        tp = _tp_entries(self.model, self.rename)
        # The optimizer knows a tied weight by its first name only; every name of it reports the one master piece,
        # so that it is stored once (see [Note: tied weights] in cai-ckpt's `_plan.py`).
        masters = {
            id(tp[key][0]): _to_global(tp, key, shard)
            for key, shard in self.optimizer.model_sharded_state_dict().items()
        }
        out = {}
        for key, (local, view, spec) in tp.items():
            if id(local) not in masters:
                out[key] = LocalShard(view.detach(), spec)
            elif (piece := masters[id(local)]) is not None:  # None: this rank's piece is all padding
                out[key] = piece
        return out

    def load_sharded_state_dict(self, read: Callable[[str, ShardSpec, torch.dtype], torch.Tensor]) -> None:
        tp = _tp_entries(self.model, self.rename)
        mastered = {id(tp[key][0]) for key in self.optimizer.model_sharded_state_dict()}
        self.optimizer.load_model_sharded_state_dict(
            lambda key, spec, dtype: _read_local(tp, key, read, key, spec, dtype)
        )
        with torch.no_grad():
            for key, (local, view, spec) in tp.items():
                # every name of a mastered weight (both of a tied one) was refreshed from its master
                if id(local) not in mastered:
                    view.copy_(read(key, spec, view.dtype))


class _OptimizerState:
    """`tp_optimizer_state`'s object: the optimizer protocol with every flat state piece in global coordinates."""

    def __init__(self, model: nn.Module, optimizer, rename: Rename) -> None:
        self.model, self.optimizer, self.rename = model, optimizer, rename

    def _param(self, tp: _Tp, key: str, shard: LocalShard | None = None) -> str | None:
        param = key.rsplit(".", 1)[0]  # "<param name>.<state key>"; state keys have no dot
        if param not in tp:
            raise KeyError(
                f"{key}: the optimizer reports state of {param!r}, which is not a parameter of the model"
            )
        if shard is not None and shard.spec.global_shape != tuple(tp[param][0].shape):
            return None  # a scalar (step): the same in every layout
        return param

    def sharded_state_dict(self) -> dict[str, LocalShard]:
        tp = _tp_entries(self.model, self.rename)
        out = {}
        for key, shard in self.optimizer.sharded_state_dict().items():
            param = self._param(tp, key, shard)
            piece = shard if param is None else _to_global(tp, param, shard)
            if piece is not None:
                out[key] = piece
        return out

    def load_sharded_state_dict(self, read: Callable[[str, ShardSpec, torch.dtype], torch.Tensor]) -> None:
        tp = _tp_entries(self.model, self.rename)

        def read_local(key: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
            param = self._param(tp, key)
            if spec.global_shape != tuple(tp[param][0].shape):
                return read(key, spec, dtype)
            return _read_local(tp, param, read, key, spec, dtype)

        self.optimizer.load_sharded_state_dict(read_local)

    def param_groups_state(self):
        return self.optimizer.param_groups_state()

    def load_param_groups_state(self, groups) -> None:
        self.optimizer.load_param_groups_state(groups)


def tp_model_state(model: nn.Module, optimizer, *, rename: Rename = _same):
    """The state-protocol object for `cai.ckpt.save_model` / `load_model` of a tp model whose fp32 master weights
    an optimizer shards over the data-parallel axis (cai-zero's `ZeroOptimizer`, or anything with
    `model_sharded_state_dict()` / `load_model_sharded_state_dict(read)`): the masters are written as blocks of the
    global Hugging Face tensors (see [Note: tp blocks under a flat optimizer shard]), and a load refills them
    (the optimizer then refreshes the working parameters). `rename` maps the model's state-dict keys to the names
    the optimizer knows its parameters by (a pipeline stage's `PipelineModel.global_name`); default: the keys.

    Example:
        >>> opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model=model, group=mesh.group("dp"))
        >>> cai.ckpt.save_model(tp_model_state(model, opt), "ckpt/model", config=model.config)
        >>> cai.ckpt.save_optimizer(tp_optimizer_state(model, opt), "ckpt/optim")
    """
    return _MasterState(model, optimizer, rename)


def tp_optimizer_state(model: nn.Module, optimizer, *, rename: Rename = _same):
    """The optimizer counterpart of `tp_model_state`, for `cai.ckpt.save_optimizer` / `load_optimizer`: the
    optimizer's per-parameter state (`<param name>.exp_avg`, ...) as blocks of the global tensors, scalars
    (`step`) as they are, param groups passed through."""
    return _OptimizerState(model, optimizer, rename)
