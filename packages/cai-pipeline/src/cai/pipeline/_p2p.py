"""Point-to-point transfer of pytrees (dicts of tensors, None and plain values) between pipeline ranks.

[Note: P2P messages and the metadata cache]
A message is one pytree. Its metadata (tree structure, each tensor's shape, dtype and requires_grad, and the
non-tensor leaves themselves) is pickled and compared with the last metadata sent on the same stream, a stream
being (peer, direction): activations forward and gradients backward are two streams even between the same two
ranks (the zero-bubble V sends both ways on one pair). Every message starts with an 8-byte header holding the
length of new metadata, or 0 when the receiver's cached copy is still right. Both sides know whether the stream has
carried metadata before, so in the steady state the receiver posts the header and the tensors (shaped by its cache)
in one ``batch_isend_irecv`` and the message costs one wait. When the metadata changes, the sender first sends
tensors of the old shapes (zeros; the receiver has already posted receives for them and drops them), then the new
metadata, then the real tensors: a change costs one wasted payload, never a wrong-sized receive (an error on gloo,
a hang on NCCL). The first message on a stream is header, metadata and tensors, received in three waits.

Messages between a pair of ranks are matched in the order they were sent (NCCL ignores tags), so a receiver must
take them in the sender's order; :class:`~cai.pipeline._runtime` knows every rank's plan and receives messages that
arrive before the one it needs into a buffer (see [Note: channel order]).

Pickle carries only metadata between ranks of one job, the same trust as ``torch.distributed``'s object
collectives; tensors travel as raw bytes.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils import _pytree as pytree

Direction = str  # "fwd" (activations) or "bwd" (gradients)

# P2POp checks its op by identity against c10d's own functions; ``dist.isend`` may be a counting wrapper
# (``CollectiveCounter``) while a test runs, so the ops are taken from c10d itself.
_ISEND, _IRECV = c10d.isend, c10d.irecv


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class _Meta:
    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorMeta for a tensor leaf, the value itself otherwise


def _describe(tree: Any) -> tuple[list[torch.Tensor], _Meta]:
    leaves, spec = pytree.tree_flatten(tree)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    metas = tuple(
        TensorMeta(tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves
    )
    return tensors, _Meta(spec, metas)


def _tensor_metas(meta: _Meta) -> list[TensorMeta]:
    return [m for m in meta.leaves if isinstance(m, TensorMeta)]


def _rebuild(meta: _Meta, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)
    leaves = [next(it) if isinstance(m, TensorMeta) else m for m in meta.leaves]
    return pytree.tree_unflatten(leaves, meta.spec)


class PipelineP2P:
    """Send and receive pytrees between ranks of one process group, caching metadata per (peer, direction).

    Args:
        group: the pipeline process group (None: the default group); peers are given as ranks in this group.
        device: where received tensors are allocated (default: the accelerator's current device, else CPU).
        enable_metadata_cache: False sends the metadata with every message (Colossal-AI's switch).

    Sends never block: :meth:`send` posts the message and keeps its buffers until :meth:`wait_sends`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        enable_metadata_cache: bool = True,
    ) -> None:
        self.group = group
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend(group) == "nccl"
                else None
            )
        self.device = device or torch.device("cpu")
        self.enable_metadata_cache = enable_metadata_cache
        self._sent_meta: dict[tuple[int, Direction], tuple[bytes, _Meta]] = {}
        self._recv_meta: dict[tuple[int, Direction], _Meta] = {}
        self._pending: list[tuple[list[Any], list[torch.Tensor]]] = []
        self.bytes_sent: dict[tuple[int, Direction], int] = {}  # tensor payload only, per stream
        self.metadata_sent = 0  # messages that carried new metadata

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send(self, tree: Any, peer: int, direction: Direction) -> None:
        tensors, meta = _describe(tree)
        tensors = [t.detach().contiguous() for t in tensors]
        blob = pickle.dumps(meta)
        key = (peer, direction)
        old = self._sent_meta.get(key) if self.enable_metadata_cache else None
        bufs = []
        if old is not None and old[0] == blob:
            bufs.append(torch.zeros(1, dtype=torch.int64, device=self.device))
        else:
            bufs.append(torch.tensor([len(blob)], dtype=torch.int64, device=self.device))
            if old is not None:  # the receiver posted receives shaped by the old metadata: fill them
                bufs += [
                    torch.zeros(m.shape, dtype=m.dtype, device=self.device) for m in _tensor_metas(old[1])
                ]
            bufs.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device))
            self._sent_meta[key] = (blob, meta)
            self.metadata_sent += 1
        bufs += tensors
        dst = self._global(peer)
        works = dist.batch_isend_irecv([dist.P2POp(_ISEND, b, dst, self.group) for b in bufs])
        self._pending.append((works, bufs))
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + sum(
            t.numel() * t.element_size() for t in tensors
        )
        self._reap()

    def recv(self, peer: int, direction: Direction) -> Any:
        src = self._global(peer)
        key = (peer, direction)
        meta = self._recv_meta.get(key) if self.enable_metadata_cache else None
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        tensors = self._alloc(meta) if meta is not None else []
        self._wait(
            dist.batch_isend_irecv([dist.P2POp(_IRECV, b, src, self.group) for b in [header, *tensors]])
        )
        n = int(header.item())
        if n:
            blob = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._wait(dist.batch_isend_irecv([dist.P2POp(_IRECV, blob, src, self.group)]))
            with warnings.catch_warnings():
                # torch's own TreeSpec unpickling trips its LeafSpec deprecation (torch 2.13); nothing to act on
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                meta = pickle.loads(blob.cpu().numpy().tobytes())
            self._recv_meta[key] = meta
            tensors = self._alloc(meta)
            if tensors:
                self._wait(dist.batch_isend_irecv([dist.P2POp(_IRECV, t, src, self.group) for t in tensors]))
        elif meta is None:
            raise RuntimeError(
                f"PipelineP2P: rank {peer} sent a {direction} message without metadata and none is cached; the two "
                "ranks disagree on enable_metadata_cache or on the message order"
            )
        for t, m in zip(tensors, _tensor_metas(meta), strict=True):
            t.requires_grad_(m.requires_grad)
        return _rebuild(meta, tensors)

    def _alloc(self, meta: _Meta) -> list[torch.Tensor]:
        return [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in _tensor_metas(meta)]

    @staticmethod
    def _wait(works: list[Any]) -> None:
        for w in works:
            w.wait()

    def _reap(self) -> None:
        self._pending = [(w, b) for w, b in self._pending if not all(x.is_completed() for x in w)]

    def wait_sends(self) -> None:
        """Wait for every posted send (their buffers are released)."""
        for works, _ in self._pending:
            self._wait(works)
        self._pending.clear()
