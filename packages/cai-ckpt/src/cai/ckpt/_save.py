"""Parallel writing of named, possibly sharded tensors as safetensors shard files plus an index."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cai.ckpt._format import SafetensorsWriter, dtype_from_name, write_json
from cai.ckpt._plan import FilePlan, State, local_metadata, make_plan, pieces
from cai.ckpt._txn import IO_THREADS, SaveFailed, Transaction, global_rank, run_parallel
from cai.mesh import LocalShard, ShardSpec

# Host buffers of asynchronous saves, reused from one save to the next (pinned when CUDA is present).
_host_buffers: dict[tuple, torch.Tensor] = {}


def _host_copy(key: tuple, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    buf = _host_buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != dtype:
        buf = torch.empty(t.shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        _host_buffers[key] = buf
    buf.copy_(t, non_blocking=True)
    return buf


def join(subdir: str, name: str) -> str:
    return f"{subdir}/{name}" if subdir else name


def full_state(tensors: dict[str, torch.Tensor]) -> dict[str, LocalShard]:
    """Adapt a plain dict of full tensors to the sharded protocol (every piece is the whole tensor)."""
    return {k: LocalShard(v.detach(), ShardSpec.full(v.shape)) for k, v in tensors.items()}


def write_sharded(
    txn: Transaction,
    state: State,
    *,
    subdir: str,
    prefix: str,
    index_name: str,
    size_per_shard: float,
    out_dtype: Callable[[str, torch.dtype], torch.dtype],
    use_async: bool,
    extra: Any = None,
    merge: Callable[[list[Any]], Any] = list,
) -> Any:
    """Write ``state`` (pieces of global tensors, by name; a list where a rank holds several pieces of one
    tensor) as full tensors into ``txn``'s ``subdir``.

    Every rank calls this with its own pieces. Shard files are balanced over ranks by bytes; the rank that
    owns a file receives the pieces it lacks (``dist.isend``/``dist.recv``, in one global order so that no
    rank waits on a rank that waits on it) and assembles one tensor at a time, so a rank holds at most one
    tensor per I/O thread beyond its own state (plus, for an asynchronous save, the files it writes, in host
    buffers). Pieces are sent from the state itself (no copy for contiguous host tensors under gloo or device
    tensors under NCCL).
    """
    group, rank, world = txn.group, txn.rank, txn.world
    meta = local_metadata(state)
    held = {name: {s.spec: s.tensor for s in pieces(entry)} for name, entry in state.items()}
    meta["failed"] = txn.failed
    meta["extra"] = extra
    metas = [meta]
    if world > 1:
        metas = [None] * world
        dist.all_gather_object(metas, meta, group=group)
    for r, m in enumerate(metas):
        if m["failed"]:
            # A rank failed in an earlier part of this checkpoint: every rank stops here, together.
            raise SaveFailed(txn.final, r, m["failed"])
    merged = merge([m["extra"] for m in metas])
    files, aliases = make_plan(metas, prefix=prefix, size_per_shard_mb=size_per_shard, out_dtype=out_dtype)
    comm_device = torch.device("cpu")
    if world > 1 and dist.get_backend(group) == "nccl":
        comm_device = torch.device("cuda", torch.cuda.current_device())

    # Post every send first: sends never block, so receives in plan order cannot deadlock.
    sends = []
    for f in files:
        if f.owner == rank:
            continue
        for t in f.tensors:
            for src, spec in t.sources:
                if src == rank and spec.numel:
                    piece = held[t.name][spec].detach().to(comm_device).contiguous()
                    sends.append((dist.isend(piece, dst=global_rank(group, f.owner), group=group), piece))

    mine = [f for f in files if f.owner == rank]
    received: set[str] = set()

    def assembled(f: FilePlan) -> Iterator[tuple[str, torch.Tensor]]:
        for t in f.tensors:
            full = _assemble(t, held, metas, rank, group, comm_device)
            received.add(t.name)
            yield t.name, full

    try:
        local_only = all(
            src == rank or not spec.numel for f in mine for t in f.tensors for src, spec in t.sources
        )
        jobs = []
        for f in mine:
            if use_async:
                # One copy into reused (pinned) host buffers, straight from the source tensor where it is whole.
                snapshot = [
                    (
                        t.name,
                        _host_copy(
                            (subdir, t.name),
                            _assemble(t, held, metas, rank, group, comm_device, raw=True),
                            t.dtype,
                        ),
                    )
                    for t in f.tensors
                ]
                txn.jobs.append(lambda f=f, snapshot=snapshot: _write_file(txn, subdir, f, snapshot))
            else:
                jobs.append(lambda f=f: _write_file(txn, subdir, f, assembled(f)))
        # Receives must follow the plan's order, so only files that need no pieces from other ranks go in parallel.
        try:
            run_parallel(jobs, IO_THREADS if local_only else 1)
        except Exception as e:
            # Not raised yet: this rank still takes the pieces others send it (their sends complete only then),
            # and joins the next metadata exchange (or the commit) to tell them.
            txn.failed = repr(e)
            for f in mine:
                for t in f.tensors:
                    if t.name not in received:
                        _assemble(t, held, metas, rank, group, comm_device)
        if use_async and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non_blocking device-to-host copies must land before the writer reads them
    finally:
        # Whatever happened here, the owners get their pieces: they finish and report the failure through the
        # next metadata exchange or the commit, instead of dying on a broken connection.
        for work, _ in sends:
            work.wait()

    if rank == 0:
        # The layout it was saved from, in brief: how tensors were split over ranks (flat ranges, blocks).
        kinds = set()
        for m in metas:
            for info in m["tensors"].values():
                for spec_dict in info["specs"]:
                    spec = ShardSpec.from_dict(spec_dict)
                    if not spec.is_full:
                        kinds.add("flat" if spec.flat_range is not None else "block")
        counts = [len(t.sources) for f in files for t in f.tensors]
        txn.layout[join(subdir, prefix)] = {
            "tensors": len(counts),
            "sharded_tensors": sum(p > 1 for p in counts),
            "pieces": sum(counts),
            "piece_kinds": sorted(kinds),
            "files_per_rank": [sum(f.owner == r for f in files) for r in range(world)],
        }
        index = {
            "metadata": {
                "total_size": sum(f.nbytes for f in files),
                "format": "cai-ckpt",
                "aliases": aliases,
            },
            "weight_map": {t.name: f.name for f in files for t in f.tensors},
        }
        txn.record(join(subdir, index_name), write_json(txn.path(join(subdir, index_name)), index))
    return merged


def _assemble(t, held, metas, rank, group, comm_device, raw: bool = False) -> torch.Tensor:
    """The full tensor ``t`` on the CPU in its stored dtype (``raw``: a local whole tensor as it is); ``held`` is
    this rank's pieces, name -> spec -> tensor."""
    if len(t.sources) == 1 and t.sources[0][0] == rank and t.sources[0][1].is_full:
        local = held[t.name][t.sources[0][1]].detach()
        return local if raw else local.to(device="cpu", dtype=t.dtype)
    out = torch.empty(t.global_shape, dtype=t.dtype)
    for src, spec in t.sources:
        if not spec.numel:
            continue
        if src == rank:
            piece = held[t.name][spec].detach()
        else:
            dtype = dtype_from_name(metas[src]["tensors"][t.name]["dtype"])
            piece = torch.empty(spec.local_shape, dtype=dtype, device=comm_device)
            dist.recv(piece, src=global_rank(group, src), group=group)
        spec.place(piece.cpu(), out)
    return out


def _write_file(txn: Transaction, subdir: str, f: FilePlan, tensors: Any) -> None:
    entries = [(t.name, t.dtype, t.global_shape) for t in f.tensors]
    writer = SafetensorsWriter(txn.path(join(subdir, f.name)), entries, {"format": "pt"})
    for name, tensor in tensors:
        writer.write(name, tensor)
    txn.record(join(subdir, f.name), writer.close())
