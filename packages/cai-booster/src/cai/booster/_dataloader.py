"""Distributed, resumable data loading: a sampler that can start mid-epoch, and a DataLoader that knows how
many batches it has handed out, so ``state_dict()`` names the exact position to resume from."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

__all__ = ["ResumableDataLoader", "StatefulDistributedSampler", "prepare_dataloader"]


class StatefulDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can skip the first ``start_index`` samples of this rank in the current epoch.

    Every rank shuffles with the same ``seed + epoch`` (so ranks partition one permutation) and takes its strided
    share; ``set_start_index`` is what a resume uses.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return max(self.num_samples - self.start_index, 0)

    def set_start_index(self, start_index: int) -> None:
        if start_index < 0 or start_index > self.num_samples:
            raise ValueError(
                f"StatefulDistributedSampler: start_index {start_index} must be in [0, {self.num_samples}] "
                "(this rank's samples per epoch)"
            )
        self.start_index = start_index


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ``StatefulDistributedSampler`` whose ``state_dict()`` records (epoch, samples consumed).

    The position counts batches *yielded to the caller*, not batches prefetched by workers, so a checkpoint taken
    between steps resumes at the next unseen batch. Call ``set_epoch(e)`` at the start of each epoch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._consumed = 0  # samples of this rank yielded in the current epoch, counted from the epoch start

    @property
    def stateful_sampler(self) -> StatefulDistributedSampler:
        return self.sampler  # type: ignore[return-value]

    def set_epoch(self, epoch: int) -> None:
        # Setting the epoch that a resume restored keeps the restored position.
        if epoch != self.stateful_sampler.epoch:
            self.stateful_sampler.set_start_index(0)
            self._consumed = 0
        self.stateful_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        self._consumed = self.stateful_sampler.start_index
        for batch in super().__iter__():
            self._consumed = min(self._consumed + self.batch_size, self.stateful_sampler.num_samples)
            yield batch
        # A finished epoch starts the next pass from the beginning of the same epoch unless set_epoch is called.
        self.stateful_sampler.set_start_index(0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.stateful_sampler.epoch), "consumed": int(self._consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stateful_sampler.set_epoch(int(state["epoch"]))
        consumed = int(state["consumed"])
        if consumed >= self.stateful_sampler.num_samples:
            consumed = 0
            self.stateful_sampler.set_epoch(int(state["epoch"]) + 1)
        self.stateful_sampler.set_start_index(consumed)
        self._consumed = consumed


def _sampler_cls(cls: type | None) -> type[StatefulDistributedSampler]:
    """The sampler for ``distributed_sampler_cls`` (Colossal-AI's argument): a ``DistributedSampler`` subclass,
    made resumable by putting ``StatefulDistributedSampler`` in front of it (its order, skipped into on resume)."""
    if cls is None or issubclass(cls, StatefulDistributedSampler):
        return cls or StatefulDistributedSampler
    if not (isinstance(cls, type) and issubclass(cls, DistributedSampler)):
        raise TypeError(
            f"prepare_dataloader: distributed_sampler_cls={cls!r} must be a torch DistributedSampler subclass (built "
            "with num_replicas, rank, shuffle, seed and drop_last); it is made resumable by cai"
        )
    return type(f"Stateful{cls.__name__}", (StatefulDistributedSampler, cls), {})


def _seed_worker(worker_id: int, *, base_seed: int) -> None:
    seed = base_seed + worker_id
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class _WorkerInit:
    """Picklable worker_init_fn: seeds each worker from (seed, data-parallel rank, worker id)."""

    def __init__(self, base_seed: int) -> None:
        self.base_seed = base_seed

    def __call__(self, worker_id: int) -> None:
        _seed_worker(worker_id, base_seed=self.base_seed)


def _check_dataset(dataset: Any) -> None:
    # The sampler needs len(dataset) and indexes it; without these checks torch fails inside DistributedSampler
    # with "object of type ... has no len()".
    if dataset is None:
        raise ValueError("prepare_dataloader: dataset is None; pass the map-style dataset to load from")
    if isinstance(dataset, DataLoader):
        raise TypeError(
            "prepare_dataloader: got a DataLoader; pass its dataset (prepare_dataloader(loader.dataset, ...)): the "
            "plugin builds the DataLoader with a sampler that gives each data-parallel rank its share"
        )
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise TypeError(
            f"prepare_dataloader: {type(dataset).__name__} is not a map-style dataset (it needs __len__ and "
            "__getitem__ for the distributed sampler); an iterable dataset must split itself across ranks: build "
            "its DataLoader yourself and pass it to boost(dataloader=...)"
        )


def prepare_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    dp_rank: int,
    dp_size: int,
    shuffle: bool = False,
    seed: int = 1024,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> ResumableDataLoader:
    """Build a ``ResumableDataLoader`` that gives data-parallel rank ``dp_rank`` its share of ``dataset``.

    Ranks share the shuffle seed (they partition one permutation) but get distinct worker and generator seeds
    (``seed + 1000 * dp_rank``) so random augmentations differ per rank. ``distributed_sampler_cls``: a
    ``DistributedSampler`` subclass to order the samples (resumable too). Extra ``kwargs`` go to ``DataLoader``.
    """
    if batch_size < 1:
        raise ValueError(f"prepare_dataloader: batch_size {batch_size} must be >= 1")
    _check_dataset(dataset)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"prepare_dataloader: dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
    for key in ("sampler", "batch_sampler"):
        if kwargs.get(key) is not None:
            raise ValueError(
                f"prepare_dataloader: {key}= is chosen by the plugin; remove it (got {kwargs[key]!r})"
            )
    sampler = _sampler_cls(kwargs.pop("distributed_sampler_cls", None))(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    rank_seed = seed + 1000 * dp_rank
    generator = torch.Generator()
    generator.manual_seed(rank_seed)
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        pin_memory=pin_memory,
        num_workers=num_workers,
        worker_init_fn=_WorkerInit(rank_seed),
        generator=generator,
        **kwargs,
    )
