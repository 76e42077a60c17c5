"""Memory planner: predict per-rank peak device and host memory of each placement before training.

[Note: planner model]
Model data per rank, with P the padded chunk elements, T the trainable part, w the group size and b the working
precision's bytes: working shard ``b * P / w`` (the whole ``b * P`` when a rank keeps chunks gathered), fp32 master
``4 * T / w``, Adam moments ``8 * T / w`` and one micro-batch's gradient ``b * T / w`` in the working precision
(in fp32, ``4 * T / w`` kept across steps, when training in fp32 or accumulating), all on the device, or on the host
where the gradient's buffer also carries the parameters up; on the device also the gathered chunks in flight
(current, prefetched and the one held into backward) and up to two chunk-sized gradient buffers being filled in
backward. Non-model data is the activation estimate of a decoder-only transformer (``TransformerShape``): with
checkpointing, each layer's input plus one layer recomputed in backward; without, every layer's saved tensors;
plus the logits, their fp32 copies and gradient at the start of backward, which dominate with large vocabularies.
Those are freed before backward has produced any gradient, so the device peak counts the larger of the two, not
their sum (the loss's bytes per logit were fitted to peaks measured on an H200: examples/benchmarks/RESULTS.md).
Host peak adds the model as built on the host before chunks take over (its largest point), when its parameters are
on the host; a model built on the GPU or on the meta device has no such point.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.nn as nn

from cai.gemini._config import ChunkConfig, GeminiConfig
from cai.gemini._search import default_interval, pack, search_chunk_size

__all__ = [
    "WORKSPACE_BYTES",
    "ChunkLayout",
    "MemoryPlan",
    "PlanRow",
    "TransformerShape",
    "activation_bytes",
    "estimate",
    "host_peak",
    "plan",
]

GiB = 1024**3
WORKSPACE_BYTES = 768 * 1024**2  # cuBLAS / attention workspaces and allocator slack on the device
_HOST_BASE = 3 * GiB  # the process itself: torch, CUDA context, libraries


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes the activation estimate needs (read from a Hugging Face ``model.config`` when not given)."""

    hidden: int
    layers: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int

    @classmethod
    def from_model(cls, model: nn.Module) -> TransformerShape:
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "hidden_size"):
            raise ValueError(
                "plan: the model has no Hugging Face config to read its shape from; pass "
                "shape=TransformerShape(hidden=..., layers=..., ffn=..., vocab=..., heads=..., kv_heads=...)"
            )
        heads = cfg.num_attention_heads
        return cls(
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            ffn=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            vocab=cfg.vocab_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        )


