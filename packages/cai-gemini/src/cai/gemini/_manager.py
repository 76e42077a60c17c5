"""ChunkManager: packs parameters into chunks, places them, and gathers, releases, prefetches and evicts them.

[Note: release and prefetch]
A chunk is gathered when a module that owns one of its parameters starts (forward, or backward through a hook on
the module's outputs). It is not released when that module ends, because the next module usually lives in the same
chunk: it is released when a later access asks for other chunks and none of its tensors is in COMPUTE (forward), or
when its gradients have been reduced (backward). The first step records the order in which chunks are accessed, per
phase; later steps all-gather up to ``max_prefetch`` chunks ahead of that order (on a side stream on CUDA). A
prefetched chunk is not released before its use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from cai.gemini._chunk import Chunk, TensorInfo, TensorState
from cai.gemini._config import GeminiConfig
from cai.gemini._memory import DEVICE, HOST, MemoryTracker
from cai.gemini._search import ChunkSearchResult, default_interval, pack, search_chunk_size

__all__ = ["ChunkManager"]

FWD, BWD = "fwd", "bwd"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _select_first(sizes: list[int], frac: float) -> list[bool]:
    """Mark the leading chunks that make up ``frac`` of the total (a chunk counts if its midpoint is inside)."""
    total, seen, out = sum(sizes), 0, []
    for s in sizes:
        out.append(seen + s / 2 < frac * total)
        seen += s
    return out


class ChunkManager:
    """Owns the chunks of one model (see [Note: chunk layout] and [Note: release and prefetch])."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        config: GeminiConfig,
        device: torch.device,
        group: dist.ProcessGroup | None,
        tracker: MemoryTracker,
    ) -> None:
        self.config = config
        self.device = device
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.tracker = tracker
        self.pin = config.pin_memory if config.pin_memory is not None else torch.cuda.is_available()
        self.search: ChunkSearchResult
        self.chunks: list[Chunk] = []
        self.info: dict[int, tuple[Chunk, TensorInfo]] = {}
        self._build(named_params)
        # kept-gathered chunks never release: the per-access scan only looks at the others
        self._releasable = [c for c in self.chunks if not c.keep_gathered]
        self.order: dict[str, list[int]] = {FWD: [], BWD: []}
        self.recording = True
        self.cursor: dict[str, int] = {FWD: 0, BWD: 0}
        self._stream = (
            torch.cuda.Stream(device) if device.type == "cuda" and config.max_prefetch > 0 else None
        )
        self._events: dict[int, torch.cuda.Event] = {}
        self.gathers = 0
        self.holding = False  # inside GeminiModel.gathered(): every chunk stays gathered

    # ---- building -------------------------------------------------------------------------------------------
    def _build(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        cfg = self.config.chunk
        numels = [p.numel() for _, p in named_params]
        if cfg.chunk_size is not None:
            size = _round_up(cfg.chunk_size, self.world_size)
            self.search = ChunkSearchResult(chunk_size=size, waste=0, total=sum(numels), num_chunks=0)
        else:
            self.search = search_chunk_size(
                numels,
                search_range_m=cfg.search_range_m,
                search_interval=default_interval(cfg.hidden_dim, cfg.search_interval),
                min_chunk_size_m=cfg.min_chunk_size_m,
                filter_exlarge_params=cfg.filter_exlarge_params,
                world_size=self.world_size,
            )
        size = self.search.chunk_size
        min_chunk = int(cfg.min_chunk_size_m * 1024**2)
        # trainable and frozen parameters go to different chunks: frozen chunks have no master weights, no
        # gradients and no optimizer state
        plans: list[tuple[bool, list[tuple[str, torch.nn.Parameter]], int, bool]] = []
        for trainable in (True, False):
            members = [(n, p) for n, p in named_params if p.requires_grad == trainable]
            if not members:
                continue
            group_total = sum(p.numel() for _, p in members)
            if cfg.chunk_size is None and group_total < min_chunk:
                plans.append((trainable, members, _round_up(group_total, self.world_size), True))
                continue
            for idx in pack([p.numel() for _, p in members], size):
                part = [members[i] for i in idx]
                used = sum(p.numel() for _, p in part)
                plans.append((trainable, part, _round_up(max(size, used), self.world_size), False))
        position = {id(p): i for i, (_, p) in enumerate(named_params)}
        plans.sort(
            key=lambda pl: position[id(pl[1][0][1])]
        )  # registration order of each chunk's first tensor
        cfgp = self.config
        sizes = [pl[2] for pl in plans]
        if cfgp.placement_policy == "auto":
            keep = [pl[3] for pl in plans]
            param_host = [not k for k in keep]
            optim_host = [True] * len(plans)  # start on the host; warm-up decides what moves
        else:
            sharded = _select_first(sizes, cfgp.shard_param_frac)
            keep = [pl[3] or not s for pl, s in zip(plans, sharded)]
            param_host = [p and not k for p, k in zip(_select_first(sizes, cfgp.offload_param_frac), keep)]
            # the chunks backward reduces first (the last ones) update on the host while backward goes on
            optim_host = _select_first(sizes[::-1], cfgp.offload_optim_frac)[::-1]
            if self.world_size == 1:  # one rank: sharding buys nothing unless the shard lives on the host
                keep = [k or not h for k, h in zip(keep, param_host)]
        for i, (trainable, members, csize, _) in enumerate(plans):
            chunk = Chunk(
                index=i,
                chunk_size=csize,
                dtype=cfgp.working_dtype,
                device=self.device,
                group=self.group,
                rank=self.rank,
                world_size=self.world_size,
                trainable=trainable,
                tracker=self.tracker,
                pin_memory=self.pin,
                fp8_communication=cfgp.fp8_communication,
            )
            for name, p in members:
                chunk.append(name, p)
            chunk.close(
                keep_gathered=keep[i], shard_on_host=param_host[i], optim_on_host=optim_host[i], master=True
            )
            for t in chunk.tensors:
                self.info[id(t.param)] = (chunk, t)
            self.chunks.append(chunk)

    # ---- lookups --------------------------------------------------------------------------------------------
    def chunks_of(self, params: Iterable[torch.nn.Parameter]) -> list[Chunk]:
        out: dict[int, Chunk] = {}
        for p in params:
            hit = self.info.get(id(p))
            if hit is not None:
                out[hit[0].index] = hit[0]
        return [out[k] for k in sorted(out)]

    def waste(self) -> int:
        return sum(c.chunk_size - c.used for c in self.chunks)

    # ---- access ---------------------------------------------------------------------------------------------
    def access(self, chunks: list[Chunk], phase: str, placer: AutoPlacer | None) -> None:
        """Make ``chunks`` usable now (gathered and waited for), release idle ones, prefetch the next ones."""
        wanted = {c.index for c in chunks}
        for c in self._releasable if not self.holding else ():
            if c.gathered and c.index not in wanted and self._idle(c, phase):
                c.release()
        if self.recording:
            seq = self.order[phase]
            for c in chunks:
                if not seq or seq[-1] != c.index:
                    seq.append(c.index)
        if placer is not None:
            placer.before_access(chunks, phase)
        for c in chunks:
            if c.pending is not None or c.index in self._events:
                self._wait(c)
            elif not c.gathered:
                c.gather()
                self.gathers += 1
            c.prefetched = False
        if not self.recording and self.config.max_prefetch > 0:
            self._prefetch(chunks, phase, placer)

    def _idle(self, c: Chunk, phase: str) -> bool:
        if c.in_compute or c.prefetched or c.pending is not None:
            return False
        # in backward a trainable chunk is released once its gradients are reduced (see GeminiModel._grad_hook),
        # not when another chunk is asked for: under activation checkpointing the recomputed forward of a layer
        # touches all of its chunks before their backward starts
        return not (phase == BWD and c.trainable)

    def _wait(self, c: Chunk) -> None:
        event = self._events.pop(c.index, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        c.wait()

    def _prefetch(self, chunks: list[Chunk], phase: str, placer: AutoPlacer | None) -> None:
        seq = self.order[phase]
        last = max(c.index for c in chunks)
        pos = self.cursor[phase]
        while pos < len(seq) and seq[pos] != last:
            pos += 1
        if pos == len(seq):
            return
        self.cursor[phase] = pos
        issued = 0
        for idx in seq[pos + 1 :]:
            if issued >= self.config.max_prefetch:
                break
            c = self.chunks[idx]
            if c.gathered or c.pending is not None:
                # a chunk prefetched earlier and not yet used counts against the window: the recorded order visits
                # chunks more than once, and skipping it would issue one more gather at every access, until the
                # whole model was gathered
                issued += c.prefetched
                continue
            if placer is not None and not placer.room_for_gather(c):
                break
            self._gather_async(c)
            c.prefetched = True
            issued += 1

    def _gather_async(self, c: Chunk) -> None:
        self.gathers += 1
        if self._stream is None:
            c.gather(async_op=True)
            return
        main = torch.cuda.current_stream(self.device)
        assert c.full is not None
        # allocate on the main stream (it owns the memory); copy and gather on the side stream
        c.alloc()
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            c.gather(async_op=False)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[c.index] = event

    # ---- phase bookkeeping ------------------------------------------------------------------------------------
    def begin_phase(self, phase: str) -> None:
        self.cursor[phase] = 0

    def end_step(self) -> None:
        self.recording = False

    def gather_all(self) -> None:
        """Gather every chunk now (one all-gather each; those gathered or in flight are waited for)."""
        for c in self.chunks:
            if c.pending is not None or c.index in self._events:
                self._wait(c)
            elif not c.gathered:
                c.gather()
                self.gathers += 1

    def release_all(self) -> None:
        for c in self.chunks:
            if c.index in self._events or c.pending is not None:
                self._wait(c)
            c.release()
            if c.gathered:  # kept gathered
                for t in c.tensors:
                    if t.state is not TensorState.COMPUTE:
                        t.state = TensorState.HOLD


class AutoPlacer:
    """The auto policy: parameter shards move to the device while they fit and are evicted in order of their
    next use (furthest first); after the warm-up step, optimizer states of leading chunks move to the device
    when everything else still fits."""

    def __init__(self, manager: ChunkManager, config: GeminiConfig, tracker: MemoryTracker) -> None:
        self.m = manager
        self.config = config
        self.tracker = tracker
        self.warm = False
        self.transient_peak = 0
        self.evictions = 0

    def _budget(self) -> int | None:
        cap = self.tracker.device_capacity()
        if cap is None:
            return None
        if not self.warm:
            return int(cap * (1.0 - self.config.warmup_non_model_data_ratio))
        return int(cap * self.config.steady_cuda_cap_ratio) - self.tracker.non_model_bytes()

    def _transient(self) -> int:
        b = self.tracker.bytes[DEVICE]
        return b["gathered"] + b["grad_buffer"] + b["unreduced"]

    def _free(self) -> int:
        budget = self._budget()
        if budget is None:
            return 1 << 62
        return budget - self.tracker.model_bytes(DEVICE)

    def room_for_gather(self, c: Chunk) -> bool:
        # keep one chunk's worth for the gradient buffer of backward
        return self._free() >= 2 * c.chunk_size * c.full.element_size()  # type: ignore[union-attr]

    def _next_use(self, c: Chunk, phase: str) -> int:
        seq = self.m.order[FWD] + self.m.order[BWD]
        start = self.m.cursor[phase] + (len(self.m.order[FWD]) if phase == BWD else 0)
        for d, idx in enumerate(seq[start:]):
            if idx == c.index:
                return d
        return len(seq) + 1  # not used again this step: the best victim

    def before_access(self, chunks: list[Chunk], phase: str) -> None:
        self.transient_peak = max(self.transient_peak, self._transient())
        wanted = {c.index for c in chunks}
        for c in chunks:
            on_host = c.shard_location != DEVICE
            if c.keep_gathered or (c.gathered and not on_host):
                continue
            # A chunk whose shard already lives on the device still needs room for its gathered buffer and a grad
            # buffer: chunks differ in size (a parameter larger than the chunk size gets a chunk of its own), so
            # the room left when a smaller chunk's shard moved up may not be enough for a larger one.
            need = c.shard_size * c.full.element_size() if on_host else 0  # type: ignore[union-attr]
            full = c.chunk_size * c.full.element_size()  # type: ignore[union-attr]
            reserve = (
                need + (0 if c.gathered else full) + full
            )  # the shard, its gathered buffer, a grad buffer
            if self._free() < reserve:
                victims = [v for v in self.m.chunks if v.shard_location == DEVICE and not v.keep_gathered]
                victims = [v for v in victims if v.index not in wanted]
                victims.sort(key=lambda v: self._next_use(v, phase), reverse=True)
                for v in victims:
                    if self._free() >= reserve:
                        break
                    v.move_shard(HOST)
                    self.evictions += 1
                    self.tracker.evictions += 1
            if on_host and self._free() >= reserve:
                c.move_shard(DEVICE)

    def after_warmup(
        self, optimizer_states: dict[int, dict[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Fix the steady budget and move optimizer states of leading chunks to the device while they fit."""
        self.tracker.end_warmup()
        self.warm = True
        budget = self._budget()
        if budget is None:
            return optimizer_states
        shards_all = sum(
            c.shard_size * c.full.element_size()
            for c in self.m.chunks
            if not c.keep_gathered  # type: ignore[union-attr]
        )
        shards_on_device = self.tracker.model_bytes(DEVICE, "param_shard")
        persistent = self.tracker.model_bytes(DEVICE) - self._transient() - shards_on_device
        room = budget - persistent - shards_all - self.transient_peak
        for c in self.m.chunks:
            if c.master is None or c.optim_location == DEVICE:
                continue
            states = optimizer_states.get(c.index, {})
            nbytes = 2 * c.master.numel() * 4 + sum(
                v.numel() * v.element_size() for v in states.values() if v.numel() > 1
            )
            if nbytes > room:
                break
            optimizer_states[c.index] = c.move_optim(DEVICE, states)
            room -= nbytes
        return optimizer_states
