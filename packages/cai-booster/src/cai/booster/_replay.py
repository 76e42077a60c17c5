"""Recording and replaying the construction of a model's lazy parameters (``LazyInitContext``'s engine).

[Note: replaying construction]
While the context is open a dispatch mode records, in program order, every op that writes a lazy tensor or makes
a new one from lazy tensors (``nn.init`` calls, ``fill_``, ``copy_``, ``clone``, ...). A parameter registered with
values (``nn.Parameter(torch.ones(n))``) records a copy of them; one made by ``torch.empty`` records nothing. A lazy
tensor is named by its meta storage (a slot) and its view's sizes, strides and offset, so ops on ``p.data``,
``p.t()`` or ``p[0]`` land on the same parameter. Materialising replays the records on the device the parameters
were built on, so the values are bitwise those of eager construction there, and a parameter that goes to another
device is copied there after its last write. Only records that lead to a requested slot run (a pipeline stage
replays its own parameters); a random op that does not is drawn into scratch memory when a later needed draw
depends on the generator state it leaves.

Random ops on lazy tensors draw nothing while recording. The recorder keeps the generator state each run of
deferred draws starts from (a ``_Seed`` record, replayed by setting the state) and meanwhile parks the generator on
a fresh marker seed: a state that is not a marker means the generator holds eager's state (nothing deferred, or
someone seeded it), a marker says which run it continues and after how many draws (``fork_rng`` restores one).
Before a real random op (``torch.randn`` for a buffer or a parameter) the pending draws are made into scratch, so
the real op sees eager's state. Leaving the context puts a parked generator back where its deferred draws began.

A replayed parameter starts as NaN unless the first record that runs on it sets all of it (most do: an ``nn.init``
call, a copy of its values), which saves a pass over the model; one that nothing wrote, entirely, makes
materialising raise, naming it, instead of handing out uninitialised memory. Parameters that cannot be replayed
(built outside the context, or replaced by a sharding plugin: tensor-parallel layers, FSDP2's DTensors) fall back
to their modules' own initialisers (``reset_parameters``, or a Hugging Face model's ``initialize_weights``): eager's
distributions, not its numbers.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LOGS", "OF_META", "OPEN", "Log", "Pending", "View", "as_view", "covers", "poison"]

_aten = torch.ops.aten
# ops whose result does not depend on what the tensor they write held
_OVERWRITE = frozenset(
    f"aten::{name}"
    for name in (
        "fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_",
        "log_normal_", "cauchy_",
    )
)  # fmt: skip
# factories whose result holds no values: a parameter made from one records none
_EMPTY = frozenset(
    {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default}
    | {_aten.new_empty_strided.default, _aten.empty_like.default}
)
OPEN: list[Log] = []  # logs of the contexts open now
LOGS: weakref.WeakSet[Log] = weakref.WeakSet()  # every log some lazy tensor still refers to
OF_META: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta parameter -> the log of its construction


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(math.nan) if t.is_floating_point() or t.is_complex() else t.zero_()


# ---- recording ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Slot:
    numel: int
    dtype: torch.dtype
    device: torch.device  # where its ops run at replay: where eager construction would have run them


@dataclass(frozen=True)
class View:
    slot: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(eq=False)
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    writes: tuple[int, ...]
    reads: tuple[int, ...]  # slots whose values it uses (a written one too, unless in ``full``)
    full: tuple[int, ...]  # written slots whose every element it sets without reading them
    creates: tuple[tuple[int, int], ...]  # (output leaf, new slot)
    gen: torch.Generator | None = None  # the generator it draws from, if it is random


@dataclass(eq=False)
class _Seed:
    gen: torch.Generator
    state: torch.Tensor
    then: tuple[_Op, ...] = ()  # draws to repeat after setting ``state`` (a parked state was restored)


@dataclass(eq=False)
class _Run:  # deferred draws on one generator since it held eager's state ``start``
    start: torch.Tensor
    draws: list[_Op]


@dataclass(eq=False)
class Pending:
    log: Log
    slot: int
    offset: int  # the parameter's offset in its slot

    def base(self, p: nn.Parameter) -> torch.Tensor | None:
        """The whole slot over ``p``'s memory, or None when ``p`` no longer is the tensor it was allocated as."""
        info = self.log.slots[self.slot]
        start = p.storage_offset() - self.offset
        fits = start >= 0 and (start + info.numel) * p.element_size() <= p.untyped_storage().nbytes()
        if type(p.data) is not torch.Tensor or p.dtype != info.dtype or not fits:
            return None
        return p.detach().as_strided((info.numel,), (1,), start)


