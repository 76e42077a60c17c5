"""One forward of a Hugging Face causal LM over a scheduled batch, packed without padding; decode steps replay
captured CUDA graphs.

[Note: decode graphs]
A decode step (every sequence brings one token, no drafts) has the same shapes whatever its contents, once the
batch is padded up to one of a few sizes. ``DecodeGraphs`` keeps one static int32 device buffer per size, laid out
as the host builds a step's inputs (block tables as wide as the longest sequence, tokens computed, token ids, cache
slots, positions; the query starts are ``arange``, one token a sequence), and captures one CUDA graph per size, the
largest first, all in one memory pool: the whole model forward up to fp32 logits, with the paged attention reading
its inputs from that size's buffer. A step writes its sequences' rows into a pinned staging buffer, fills the
padding rows with a sequence of one token at position 0 in the cache's scratch block, sends it up in one
host-to-device copy, replays the graph of the smallest size that holds the batch and keeps the first rows of the
logits. The split-K count of the attention is fixed per size at capture, from the longest
possible context; splits past a sequence's end see no keys and weigh nothing. Prefill and mixed steps, and steps
with drafts, run eagerly. Off CUDA the same padded buffers run eagerly (``capture=False``), which is how the
padding is tested on CPU.

[Note: launching ahead]
A graph-replayed decode step is a few milliseconds of GPU work, and between two of them the host reads the sampled
tokens, updates the sequences and prepares the next step: a few hundred microseconds in which the GPU would idle.
When every sequence of a decode batch picks its token greedily (no penalty, no logprobs), the graph itself takes
the argmax of the logits, and the host can launch the next step before it knows these tokens: the next step's
token ids are copied on the device from this step's argmax, and its positions, slots and block tables are the
current ones advanced by one, which the host knows already. ``Scheduler.can_run_ahead`` says when the next batch
will be these sequences again, one token each, in blocks they already hold alone; only a stop token can change it.
The step launched ahead is remembered with the sequences and token counts it assumed, and its tokens come back
through a pinned buffer of their own (two alternate, one per step in flight). The next ``greedy`` call uses it when
its batch is exactly the one assumed and needs no block copy; otherwise the step is dropped. A dropped step wrote
the K/V of the true next token at its true position into a block its sequence holds alone, the value the same step
writes when it runs for real, so nothing it leaves behind is wrong.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass

import torch
from torch import nn

from ._attention import ATTENTION_NAME, PagedBatch, PagedKVCache, rope_deferred, to_device
from ._parallel import local_kv_heads
from ._scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


def kv_cache_for(
    model: nn.Module, *, num_blocks: int, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> PagedKVCache:
    """A paged cache shaped for ``model``'s decoder layers (its text config's layers, kv heads and head dim); with
    ``tp_size > 1`` the model is sharded and the cache holds this rank's kv heads."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return PagedKVCache(
        num_layers=cfg.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=local_kv_heads(kv_heads, tp_size),
        head_dim=head_dim,
        dtype=dtype,
        device=next(model.parameters()).device,
    )


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The decode batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, and the largest."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_batch_size} | set(range(16, max_batch_size, 16))
    return sorted(sizes | {max_batch_size})


@dataclass(frozen=True)
class _Ahead:
    """A decode step launched before its batch was scheduled: the sequences (by identity) and token counts it
    assumed, the size replayed, and the pinned buffer and event its tokens arrive with."""

    key: tuple[tuple[int, ...], tuple[int, ...]]
    size: int
    tokens: torch.Tensor
    done: torch.cuda.Event | None


class _GraphInputs:
    """The static int32 inputs of one graph size ``b``, in one buffer laid out as the host builds them: block tables
    (b x max_blocks), tokens computed (b), token ids (b), slots (b), positions (b)."""

    def __init__(self, b: int, max_blocks: int, device: torch.device) -> None:
        self.flat = torch.zeros(b * max_blocks + 4 * b, dtype=torch.int32, device=device)
        self.tables = self.flat[: b * max_blocks].view(b, max_blocks)
        self.computed, self.ids, self.slots, self.positions = self.flat[b * max_blocks :].view(4, b).unbind(0)