@dataclass(frozen=True)
class PlanRow:
    name: str
    config: GeminiConfig
    device_bytes: int
    host_bytes: int
    fits: bool
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peaks per placement; ``recommended`` is the fastest row that fits, ``advice`` says what
    would fit when none does. ``str(plan)`` is a table."""

    rows: list[PlanRow]
    recommended: PlanRow | None
    advice: str
    gpu_budget_bytes: int
    host_budget_bytes: int | None

    def row(self, name: str) -> PlanRow:
        return next(r for r in self.rows if r.name == name)

    def __str__(self) -> str:
        head = f"{'placement':<26} {'device GiB':>10} {'host GiB':>9}  fits"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            mark = "*" if self.recommended is r else " "
            lines.append(
                f"{mark}{r.name:<25} {r.device_bytes / GiB:>10.2f} {r.host_bytes / GiB:>9.2f}  {'yes' if r.fits else 'no'}"
            )
        budget = f"device budget {self.gpu_budget_bytes / GiB:.2f} GiB"
        if self.host_budget_bytes is not None:
            budget += f", host budget {self.host_budget_bytes / GiB:.2f} GiB"
        lines.append(budget)
        lines.append(self.advice)
        return "\n".join(lines)


PLACEMENTS: dict[str, dict] = {
    "no offload": {},
    "optimizer on host": {"offload_optim_frac": 1.0},
    "optimizer+params on host": {"offload_optim_frac": 1.0, "offload_param_frac": 1.0},
}


def activation_bytes(
    s: TransformerShape,
    batch: int,
    seq: int,
    *,
    recompute: str = "full",
    wbytes: int = 2,
    fused_loss: bool = False,
    fused_norms: bool = True,
) -> dict[str, int]:
    """Activation memory of one micro-batch of a decoder-only transformer, per rank.

    Returns ``saved`` (held from forward into backward), ``loss`` (the loss's tensors at the start of backward) and
    ``layer`` (one layer's tensors while backward recomputes it, with the gradients flowing through it).

    Args:
        recompute: ``"full"`` (each layer keeps only its input and runs again in backward), ``"selective"`` (keeps
            the matmul and attention outputs, recomputes the elementwise ops: ``cai.booster.activation_checkpointing``)
            or ``"none"``.
        fused_loss: the output head and cross-entropy fused in token chunks (cai-kernels' ``patch_hf_model``): no
            full logits; the head's weight gradient and the hidden states' gradient instead.
        fused_norms: RMSNorm is one kernel that saves its input and output (cai-kernels); False: Hugging Face's
            eager RMSNorm, which also saves its input in fp32 and the normalized tensor.
    """
    tokens = batch * seq
    kv = s.hidden * s.kv_heads // s.heads
    # tensors a decoder layer saves for backward, per token (flash attention: no score matrix)
    per_layer = tokens * (wbytes * (6 * s.hidden + 2 * kv + 4 * s.ffn) + 4 * 4)
    if not fused_norms:
        # per eager norm, 4 bytes a hidden element more: in bf16 the fp32 copy of the input (4) and the normalized
        # tensor (2) instead of the input (2); in fp32 the normalized tensor (4)
        per_layer += tokens * 2 * 4 * s.hidden
    # backward through a recomputed layer holds, beside its saved tensors, the gradients in flight through it: about
    # one ffn-wide and one hidden-wide tensor (measured on a CPU, fp32 and unfused: 1.1-1.2x the saved tensors)
    in_flight = tokens * wbytes * (s.ffn + s.hidden)
    if fused_loss:
        # the head's gradient and the hidden states' gradient, formed in forward, and one chunk of logits
        loss = s.vocab * s.hidden * wbytes + tokens * s.hidden * wbytes + 160 * 2**20
    elif wbytes < 4:
        # the working-precision logits, their fp32 copy and log-softmax, and the logits' gradient (these dominate
        # with large vocabularies)
        loss = tokens * s.vocab * (2 * wbytes + 8)
    else:
        # fp32 logits are their own fp32 copy: the log-softmax, its incoming gradient and the logits' gradient
        loss = tokens * s.vocab * 12
    if recompute == "full":
        return {"saved": s.layers * tokens * s.hidden * wbytes, "loss": loss, "layer": per_layer + in_flight}
    if recompute == "selective":
        # kept per token: the layer input, q, k, v, the attention output, the o, gate, up and down projections
        kept = tokens * (wbytes * (5 * s.hidden + 2 * kv + 2 * s.ffn) + 4 * 4)
        return {"saved": s.layers * kept, "loss": loss, "layer": per_layer - kept + in_flight}
    if recompute == "none":
        return {"saved": s.layers * per_layer, "loss": loss, "layer": 0}
    raise ValueError(f"activation_bytes: recompute={recompute!r}; use 'full', 'selective' or 'none'")


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk elements per rank group: ``chunk_size``, padded elements of the trainable chunks (``trained``) and of
    all chunks (``padded``), and the parameters' own elements (``total``)."""

    chunk_size: int
    trained: int
    padded: int
    total: int

    @classmethod
    def of(
        cls, numels: list[int], trainable: list[bool], *, world_size: int, chunk: ChunkConfig
    ) -> ChunkLayout:
        """The layout the chunk manager would build for parameters of these sizes."""
        if chunk.chunk_size:
            csize = -(-chunk.chunk_size // world_size) * world_size
        else:
            csize = search_chunk_size(
                numels,
                search_range_m=chunk.search_range_m,
                search_interval=default_interval(chunk.hidden_dim, chunk.search_interval),
                min_chunk_size_m=chunk.min_chunk_size_m,
                filter_exlarge_params=chunk.filter_exlarge_params,
                world_size=world_size,
            ).chunk_size
        # the same packing as the chunk manager: trainable and frozen parameters in separate chunks
        trained = _padded([n for n, t in zip(numels, trainable) if t], csize, world_size)
        frozen = _padded([n for n, t in zip(numels, trainable) if not t], csize, world_size)
        return cls(chunk_size=csize, trained=trained, padded=trained + frozen, total=sum(numels))


def estimate(
    layout: ChunkLayout,
    act: dict[str, int],
    *,
    world_size: int,
    wbytes: int,
    offload_optim_frac: float = 0.0,
    offload_param_frac: float = 0.0,
    max_prefetch: int = 0,
    built_on_host_bytes: int = 0,
    workspace_bytes: int = WORKSPACE_BYTES,
    accumulation: int = 1,
) -> tuple[dict[str, int], dict[str, int]]:
    """Per-rank device and host bytes of one placement, by part (see [Note: planner model]); the device peak is
    the sum of the first dict, the host peak the larger of the second's ``steady`` sum and its ``build`` entry.

    ``act`` is ``activation_bytes(...)``; ``built_on_host_bytes`` the model as built on the host before chunks
    take over (0 for a model built on the device or the meta device); ``accumulation`` the micro-batches of a step
    (all but the last under ``no_sync``).
    """
    w, fo, fp = world_size, offload_optim_frac, offload_param_frac
    keep_all = w == 1 and not fp
    shards = wbytes * layout.padded if keep_all else wbytes * layout.padded // w
    # one micro-batch's gradient stays in the working precision: on the device as reduced (on one rank the chunk's
    # gradient buffer itself), freed by zero_grad; on the host in the transfer buffer that also carries the
    # parameters up. An fp32 gradient (fp32 training, or a sum over micro-batches) is copied into an fp32 shard
    # that is kept across steps.
    fp32_grad = wbytes == 4 or accumulation > 1
    grads_dev = int((1 - fo) * (4 if fp32_grad else wbytes) * layout.trained // w)
    # chunk-sized gradient buffers being filled, at most two at a time; on one rank with the optimizer on the
    # device a working-precision buffer is the gradient shard itself
    chunks = max(1, layout.padded // layout.chunk_size)
    own = w == 1 and not fp32_grad and not fo
    buffers = 0 if own else min(2, chunks) * layout.chunk_size * wbytes
    dev = {
        "saved activations": act["saved"],
        "workspace": workspace_bytes,
        "fp32 gradient shards": grads_dev if fp32_grad else 0,
        # the loss's tensors are gone before backward has produced any gradient (the first gradient buffer is
        # allocated when the output head's gradient arrives): the larger one counts
        "loss or gradients": max(act["loss"], (0 if fp32_grad else grads_dev) + buffers + act["layer"]),
        "gathered chunks": 0 if keep_all else (2 + max_prefetch) * layout.chunk_size * wbytes,
        "parameter shards": int((1 - fp) * shards),
        "master+adam": int((1 - fo) * 12 * layout.trained // w),
        # no_sync sums each chunk's whole gradient buffer in fp32 until the synchronised backward reduces it
        "no_sync accumulator": 4 * layout.trained if accumulation > 1 else 0,
    }
    host = {
        "process": _HOST_BASE,
        "parameter shards": int(fp * shards),
        "master+adam+transfer": int(fo * (12 + wbytes) * layout.trained // w),
        # the model as built, and the fp32 staging of one chunk while chunks are filled
        "build": _HOST_BASE + built_on_host_bytes + 4 * layout.chunk_size,
    }
    return dev, host


def host_peak(host: dict[str, int]) -> int:
    """The host peak of ``estimate``'s host dict: steady state or the model as built, whichever is larger."""
    return max(sum(v for k, v in host.items() if k != "build"), host["build"])


def plan(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    gpu_budget_bytes: int,
    *,
    host_budget_bytes: int | None = None,
    world_size: int = 1,
    precision: str = "bf16",
    activation_checkpointing: bool = True,
    chunk: ChunkConfig | None = None,
    max_prefetch: int = 0,
    shape: TransformerShape | None = None,
    init_dtype_bytes: int = 2,
) -> MemoryPlan:
    """Predict per-rank peak device and host memory of training ``model`` under each placement.

    Args:
        model: the model (only parameter counts and its shape are read; a model on the meta device works).
        batch_size, seq_len: the per-rank micro-batch.
        gpu_budget_bytes: device memory available to the process.
        host_budget_bytes: host memory available (None: not checked).
        world_size: ranks sharing the chunks.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        activation_checkpointing: whether each decoder layer is recomputed in backward.
        chunk: the chunk layout (default ``ChunkConfig(hidden_dim=hidden)``).
        max_prefetch: chunks gathered ahead.
        shape: the transformer's sizes when ``model`` has no Hugging Face config.
        init_dtype_bytes: bytes per element of the model as built on the host (2 for bf16, 4 for fp32); only
            counted when ``model``'s parameters are on the host.

    Returns:
        A ``MemoryPlan``; ``print(plan)`` shows the table, the recommendation, and, when nothing fits, what
        would (a larger budget, a smaller batch, or more ranks).

    Example::

        p = gemini.plan(model, 4, 2048, 24 * 2**30, host_budget_bytes=120 * 2**30)
        print(p); config = p.recommended.config
    """
    shape = shape or TransformerShape.from_model(model)
    cfg = GeminiConfig(precision=precision, max_prefetch=max_prefetch)  # type: ignore[arg-type]
    wbytes = {"bf16": 2, "fp16": 2, "fp32": 4}[precision]
    params = _unique_params(model)
    chunk = chunk or ChunkConfig(hidden_dim=shape.hidden)
    layout = ChunkLayout.of(
        [p.numel() for p in params], [p.requires_grad for p in params], world_size=world_size, chunk=chunk
    )
    built_on_host = any(p.device.type == "cpu" for p in params)
    recompute = "full" if activation_checkpointing else "none"
    act = activation_bytes(shape, batch_size, seq_len, recompute=recompute, wbytes=wbytes)
    rows = []
    for name, kw in PLACEMENTS.items():
        dev, host = estimate(
            layout, act, world_size=world_size, wbytes=wbytes, max_prefetch=max_prefetch,
            built_on_host_bytes=init_dtype_bytes * layout.total if built_on_host else 0, **kw,
        )  # fmt: skip
        dev_total, host_total = sum(dev.values()), host_peak(host)
        fits = dev_total <= gpu_budget_bytes and (
            host_budget_bytes is None or host_total <= host_budget_bytes
        )
        breakdown = {k: v for k, v in dev.items() if v} | {
            f"host {k}": v for k, v in host.items() if v and k != "build"
        }
        rows.append(PlanRow(name, replace(cfg, chunk=chunk, **kw), dev_total, host_total, fits, breakdown))
    recommended = next((r for r in rows if r.fits), None)
    advice = (
        f"recommended: {recommended.name}"
        if recommended
        else _advice(
            rows,
            model,
            batch_size,
            seq_len,
            gpu_budget_bytes,
            host_budget_bytes,
            world_size,
            precision,
            activation_checkpointing,
            chunk,
            max_prefetch,
            shape,
            init_dtype_bytes,
        )
    )
    return MemoryPlan(rows, recommended, advice, gpu_budget_bytes, host_budget_bytes)


def _advice(
    rows, model, batch, seq, gpu, host, world, precision, ckpt, chunk, prefetch, shape, init_bytes
) -> str:
    smallest = min(rows, key=lambda r: r.device_bytes)
    parts = [f"nothing fits: '{smallest.name}' needs {smallest.device_bytes / GiB:.2f} GiB of device memory"]
    if host is not None and smallest.host_bytes > host:
        parts.append(f"and {smallest.host_bytes / GiB:.2f} GiB of host memory")
    b = batch
    while b > 1:
        b //= 2
        p = plan(model, b, seq, gpu, host_budget_bytes=host, world_size=world, precision=precision,
                 activation_checkpointing=ckpt, chunk=chunk, max_prefetch=prefetch, shape=shape,
                 init_dtype_bytes=init_bytes)  # fmt: skip
        if p.recommended:
            parts.append(f"; batch size {b} fits with '{p.recommended.name}'")
            break
    if not ckpt:
        p = plan(model, batch, seq, gpu, host_budget_bytes=host, world_size=world, precision=precision,
                 activation_checkpointing=True, chunk=chunk, max_prefetch=prefetch, shape=shape,
                 init_dtype_bytes=init_bytes)  # fmt: skip
        if p.recommended:
            parts.append(f"; activation checkpointing fits with '{p.recommended.name}'")
    for w in (2, 4, 8, 16, 32, 64):
        if w <= world:
            continue
        p = plan(model, batch, seq, gpu, host_budget_bytes=host, world_size=w, precision=precision,
                 activation_checkpointing=ckpt, chunk=chunk, max_prefetch=prefetch, shape=shape,
                 init_dtype_bytes=init_bytes)  # fmt: skip
        if p.recommended:
            parts.append(f"; {w} ranks fit with '{p.recommended.name}'")
            break
    return " ".join(parts)


def _padded(numels: list[int], csize: int, world: int) -> int:
    total = 0
    for idx in pack(numels, csize):
        used = sum(numels[i] for i in idx)
        total += -(-max(csize, used) // world) * world
    return total


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # parameters() yields tied tensors once
