"""The param-groups helpers and the state-protocol types of cai.mesh."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from cai.mesh import (
    LocalShard,
    ShardedOptimizerState,
    ShardedState,
    ShardSpec,
    flat_pieces,
    load_param_groups_state,
    param_groups_state,
    register_grad_hooks_weakly,
)


def _groups() -> list[dict]:
    return [
        {"params": [object(), object()], "lr": torch.tensor(0.25), "betas": (0.9, 0.95), "fn": print},
        {"params": [object()], "lr": 0.5, "betas": (0.8, 0.9), "weight_decay": 0.0},
    ]


NAMES = [["a.weight", "a.bias"], ["b.weight"]]


def test_param_groups_state_is_json_with_names_and_drops_what_json_cannot_hold() -> None:
    state = param_groups_state(_groups(), NAMES)
    assert json.loads(json.dumps(state)) == state
    assert state[0] == {"lr": 0.25, "betas": [0.9, 0.95], "params": ["a.weight", "a.bias"]}
    assert state[1]["params"] == ["b.weight"] and state[1]["weight_decay"] == 0.0


def test_load_restores_values_in_the_types_the_groups_hold() -> None:
    saved = param_groups_state(_groups(), NAMES)
    saved[0]["lr"], saved[1]["betas"] = 0.125, [0.5, 0.6]
    saved[1]["params"] = list(reversed(saved[1]["params"]))  # order within a group does not matter
    groups = _groups()
    lr = groups[0]["lr"]
    load_param_groups_state(groups, NAMES, saved, owner="Test")
    assert groups[0]["lr"] is lr and float(lr) == 0.125  # a tensor lr is filled in place (schedulers hold it)
    assert groups[1]["betas"] == (0.5, 0.6) and isinstance(groups[1]["betas"], tuple)


def test_load_names_the_mismatch_and_the_fix() -> None:
    saved = param_groups_state(_groups(), NAMES)
    saved[0]["params"] = ["a.weight", "c.bias"]
    with pytest.raises(
        ValueError,
        match=r"Test: param group 0 .* not in the checkpoint \['a.bias'\], not in the optimizer \['c.bias'\]",
    ):
        load_param_groups_state(_groups(), NAMES, saved, owner="Test")
    with pytest.raises(ValueError, match="Test: the checkpoint has 1 param groups but the optimizer has 2"):
        load_param_groups_state(_groups(), NAMES, saved[:1], owner="Test")


def test_protocols_are_structural() -> None:
    class Model:
        def sharded_state_dict(self) -> dict[str, LocalShard]:
            return {}

        def load_sharded_state_dict(self, read) -> None:
            pass

    class Optim(Model):
        def param_groups_state(self) -> list[dict]:
            return []

        def load_param_groups_state(self, groups) -> None:
            pass

    assert isinstance(Model(), ShardedState) and not isinstance(Model(), ShardedOptimizerState)
    assert isinstance(Optim(), ShardedOptimizerState)


class _Entry:
    def __init__(self, offset: int, shape: tuple[int, ...]) -> None:
        self.offset, self.shape = offset, shape
        self.numel = int(torch.Size(shape).numel())


def test_flat_pieces_cut_a_window_into_shard_specs() -> None:
    entries = [_Entry(0, (2, 3)), _Entry(6, (4,)), _Entry(10, (5,))]
    tensors = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 14.0), torch.arange(20.0, 25.0)]
    flat = torch.cat(
        [t.reshape(-1) for t in tensors] + [torch.zeros(2)]
    )  # 15 elements + padding, 3 ranks of 6
    covered = {i: torch.zeros(t.shape) for i, t in enumerate(tensors)}
    for rank in range(3):
        lo, hi = rank * 6, (rank + 1) * 6
        for pc in flat_pieces(entries, lo, hi):
            i = entries.index(pc.entry)
            local = flat[lo:hi][pc.start : pc.stop]
            assert torch.equal(local, pc.spec.cut(tensors[i])), (rank, i)
            pc.spec.place(local, covered[i])
    for i, t in enumerate(tensors):
        assert torch.equal(covered[i], t)  # the windows' pieces cover every tensor exactly
    assert [p.spec for p in flat_pieces(entries, 4, 8)] == [
        ShardSpec(global_shape=(2, 3), flat_range=(4, 6)),
        ShardSpec(global_shape=(4,), flat_range=(0, 2)),
    ]
    assert list(flat_pieces(entries, 15, 18)) == []  # padding only


class _Owner:
    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple]] = []

    def on_grad(self, param: torch.Tensor, *key) -> None:
        self.seen.append((id(param), key))


def test_grad_hooks_call_the_owner_with_the_key_and_do_not_keep_it_alive() -> None:
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    owner = _Owner()
    handles = register_grad_hooks_weakly(owner, _Owner.on_grad, [(p, (0, 1)), (q, ())])
    (p.sum() + q.sum()).backward()
    assert sorted(owner.seen) == sorted([(id(p), (0, 1)), (id(q), ())])
    assert len(handles) == 2
    ref = weakref.ref(owner)
    del owner
    assert ref() is None  # the hooks held it weakly
    p.grad = q.grad = None
    (p.sum() + q.sum()).backward()  # the hooks were removed with their owner: nothing runs, nothing fails
    assert p._post_accumulate_grad_hooks in (None, {}) and q._post_accumulate_grad_hooks in (None, {})