class Log:
    """The recorded construction of the lazy tensors of one ``LazyInitContext``."""

    def __init__(self, default_device: torch.device) -> None:
        self.default_device = default_device
        built = torch.get_default_device()
        self.build_device = built if built.type != "meta" else torch.device("cpu")
        self.slots: list[_Slot] = []
        self.index: dict[int, int] = {}  # meta storage -> slot
        self.keep: list[torch.UntypedStorage] = []  # the meta storages, so that no other takes their address
        self.records: list[_Op | _Seed] = []
        self.paused = 0
        self.recorder = _Recorder(self)
        # while recording only
        self.empty: dict[int, StorageWeakRef] = {}  # real storages from _EMPTY factories, not written since
        self.gens: dict[int, torch.Generator] = {}
        self.runs: dict[int, _Run] = {}
        self.markers: dict[tuple[int, int], tuple[_Run, int]] = {}  # (generator, marker seed) -> (run, draws)
        self.seeds = itertools.count(secrets.randbits(62))
        LOGS.add(self)

    def open(self) -> None:
        OPEN.append(self)
        self.recorder.__enter__()

    def close(self) -> None:
        self.recorder.__exit__(None, None, None)
        OPEN.remove(self)
        for key, gen in self.gens.items():
            hit = self.markers.get((key, gen.initial_seed()))
            if hit is not None:
                gen.set_state(hit[0].start)
        self.empty, self.gens, self.runs, self.markers = {}, {}, {}, {}

    # -- recording
    def adopt(self, param: nn.Parameter) -> nn.Parameter:
        """The meta parameter a module keeps in place of ``param``."""
        self.paused += 1
        try:
            if param.device.type != "meta":
                meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                for key, value in vars(param).items():
                    setattr(meta, key, value)
                slot = self._slot(meta, param.device)
                ref = self.empty.get(param.untyped_storage()._cdata)
                if ref is None or ref.expired():  # it holds values: replay copies them
                    self.records.append(
                        _Op(
                            _aten.copy_.default,
                            (self._view(meta), param.detach()),
                            {},
                            (slot,),
                            (),
                            (slot,),
                            (),
                        )
                    )
                param = meta
            elif self.slot_of(param) is None:
                self._slot(param, self.build_device)  # made outside the context: no values recorded
            OF_META.setdefault(param, self)
            return param
        finally:
            self.paused -= 1

    def slot_of(self, t: torch.Tensor) -> int | None:
        return self.index.get(t.untyped_storage()._cdata)

    def _slot(self, t: torch.Tensor, device: torch.device) -> int:
        storage = t.untyped_storage()
        self.keep.append(storage)
        self.index[storage._cdata] = len(self.slots)
        self.slots.append(_Slot(storage.nbytes() // t.element_size(), t.dtype, torch.device(device)))
        return len(self.slots) - 1

    def _view(self, t: torch.Tensor) -> View:
        slot = self.slot_of(t)
        if slot is None:
            slot = self._slot(t, self.build_device)
        return View(slot, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run an op on meta tensors and record it if it writes a lazy tensor or makes a new one."""
        out = func(*args, **kwargs)
        flags, named = _written(func)
        writes: list[View] = []
        reads: list[View] = []

        def convert(value: Any, written: bool) -> Any:
            def one(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                if not x.is_meta:
                    return x.clone()  # its value now, as eager construction reads it now
                view = self._view(x)
                (writes if written else reads).append(view)
                return view

            return tree_map(one, value)

        args = tuple(convert(a, i < len(flags) and flags[i]) for i, a in enumerate(args))
        kwargs = {k: convert(v, k in named) for k, v in kwargs.items()}
        if _is_meta(kwargs.get("device")):
            kwargs["device"] = self.build_device
        touched = writes + reads
        device = self.slots[touched[0].slot].device if touched else self.build_device
        creates = tuple(
            (i, self._slot(t, device))
            for i, t in enumerate(tree_leaves(out))
            if isinstance(t, torch.Tensor) and t.is_meta and self.slot_of(t) is None
        )
        if not writes and not creates:
            return out
        read = {v.slot for v in reads}
        overwrite = func._schema.name in _OVERWRITE
        full = tuple(
            dict.fromkeys(
                v.slot for v in writes if overwrite and v.slot not in read and covers(v, self.slots[v.slot])
            )
        )
        written = tuple(dict.fromkeys(v.slot for v in writes))
        op = _Op(func, args, kwargs, written, tuple(read | set(written) - set(full)), full, creates)
        if torch.Tag.nondeterministic_seeded in func.tags:
            op.gen = kwargs.get("generator") or _default_generator(device)
            self._draw(op)
        else:
            self.records.append(op)
        return out

    def init_call(self, init: Any, random: bool, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``init(tensor, ...)`` (an ``nn.init`` function), recorded as one op when ``tensor`` is lazy."""
        if self.paused or self not in OPEN or not tensor.is_meta:
            return init(tensor, *args, **kwargs)
        view = self._view(tensor)
        info = self.slots[view.slot]
        full = (view.slot,) if covers(view, info) else ()
        op = _Op(init, (view, *args), kwargs, (view.slot,), () if full else (view.slot,), full, ())
        if random:
            op.gen = kwargs.get("generator") or _default_generator(info.device)
            self._draw(op)
        else:
            self.records.append(op)
        return tensor

    def real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run an op on real tensors, keeping what recording needs to know about it."""
        if self.gens and torch.Tag.nondeterministic_seeded in func.tags:
            self._catch_up(kwargs.get("generator") or _default_generator(_device_of(args, kwargs)))
        if self.empty:
            flags, named = _written(func)
            written = [a for i, a in enumerate(args) if i < len(flags) and flags[i]]
            for t in tree_leaves((written, [kwargs[k] for k in named if k in kwargs])):
                if isinstance(t, torch.Tensor):
                    self.empty.pop(t.untyped_storage()._cdata, None)
        out = func(*args, **kwargs)
        if func in _EMPTY:
            storage = out.untyped_storage()
            self.empty[storage._cdata] = StorageWeakRef(storage)
            if len(self.empty) % 4096 == 0:
                self.empty = {k: r for k, r in self.empty.items() if not r.expired()}
        return out

    def _draw(self, op: _Op) -> None:
        """Record a deferred draw (see [Note: replaying construction] for the parking)."""
        gen, key = op.gen, id(op.gen)
        self.gens[key] = gen
        hit = self.markers.get((key, gen.initial_seed()))
        run = self.runs.get(key)
        if hit is None:  # the generator holds eager's state: a run of deferred draws starts from it
            run = _Run(gen.get_state(), [])
            self.records.append(_Seed(gen, run.start))
        elif hit[0] is not run or hit[1] != len(run.draws):  # a state parked earlier was restored
            run = _Run(hit[0].start, hit[0].draws[: hit[1]])
            self.records.append(_Seed(gen, run.start, tuple(run.draws)))
        self.records.append(op)
        run.draws.append(op)
        self.runs[key] = run
        gen.manual_seed(next(self.seeds))
        self.markers[(key, gen.initial_seed())] = (run, len(run.draws))

    def _catch_up(self, gen: torch.Generator) -> None:
        """Before a real draw: make the deferred draws the generator is parked after, into scratch."""
        hit = self.markers.get((id(gen), gen.initial_seed()))
        if hit is not None:
            gen.set_state(hit[0].start)
            for op in hit[0].draws[: hit[1]]:
                _scratch(op, self.slots)
        self.runs.pop(id(gen), None)

    # -- replaying
    def replay(self, targets: dict[int, torch.Tensor]) -> set[int]:
        """Give each slot in ``targets`` (a flat tensor over it, on any device) its value at the end of
        construction, running only the records it depends on. Returns the slots that may hold elements nothing
        wrote: those are poisoned first (NaN), for the caller to check; a slot whose first use sets all of it is
        not (an extra pass over every parameter otherwise)."""
        plan, last = self._plan(set(targets))
        unsure = set(targets) - self._first_set_whole(plan, set(targets))
        for s in unsure:
            poison(targets[s])
        env = {s: t for s, t in targets.items() if t.device == self.slots[s].device}
        saved = {id(r.gen): (r.gen, r.gen.get_state()) for r, how in zip(self.records, plan) if how == "seed"}

        def get(x: Any) -> Any:
            if not isinstance(x, View):
                return x
            base = env.get(x.slot)
            if base is None:  # staged on the device it was built on, or needed only as an input
                info = self.slots[x.slot]
                base = env[x.slot] = poison(torch.empty(info.numel, dtype=info.dtype, device=info.device))
            return as_view(base, x.size, x.stride, x.offset, x.dtype)

        try:
            for i, (r, how) in enumerate(zip(self.records, plan)):
                if how is None:
                    continue
                if isinstance(r, _Seed):
                    r.gen.set_state(r.state)
                    for op in r.then:
                        _scratch(op, self.slots)
                    continue
                if how == "scratch":
                    _scratch(r, self.slots)
                    continue
                leaves = tree_leaves(r.func(*tree_map(get, r.args), **tree_map(get, r.kwargs)))
                for j, s in r.creates:
                    env[s] = leaves[j].as_strided((self.slots[s].numel,), (1,), 0)
                for s in (*r.writes, *r.reads, *(s for _, s in r.creates)):
                    if last.get(s) == i:
                        t = env.pop(s, None)
                        if s in targets and t is not None and t is not targets[s]:
                            targets[s].copy_(t)
        finally:
            for gen, state in saved.values():
                gen.set_state(state)
        return unsure

    def _first_set_whole(self, plan: list[str | None], slots: set[int]) -> set[int]:
        """The ``slots`` whose first use among the records that run writes every element without reading any."""
        seen: set[int] = set()
        whole: set[int] = set()
        for r, how in zip(self.records, plan):
            if how != "run":
                continue
            for s in (*r.writes, *r.reads):
                if s in slots and s not in seen:
                    seen.add(s)
                    if s in r.full and s not in r.reads:
                        whole.add(s)
        return whole

    def _plan(self, wanted: set[int]) -> tuple[list[str | None], dict[int, int]]:
        """Backwards over the records: which run ("run"), which only draw ("scratch"), which seeds matter
        ("seed"); and the last record using each slot."""
        live = set(wanted)  # slots whose current values later records need
        drawing: set[int] = set()  # generators whose current state later draws need
        plan: list[str | None] = [None] * len(self.records)
        last: dict[int, int] = {}
        for i in range(len(self.records) - 1, -1, -1):
            r = self.records[i]
            if isinstance(r, _Seed):
                if id(r.gen) in drawing:
                    plan[i] = "seed"
                    drawing.discard(id(r.gen))
                continue
            made = [s for _, s in r.creates]
            if live.intersection(r.writes) or live.intersection(made):
                plan[i] = "run"
                live.difference_update((*r.full, *made))
                live.update(r.reads)
                for s in (*r.writes, *r.reads, *made):
                    last.setdefault(s, i)
            elif r.gen is not None and id(r.gen) in drawing:
                plan[i] = "scratch"
            else:
                continue
            if r.gen is not None:
                drawing.add(id(r.gen))
        return plan, last

    def __deepcopy__(self, memo: dict) -> Log:  # shared by copies of a lazy model
        return self


class _Recorder(TorchDispatchMode):
    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.log.paused:
            return func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        if _is_meta(kwargs.get("device")) or any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
            return self.log.record(func, args, kwargs)
        return self.log.real(func, args, kwargs)


def _scratch(op: _Op, slots: list[_Slot]) -> None:
    """Run a random op into throwaway tensors, for the generator state it leaves."""

    def make(x: Any) -> Any:
        if not isinstance(x, View):
            return x
        size = 1 + sum((n - 1) * s for n, s in zip(x.size, x.stride)) if all(x.size) else 0
        flat = torch.empty(size, dtype=x.dtype, device=slots[x.slot].device)  # a draw's count is its size
        return flat.as_strided(x.size, x.stride)

    op.func(*tree_map(make, op.args), **tree_map(make, op.kwargs))


def as_view(base: torch.Tensor, size: Any, stride: Any, offset: int, dtype: torch.dtype) -> torch.Tensor:
    return (base if base.dtype == dtype else base.view(dtype)).as_strided(size, stride, offset)


def covers(view: View, slot: _Slot) -> bool:
    """Whether ``view`` is every element of its slot, each once."""
    if view.offset != 0 or view.dtype != slot.dtype or math.prod(view.size) != slot.numel:
        return False
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(view.size, view.stride) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.cache
def _written(func: Any) -> tuple[tuple[bool, ...], frozenset[str]]:
    """Which positional arguments, and which keyword arguments by name, ``func`` writes (``Tensor(a!)``)."""
    flags = tuple(bool(a.alias_info and a.alias_info.is_write) for a in func._schema.arguments)
    return flags, frozenset(a.name for a, w in zip(func._schema.arguments, flags) if w)


def _is_meta(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device(kwargs.get("device") or "cpu")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type)
    index = device.index if device.index is not None else backend.current_device()
    return backend.default_generators[index]
