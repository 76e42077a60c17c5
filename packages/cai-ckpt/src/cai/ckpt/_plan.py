"""Save planning: which tensors go to which file, which rank writes each file, which rank sends each piece.

Every rank computes the same plan from the same gathered metadata, so no further agreement is needed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cai.ckpt._format import dtype_from_name, dtype_name, shard_file_name
from cai.mesh import LocalShard, ShardSpec


@dataclass
class TensorPlan:
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype  # as stored in the file
    sources: list[tuple[int, ShardSpec]] = field(default_factory=list)  # (rank, spec): one per distinct piece

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class FilePlan:
    name: str
    owner: int
    tensors: list[TensorPlan]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


State = dict[str, LocalShard | list[LocalShard]]
"""What ``sharded_state_dict()`` returns: per name, this rank's piece, or a list of its disjoint pieces."""


def pieces(entry: LocalShard | Sequence[LocalShard]) -> list[LocalShard]:
    """A state entry's pieces. A rank may hold several disjoint blocks of one tensor (GPT-2's fused ``c_attn``:
    its heads of q, of k and of v); it reports them as a list, every other entry is one ``LocalShard``."""
    return list(entry) if isinstance(entry, list) else [entry]


def global_shapes(state: State) -> dict[str, tuple[int, ...]]:
    """Name -> global shape, for the key checks of a load (names with no piece on this rank left out)."""
    return {name: p[0].spec.global_shape for name, entry in state.items() if (p := pieces(entry))}


# [Note: tied weights]
# A tied weight is one tensor under several names (a causal LM's embedding and output head). A state reports it
# either once, under its first name (`named_parameters` does), or under every name with the same piece: the same
# memory, dtype, shape, strides and spec. A save stores such a piece once, under the first name, and records the
# other names as aliases in the index's metadata (`tied_names`). A load takes a checkpoint of either kind into a
# target of either kind: checkpoint aliases the target does not report are not unexpected, and a name the target
# ties to another that the checkpoint lacks reads the stored one (`CheckpointReader.add_ties`), so a weight stored
# once by one layout (or by `save_pretrained`) fills every name of another. (A checkpoint that stores a tied
# weight twice, as two tensors, loads only into a target that reports both names.) A state whose pieces of a tied
# weight are different tensors (a master copy under one name, the working parameter under the other) would be
# stored twice: states that keep masters report the master piece under every name of the weight.
def tied_names(state: State) -> dict[str, str]:
    """Name -> the first name reporting the same piece, for the later names of tied weights (see [Note: tied
    weights]); names whose piece is empty or who report several pieces are never aliases."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, entry in state.items():
        shards = pieces(entry)
        if len(shards) != 1 or not shards[0].tensor.numel():
            continue
        tensor, spec = shards[0]
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(), spec)
        first = seen.setdefault(key, name)
        if first != name:
            out[name] = first
    return out


def local_metadata(state: State) -> dict[str, Any]:
    """What a rank publishes about its pieces: small and JSON-able. Also finds aliases (tied weights)."""
    tensors = {}
    aliases = tied_names(state)
    for name, entry in state.items():
        shards = pieces(entry)
        for tensor, spec in shards:
            if tuple(tensor.shape) != spec.local_shape:
                raise ValueError(
                    f"{name}: local tensor shape {tuple(tensor.shape)} does not match its spec {spec.local_shape}"
                )
            if tensor.dtype != shards[0].tensor.dtype:
                raise ValueError(
                    f"{name}: this rank's pieces have dtypes {shards[0].tensor.dtype} and {tensor.dtype}; "
                    "report every piece of one tensor in the same dtype"
                )
        if not shards or name in aliases:
            continue  # an alias: the same memory as an earlier name, stored once under that name
        tensors[name] = {
            "specs": [spec.to_dict() for _, spec in shards],
            "dtype": dtype_name(shards[0].tensor.dtype),
        }
    return {"tensors": tensors, "aliases": aliases}


def make_plan(
    metas: list[dict[str, Any]],
    *,
    prefix: str,
    size_per_shard_mb: float,
    out_dtype: Any,
) -> tuple[list[FilePlan], dict[str, str]]:
    """Shard files balanced over ranks by bytes. ``out_dtype(name, dtype) -> dtype`` picks the stored dtype."""
    world = len(metas)
    tensors: dict[str, TensorPlan] = {}
    holders: dict[str, dict[ShardSpec, list[int]]] = {}
    for rank, meta in enumerate(metas):
        for name, info in meta["tensors"].items():
            for spec_dict in info["specs"]:
                spec = ShardSpec.from_dict(spec_dict)
                t = tensors.get(name)
                if t is None:
                    t = tensors[name] = TensorPlan(
                        name, spec.global_shape, out_dtype(name, dtype_from_name(info["dtype"]))
                    )
                    holders[name] = {}
                elif t.global_shape != spec.global_shape:
                    raise ValueError(
                        f"{name}: ranks disagree on the global shape ({t.global_shape} vs {spec.global_shape})"
                    )
                if spec.numel or not math.prod(spec.global_shape):
                    holders[name].setdefault(spec, []).append(rank)
    aliases: dict[str, str] = {}
    for meta in metas:
        for alias, target in meta["aliases"].items():
            if alias not in tensors:
                aliases[alias] = target

    # Pack tensors into files in state-dict order (a new file when the next tensor would overflow it).
    limit = size_per_shard_mb * 1024 * 1024
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors.values():
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if not groups[-1]:
        groups.pop()
    total = len(groups)

    # Largest file first to the least loaded rank (LPT), ties broken by rank so every rank agrees.
    load = [(0, r) for r in range(world)]
    heapq.heapify(load)
    owners = [0] * total
    for i in sorted(range(total), key=lambda i: (-sum(t.nbytes for t in groups[i]), i)):
        used, r = heapq.heappop(load)
        owners[i] = r
        heapq.heappush(load, (used + sum(t.nbytes for t in groups[i]), r))

    files = []
    for i, group in enumerate(groups):
        owner = owners[i]
        for t in group:
            covered = 0
            for n, (spec, ranks) in enumerate(holders[t.name].items()):
                # The writer uses its own copy when it has one; replicas elsewhere are spread over holders.
                src = owner if owner in ranks else ranks[(i + n) % len(ranks)]
                t.sources.append((src, spec))
                covered += spec.numel
            if covered < math.prod(t.global_shape):
                raise ValueError(
                    f"{t.name}: the pieces reported by all ranks hold {covered} of {math.prod(t.global_shape)} elements "
                    f"of shape {t.global_shape}; every element must be held by some rank"
                )
        files.append(FilePlan(shard_file_name(prefix, i + 1, total), owner, group))
    return files, aliases
