"""The state protocol of a tensor-parallel model (see the repo's DESIGN.md): each parameter and persistent buffer
is reported under its Hugging Face name as this rank's block of the global tensor, so cai-ckpt writes the
unsharded Hugging Face layout and any layout can read it back.

Vocabulary padding is outside every block (see [Note: vocabulary padding]); replicated kv heads report the same
block on each replica, which a writer keeps once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from cai.mesh import LocalShard, ShardSpec
from cai.shardformer._linear import ParallelModule


def _entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, ShardSpec]]:
    """(name, local tensor, the view of it that the spec describes, spec) for every state-dict entry."""
    keys = set(model.state_dict(keep_vars=True))
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
            module, pname = owner.get(id(local), (owning, name))
            dim = module.split_dims.get(pname) if isinstance(module, ParallelModule) else None
            if dim is None:
                yield key, local, local, ShardSpec.full(local.shape)
                continue
            pieces = module.pieces(pname, dist.get_rank(module.process_group))
            if len(pieces) != 1:
                raise NotImplementedError(
                    f"{key}: a {type(module).__name__} with {len(pieces)} pieces per rank (a fused projection) "
                    f"cannot be reported as one block yet; shard the projections separately"
                )
            (p,) = pieces
            shape = list(local.shape)
            shape[dim] = module.full_size(pname)
            offsets = [p.global_ if d == dim else 0 for d in range(local.dim())]
            block = [p.length if d == dim else s for d, s in enumerate(local.shape)]
            spec = ShardSpec(global_shape=tuple(shape), offsets=tuple(offsets), block_shape=tuple(block))
            yield key, local, local.narrow(dim, p.local, p.length), spec


def sharded_state_dict(model: nn.Module) -> dict[str, LocalShard]:
    """Name -> (this rank's block, its ShardSpec) for every parameter and persistent buffer of `model`."""
    return {key: LocalShard(view.detach(), spec) for key, _, view, spec in _entries(model)}


def load_sharded_state_dict(
    model: nn.Module, read: Callable[[str, ShardSpec, torch.dtype], torch.Tensor]
) -> None:
    """Fill every block of `model` with `read(name, spec, dtype)` (what cai-ckpt's reader provides)."""
    with torch.no_grad():
        for key, _, view, spec in _entries(model):
            view.copy_(read(key, spec, view.dtype))


def enable_state_protocol(model: nn.Module) -> nn.Module:
    """Give `model` the `sharded_state_dict()` / `load_sharded_state_dict(read)` methods that cai-ckpt looks
    for, bound to this instance only."""
    model.sharded_state_dict = lambda: sharded_state_dict(model)
    model.load_sharded_state_dict = lambda read: load_sharded_state_dict(model, read)
    return model