class DecodeGraphs:
    """Captured decode forwards for the batch sizes in ``sizes`` (see [Note: decode graphs])."""

    def __init__(
        self, model: nn.Module, cache: PagedKVCache, *, sizes: list[int], max_blocks: int, capture: bool
    ) -> None:
        self.model = model
        self.cache = cache
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.capture = capture
        dev = cache.device
        self._inputs = {b: _GraphInputs(b, max_blocks, dev) for b in self.sizes}
        b = self.sizes[-1]
        self._query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self._keep = torch.arange(b, device=dev)
        # a step's inputs go up in one copy from this pinned buffer, once the previous step's copy has read it
        self._staging = torch.empty_like(self._inputs[b].flat, device="cpu")
        self._copied: torch.cuda.Event | None = None
        if dev.type == "cuda":
            self._staging = self._staging.pin_memory()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._argmax: dict[int, torch.Tensor] = {}  # each size's greedy tokens, computed in the graph
        # [Note: launching ahead]: the step in flight, and two pinned buffers its tokens and the current step's
        # come back through
        self._ahead: _Ahead | None = None
        pin = dev.type == "cuda"
        self._token_buffers = [torch.empty(b, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self.num_ahead = 0  # steps launched ahead, since construction
        self.num_ahead_used = 0  # of them, used
        if capture:
            self._capture_all()

    def _forward(self, b: int) -> torch.Tensor:
        x = self._inputs[b]
        paged = PagedBatch(
            cache=self.cache,
            slot_mapping=x.slots.long(),  # HF embeddings and index_put want int64: copies made inside the graph
            positions=x.positions.long(),
            block_tables=x.tables,
            query_start=self._query_start[: b + 1],
            num_computed=x.computed,
            max_query_len=1,
            max_context_len=self.max_blocks * self.cache.block_size,  # sizes the split-K count once
        )
        with rope_deferred():
            out = self.model(
                input_ids=x.ids.long()[None],
                position_ids=paged.positions[None],
                use_cache=False,
                logits_to_keep=self._keep[:b],
                cai_paged=paged,
            )
        return out.logits[0].float()

    def _forward_all(self, b: int) -> None:
        logits = self._logits[b] = self._forward(b)
        self._argmax[b] = logits.argmax(-1)

    def _replay(self, b: int) -> None:
        if self.capture:
            self._graphs[b].replay()
        else:
            with torch.inference_mode():
                self._forward_all(b)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        for b in self.sizes:  # every row a padding row: valid inputs for the warm-up runs
            self._fill([], [], [], b)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: compiles the kernels, sets up cuBLAS
            for b in self.sizes:
                self._forward_all(b)
        torch.cuda.current_stream().wait_stream(side)
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward_all(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()
        logger.info(
            "cai-infer: captured decode graphs for batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def covers(self, batch: ScheduledBatch, drafts: list[list[int]] | None) -> bool:
        """Whether ``batch`` is a decode step a graph can run: one token a sequence, no drafts, few enough."""
        return (
            drafts is None
            and len(batch.seqs) <= self.sizes[-1]
            and all(n == 1 for n in batch.num_new)
            and all(batch.samples)
            and all(len(seq.block_table) <= self.max_blocks for seq in batch.seqs)
        )

    def _fill(self, tables: list[list[int]], computed: list[int], ids: list[int], b: int) -> None:
        """Copy the rows of ``len(ids)`` sequences into size ``b``'s inputs, padding rows up to ``b``: one
        host-to-device copy."""
        bs, pad, width, s = self.cache.block_size, self.cache.scratch_block, self.max_blocks, len(ids)
        host = array("i")
        for table in tables:
            host.extend(table)
            host.extend([pad] * (width - len(table)))
        host.extend([pad] * ((b - s) * width))
        host.extend(computed)
        host.extend([0] * (b - s))
        host.extend(ids)
        host.extend([0] * (b - s))
        host.extend(t[c // bs] * bs + c % bs for t, c in zip(tables, computed, strict=True))
        host.extend([pad * bs] * (b - s))
        host.extend(computed)  # the new token's position is the count of tokens before it
        host.extend([0] * (b - s))
        dst = self._inputs[b].flat
        if dst.device.type != "cuda":
            dst.copy_(torch.frombuffer(host, dtype=torch.int32))
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the staging buffer
        staging = self._staging[: len(host)]
        staging.copy_(torch.frombuffer(host, dtype=torch.int32))
        dst.copy_(staging, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _size(self, s: int) -> int:
        return next(size for size in self.sizes if size >= s)

    def _launch(self, batch: ScheduledBatch) -> int:
        """Fill the inputs of ``batch`` and replay its graph; returns the size replayed."""
        b = self._size(len(batch.seqs))
        computed = list(batch.num_computed)
        self._fill(
            [seq.block_table for seq in batch.seqs],
            computed,
            [seq.tokens[c] for seq, c in zip(batch.seqs, computed, strict=True)],
            b,
        )
        self._replay(b)
        return b

    def drop_ahead(self) -> None:
        """Forget the step launched ahead: another kind of step runs first."""
        self._ahead = None

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """The logits (fp32) of each sequence's next token, in batch order."""
        self._ahead = None
        b = self._launch(batch)
        return self._logits[b][: len(batch.seqs)]

    def greedy(self, batch: ScheduledBatch, *, ahead: bool) -> list[int]:
        """The greedy next token of each sequence of ``batch``; with ``ahead``, the step after it is launched
        before this one's tokens are read (see [Note: launching ahead])."""
        s = len(batch.seqs)
        key = (tuple(map(id, batch.seqs)), tuple(batch.num_computed))
        pending, self._ahead = self._ahead, None
        if pending is not None and pending.key == key and not batch.copies:
            b, tokens, done = pending.size, pending.tokens, pending.done
            self.num_ahead_used += 1
        else:
            b = self._launch(batch)
            tokens, done = self._tokens_to_host(b, s)
        if ahead:
            self._launch_ahead(batch, b)
        if done is not None:
            done.synchronize()
        return tokens[:s].tolist()

    def _tokens_to_host(self, b: int, s: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Send the argmax of size ``b``'s last replay to the next pinned buffer; returns it and an event to
        wait for."""
        buf = self._token_buffers[self._flip]
        self._flip ^= 1
        buf[:s].copy_(self._argmax[b][:s], non_blocking=True)
        if not buf.is_pinned():
            return buf, None
        done = torch.cuda.Event()
        done.record()
        return buf, done

    def _launch_ahead(self, batch: ScheduledBatch, b: int) -> None:
        """Replay the step after ``batch``: each sequence's token from the argmax of the replay just launched,
        at the next position."""
        s = len(batch.seqs)
        computed = [c + 1 for c in batch.num_computed]
        self._fill([seq.block_table for seq in batch.seqs], computed, [0] * s, b)
        self._inputs[b].ids[:s].copy_(self._argmax[b][:s])
        self._replay(b)
        tokens, done = self._tokens_to_host(b, s)
        self._ahead = _Ahead((tuple(map(id, batch.seqs)), tuple(computed)), b, tokens, done)
        self.num_ahead += 1


class ModelRunner:
    """Runs ``model`` (switched to the ``cai_paged`` attention) on the new tokens of a ``ScheduledBatch``."""

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, sizes: list[int], max_blocks: int, *, capture: bool = True) -> None:
        """Run decode steps of up to ``max(sizes)`` sequences through ``DecodeGraphs`` (captured when
        ``capture``, else the same padded buffers run eagerly)."""
        self.graphs = DecodeGraphs(
            self.model, self.cache, sizes=sizes, max_blocks=max_blocks, capture=capture
        )

    def greedy_covers(self, batch: ScheduledBatch) -> bool:
        """Whether ``greedy`` can run ``batch``: a decode step the graphs cover whose sequences all pick their
        tokens greedily, with no penalty and no logprobs."""
        return (
            self.graphs is not None
            and self.graphs.covers(batch, None)
            and all(
                s.params.greedy and s.params.repetition_penalty == 1.0 and s.params.logprobs is None
                for s in batch.seqs
            )
        )

    @torch.inference_mode()
    def greedy(self, batch: ScheduledBatch, *, ahead: bool) -> list[int]:
        """Each sequence's greedy next token for a batch ``greedy_covers``; with ``ahead``, the step after it is
        launched before this one's tokens are read (see [Note: launching ahead])."""
        self.cache.copy_blocks(batch.copies)
        return self.graphs.greedy(batch, ahead=ahead)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into the cache; returns the logits (fp32) of the last token of each sequence
        that samples, in batch order (shape (samples, vocab)).

        With ``drafts`` (per sequence of the batch; a sampling sequence may carry draft tokens, whose blocks the
        caller reserved), the drafts run after the sequence's tokens and each sampling sequence gets
        ``1 + len(its drafts)`` rows: the logits after its last token and after each draft."""
        self.cache.copy_blocks(batch.copies)
        if self.graphs is not None:
            if self.graphs.covers(batch, drafts):
                return self.graphs.run(batch)
            self.graphs.drop_ahead()
        drafts = drafts or [[] for _ in batch.seqs]
        ids: list[int] = []
        keep: list[int] = []
        num_new: list[int] = []
        for seq, c, n, sample, extra in zip(
            batch.seqs, batch.num_computed, batch.num_new, batch.samples, drafts, strict=True
        ):
            ids.extend(seq.tokens[c : c + n])
            ids.extend(extra)
            num_new.append(n + len(extra))
            if sample:
                keep.extend(range(len(ids) - 1 - len(extra), len(ids)))
        paged = PagedBatch.build(
            self.cache,
            block_tables=[s.block_table for s in batch.seqs],
            num_computed=batch.num_computed,
            num_new=num_new,
            device=self.device,
        )
        host = array("i", ids)
        host.extend(keep or [len(ids) - 1])
        dev = to_device(host, self.device).long()
        with rope_deferred():
            out = self.model(
                input_ids=dev[: len(ids)][None],  # (1, T): packed, no padding
                position_ids=paged.positions[None],
                use_cache=False,
                logits_to_keep=dev[len(ids) :],
                cai_paged=paged,
            )
        logits = out.logits[0].float()  # (len(keep), vocab)
        return logits if keep else logits[:0]
