"""prepare_dataloader: ranks partition the data, seeds differ per rank, the position resumes exactly, also with a
user's DistributedSampler subclass (distributed_sampler_cls)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from cai.booster import prepare_dataloader


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.randint(0, 10**6, ()).item()])  # index, and a draw from the worker RNG


def _indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b[:, 0]]


def test_ranks_partition_one_permutation() -> None:
    data = Numbers(40)
    seen = []
    for rank in range(4):
        loader = prepare_dataloader(data, 3, dp_rank=rank, dp_size=4, shuffle=True, seed=7)
        seen.append(_indices(loader))
    assert sorted(i for s in seen for i in s) == list(range(40))
    assert seen[0] != sorted(seen[0])  # shuffled


def test_worker_seeds_differ_per_rank() -> None:
    data = Numbers(8)
    draws = []
    for rank in range(2):
        loader = prepare_dataloader(data, 4, dp_rank=rank, dp_size=2, num_workers=1, seed=3)
        draws.append([int(x) for b in loader for x in b[:, 1]])
    assert draws[0] != draws[1]


@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_resume_mid_epoch(stop_after: int) -> None:
    data = Numbers(30)
    make = lambda: prepare_dataloader(data, 2, dp_rank=1, dp_size=3, shuffle=True, seed=5)  # noqa: E731
    full = make()
    full.set_epoch(2)
    expected = _indices(full)
    first = make()
    first.set_epoch(2)
    it = iter(first)
    got = _indices([next(it) for _ in range(stop_after)])
    state = first.state_dict()
    assert state == {"epoch": 2, "consumed": 2 * stop_after}
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # setting the restored epoch keeps the restored position
    assert got + _indices(resumed) == expected
    resumed.set_epoch(3)  # a new epoch starts from its beginning
    assert len(_indices(resumed)) == 10


class Backwards(DistributedSampler):
    """This rank's share, last sample first."""

    def __iter__(self):
        return iter(list(super().__iter__())[::-1])


def test_distributed_sampler_cls_orders_and_resumes() -> None:
    data = Numbers(30)
    make = lambda: prepare_dataloader(  # noqa: E731
        data, 2, dp_rank=1, dp_size=3, shuffle=True, seed=5, distributed_sampler_cls=Backwards
    )
    plain = prepare_dataloader(data, 2, dp_rank=1, dp_size=3, shuffle=True, seed=5)
    expected = _indices(make())
    assert expected == _indices(plain)[::-1]
    first = make()
    it = iter(first)
    got = _indices([next(it) for _ in range(2)])
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert got + _indices(resumed) == expected
    with pytest.raises(TypeError, match="must be a torch DistributedSampler subclass"):
        prepare_dataloader(data, 2, dp_rank=0, dp_size=1, distributed_sampler_cls=list)


def test_end_of_epoch_state_moves_to_next_epoch() -> None:
    data = Numbers(6)
    loader = prepare_dataloader(data, 2, dp_rank=0, dp_size=1, shuffle=True)
    list(loader)
    resumed = prepare_dataloader(data, 2, dp_rank=0, dp_size=1, shuffle=True)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.state_dict() == {"epoch": 1, "consumed": 0}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"dp_rank 2 must be in \[0, dp_size=2\)"):
        prepare_dataloader(Numbers(4), 1, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="sampler= is chosen by the plugin"):
        prepare_dataloader(Numbers(4), 1, dp_rank=0, dp_size=1, sampler=[0, 1])
