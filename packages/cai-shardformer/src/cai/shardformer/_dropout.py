"""Dropout under tensor parallelism: a tracker of named RNG states per tp group, and the two dropout layers
that draw their masks from it.

[Note: dropout RNG under tp]
A dropout mask must be the same on every tp rank where the activation is replicated (the hidden states between
the tp regions: different masks would make the replicas diverge), and different where each rank holds a
different part of the activation (attention probabilities of its own heads: equal masks would correlate the
heads). The tracker keeps two RNG states per device, independent of the process's global RNG:

    REPLICATED   seeded with `seed` on every rank of the group: equal masks
    PARALLEL     seeded with `parallel_seed(seed, tp_rank)`: a different stream per rank

`seed` is tp rank 0's `torch.initial_seed()`, broadcast over the group when the tracker is created, so the
ranks agree even when the user seeded them differently. `fork(name)` swaps the device's global RNG state for
the named one around a block and keeps what the block consumed, so any op inside (F.dropout, SDPA's dropout)
draws from the tracker and the global RNG is left untouched. Because each state is a plain seeded stream, a
one-process reference can replay every rank's masks (see the dropout tests).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cai.shardformer._linear import _group

REPLICATED = "tp-replicated"
PARALLEL = "tp-parallel"


def parallel_seed(seed: int, rank: int) -> int:
    """The seed of tp rank `rank`'s PARALLEL state: far from `seed` and from the other ranks' seeds."""
    return (seed + 2718 + 1009 * (rank + 1)) % (2**63)


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RNGStatesTracker:
    """Named RNG states, one stream per (name, device), forked into the device's global RNG around a block.

    Example:
        >>> tracker = RNGStatesTracker()
        >>> tracker.add("mine", seed=7)
        >>> with tracker.fork("mine", x.device):
        ...     y = F.dropout(x, 0.1)   # draws from "mine"; the global RNG is unchanged
    """

    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}
        self._states: dict[tuple[str, torch.device], torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Start the stream `name` from `seed` (on every device, lazily); re-adding a name restarts it."""
        self.seeds[name] = int(seed)
        self._states = {k: v for k, v in self._states.items() if k[0] != name}

    def state_dict(self) -> dict:
        """The seeds and every stream's current state (for an exact resume; see cai-ckpt's ``save_state``)."""
        return {
            "seeds": dict(self.seeds),
            "states": {f"{name}@{device}": state.clone() for (name, device), state in self._states.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.seeds = {k: int(v) for k, v in state["seeds"].items()}
        self._states = {}
        for key, value in state["states"].items():
            name, _, device = key.rpartition("@")
            self._states[(name, torch.device(device))] = value.to("cpu", torch.uint8)

    @contextlib.contextmanager
    def fork(self, name: str, device: torch.device | str = "cpu") -> Iterator[None]:
        if name not in self.seeds:
            raise KeyError(f"RNG state {name!r} was never added; known: {sorted(self.seeds)}")
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        key = (name, device)
        if key not in self._states:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seeds[name])
            self._states[key] = gen.get_state()
        outer = _get_state(device)
        _set_state(device, self._states[key])
        try:
            yield
        finally:
            self._states[key] = _get_state(device)
            _set_state(device, outer)


# One tracker per tp group, created on first use (the seed broadcast is collective) and dropped with the group.
_TRACKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_rng_tracker(process_group: dist.ProcessGroup | None = None) -> RNGStatesTracker:
    """The tracker of a tp group, with its REPLICATED and PARALLEL states (see [Note: dropout RNG under tp]).
    The first call on a group is collective: every rank of the group must make it."""
    group = _group(process_group)
    tracker = _TRACKERS.get(group)
    if tracker is None:
        seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
        if dist.get_world_size(group) > 1:
            dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
        tracker = RNGStatesTracker()
        set_tracker_seed(tracker, int(seed.item()), dist.get_rank(group))
        _TRACKERS[group] = tracker
    return tracker


def set_tracker_seed(tracker: RNGStatesTracker, seed: int, tp_rank: int) -> None:
    """(Re)start a tp tracker's two streams from `seed`, as seen by tp rank `tp_rank`."""
    tracker.add(REPLICATED, seed)
    tracker.add(PARALLEL, parallel_seed(seed, tp_rank))


class _TrackedDropout(nn.Module):
    state: str

    def __init__(self, p: float = 0.5, inplace: bool = False, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} is outside [0, 1]")
        self.p, self.inplace = p, inplace
        self.process_group = _group(process_group)
        self.tracker = get_rng_tracker(self.process_group)

    @classmethod
    def from_native_module(cls, module: nn.Dropout, process_group: dist.ProcessGroup | None = None, **kw):
        """The tracked dropout with `module`'s `p` and `inplace`."""
        return cls(p=module.p, inplace=module.inplace, process_group=process_group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.state, x.device):
            return F.dropout(x, self.p, training=True, inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, state={self.state}"


class DropoutForParallelInput(_TrackedDropout):
    """Dropout on an activation split over the tp ranks (attention heads, column-parallel outputs): each rank
    draws from its own PARALLEL stream, so the masks differ across ranks."""

    state = PARALLEL


class DropoutForReplicatedInput(_TrackedDropout):
    """Dropout on an activation replicated on the tp ranks (hidden states, embeddings): every rank draws the
    same mask from the REPLICATED stream, whatever each rank's global RNG holds."""

    state = REPLICATED


def fork_rng_in_forward(path: str, state: str = PARALLEL, *, group=None):
    """A `param_replacement` entry for dropout that is not a module (Hugging Face attention passes
    `attention_dropout` as a float to SDPA or the eager kernel): the submodule at `path` runs its training
    forward inside `fork(state)` of the group's tracker, so the dropout inside draws from that stream."""

    def apply(module: nn.Module) -> None:
        sub = module.get_submodule(path)
        sub._cai_rng_fork = (get_rng_tracker(group), state)
        # A bound method, not a closure: `copy.deepcopy` rebinds it to the copy.
        sub.forward = types.MethodType(_forked_forward, sub)

    # It changes which stream dropout draws from, never a value: `tp_plan` may leave it out.
    apply.rng_only = True
    return apply


def _forked_forward(self: nn.Module, *args, **kwargs):
    inner = type(self).forward
    if not self.training:
        return inner(self, *args, **kwargs)
    tracker, state = self._cai_rng_fork
    with tracker.fork(state, next(self.parameters()).device):
        return inner(self, *args, **kwargs)
