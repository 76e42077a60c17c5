"""Predicted per-rank GPU and host peaks and step time of one candidate.

[Note: plugin memory]
Bytes a parameter, per rank, with working precision b (2 for bf16), Adam, w data-parallel ranks:
  ddp     fp32 weights 4, fp32 gradients 4 (+4 of DDP buckets when w > 1), Adam 8; autocast keeps a b-byte copy
          of each weight for backward (without recomputation).
  fsdp    fp32 shards 4/w, fp32 gradient shards 4/w, Adam 8/w; the root (embeddings, head) stays gathered in b;
          in backward two decoder layers are gathered at a time, and an unsharded gradient of one layer in fp32.
  zero    working weights b, fp32 master and Adam 12/w, one reduced gradient shard b/w (with w > 1 also the
          reduction buckets in flight; with one rank the reduced bucket is the shard); with offload the master, Adam
          and an fp32 gradient shard live on the host (16/w) with a b-byte staging buffer.
  gemini  cai-gemini's own estimate (``cai.gemini.estimate``) for the placement's fractions.
  hybrid  zero-1 over dp for each rank's 1/(tp x pp) of the model.
Accumulating k > 1 micro-batches runs the earlier ones under ``no_sync``: zero keeps full local gradient buckets
(b a parameter), gemini an fp32 accumulator for every chunk (4), ddp its fp32 gradients (4) and fsdp unsharded
fp32 gradients (4), all alive through the last micro-batch.
The loss's tensors are freed before the first gradient exists, so they count against the gradients, not beside
them; ddp and fsdp gradients appear parameter by parameter, so the first layer's recomputation (the last) runs
without its own and the input embedding's gradients, while zero's buckets and gemini's chunks are allocated whole.
Activations come from ``cai.gemini.activation_bytes`` (tensor parallelism divides them by tp; the first pipeline
stage holds pp micro-batches of its L/pp layers in 1F1B, one micro-batch of all layers). Offloaded layers
([Note: activation offload]) hold none on the device but the ``PREFETCH + 1`` layers in flight and what PCIe could
not move out during the forward. The host peak adds the process itself (``Hardware.host_base_bytes``, measured by
calibration); models are built lazily (``LazyInitContext``) or on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cai.booster._offload import PREFETCH
from cai.booster._plan._candidate import Candidate
from cai.booster._plan._cost import step_seconds
from cai.booster._plan._hardware import Hardware
from cai.booster._plan._spec import ModelSpec
from cai.gemini import WORKSPACE_BYTES, ChunkConfig, ChunkLayout, activation_bytes, estimate, host_peak

__all__ = ["Estimate", "estimate_candidate"]

_BUCKETS = 2 * 25 * 2**20  # reduction buckets in flight
_OPT_BYTES = 28  # bytes a device Adam step moves per parameter (fp32 master, moments, gradient, working copy)
_OVERLAP = 0.9  # share of backward that communication and the host step can hide behind


@dataclass(frozen=True)
class Estimate:
    gpu_bytes: int
    host_bytes: int
    step_s: float
    gpu_parts: dict[str, int]
    host_parts: dict[str, int]
    time_parts: dict[str, float]


def estimate_candidate(
    c: Candidate,
    spec: ModelSpec,
    hw: Hardware,
    *,
    seq: int,
    dp: int,
    precision: str = "bf16",
    kernels: bool = True,
    device: str = "cuda",
) -> Estimate:
    """Memory and time of ``c`` for ``spec`` at ``dp`` data-parallel ranks (see [Note: plugin memory])."""
    wb = {"bf16": 2, "fp16": 2, "fp32": 4}[precision]
    gpu = device == "cuda"
    shard = c.tp * c.pp  # ranks one replica's model is cut over
    P = spec.params / shard
    act = _activations(c, spec, hw, seq=seq, wb=wb, kernels=kernels)
    if shard > 1:
        # per layer work and the vocabulary split over tp; a pp stage holds pp micro-batches of L/pp layers
        act = {k: int(v / c.tp) for k, v in act.items()}
    k = c.accumulation
    parts: dict[str, float] = {"saved activations": act["saved"], "workspace": WORKSPACE_BYTES if gpu else 0}
    base = hw.host_base_bytes if gpu else 0  # the process: torch, the CUDA context, libraries
    host: dict[str, float] = {"process": base}
    grads = 0.0  # gradient bytes alive at the end of backward, counted against the loss's tensors
    late = 0.0  # of those, bytes that do not exist yet while backward runs the first layer (see _late_share)
    if c.plugin == "ddp":
        parts["fp32 weights+adam"] = 12 * P
        grads = 4 * P + (4 * P if dp > 1 else 0)
        late = 4 * P * _late_share(spec)
        if k > 1:  # the earlier micro-batches' gradients are there from the start of the last one
            parts["accumulated gradients"] = 4 * P
            grads, late = grads - 4 * P, 0.0
        if c.recompute == "none" and wb == 2:
            parts["autocast weight copies"] = wb * (spec.matmul_params / shard)
    elif c.plugin == "fsdp":
        root, layer = spec.root_params, spec.layer_params
        parts["fp32 shards+adam"] = 12 * P / dp
        # the root (embeddings, head) stays gathered from forward to the end of backward; two decoder layers are
        # gathered at a time, in backward beside the gradients (after forward they are resharded)
        parts["gathered root"] = wb * root
        grads = 4 * P / dp + 4 * layer + wb * 2 * layer
        late = 4 * P / dp * _late_share(spec)
        if k > 1:
            # no_sync keeps every gradient unsharded in fp32 (the reduce dtype) from the first micro-batch on; the
            # synchronised backward reduce-scatters them layer by layer into the shards
            parts["no_sync gradients"] = 4 * P
            grads, late = 4 * layer + wb * 2 * layer, 0.0
    elif c.plugin in ("zero1", "zero2", "hybrid"):
        parts["working weights"] = wb * P
        # buckets are allocated whole when their first gradient arrives (no late share); with one rank a reduced
        # bucket is kept as the gradient shard, with several its reduction is a new shard and buckets are in flight
        in_flight = min(_BUCKETS, wb * P) if dp > 1 else 0
        if c.offload:
            host["master+adam+grad"] = 16 * P / dp
            host["staging"] = wb * P / dp
            grads = wb * P / dp + in_flight  # the reduced shard is held on the device until the host step
        else:
            parts["master+adam"] = 12 * P / dp
            grads = wb * P / dp + in_flight
        if k > 1:
            # no_sync fills every bucket; the synchronised backward reduces them into the shards (on one rank the
            # buckets are the shards)
            parts["no_sync buckets"] = wb * P
            grads = _BUCKETS if c.offload else (wb * P / dp if dp > 1 else 0)
    else:  # gemini
        layout = _chunk_layout(spec.numels, dp, spec.shape.hidden)
        dev, hst = estimate(
            layout, act, world_size=dp, wbytes=wb, offload_optim_frac=c.offload_optim_frac,
            offload_param_frac=c.offload_param_frac, max_prefetch=2 if c.offload_param_frac else 0,
            workspace_bytes=parts["workspace"], accumulation=k,
        )  # fmt: skip
        parts = dict(dev)
        # the fp32 staging of one chunk while chunks are filled; on the CPU the host is the device, and that is
        # before any activation or gradient exists, far below the training peak
        host = {**hst, "process": base, "build": base + 4 * layout.chunk_size if gpu else 0}
    if c.plugin != "gemini":
        parts["loss or gradients"] = max(act["loss"], grads, grads - late + act["layer"])
    gpu_bytes = int(sum(parts.values()))
    host_bytes = int(host_peak(host) if "build" in host else sum(host.values()))
    host_parts = {k_: int(v) for k_, v in host.items() if k_ != "build" and v}
    times = _time(c, spec, hw, seq=seq, dp=dp, wb=wb, kernels=kernels)
    return Estimate(gpu_bytes, host_bytes, sum(times.values()),
                    {k_: int(v) for k_, v in parts.items() if v}, host_parts, times)  # fmt: skip


def _activations(c: Candidate, spec: ModelSpec, hw: Hardware, *, seq: int, wb: int, kernels: bool) -> dict:
    s = spec.shape
    kw = dict(wbytes=wb, fused_loss=kernels, fused_norms=kernels)
    act = activation_bytes(s, c.micro_batch, seq, recompute=c.recompute, **kw)
    off, layer = _offloaded(c, spec, seq=seq, wb=wb, kernels=kernels)
    if off:
        kept = act["saved"] / s.layers
        # what the copies out have not moved by the end of forward (about a third of a step without recompute)
        # is still on the device when backward starts
        tokens = c.micro_batch * seq
        forward_s = step_seconds(spec, hw, tokens=tokens, seq=seq, wbytes=wb, recompute="none", kernels=kernels,
                                 tp=c.tp) / 3  # fmt: skip
        lag = max(0.0, off * layer / c.tp - hw.pcie_gbs * 1e9 * forward_s) * c.tp
        act["saved"] = int((s.layers - off) * kept + min(off, PREFETCH + 1) * layer + lag)
    return act


def _offloaded(c: Candidate, spec: ModelSpec, *, seq: int, wb: int, kernels: bool) -> tuple[int, float]:
    """The layers ``c`` offloads, and the bytes one of them saves for backward (all of it, as without recompute)."""
    s = spec.shape
    off = int(c.offload_activations * s.layers)
    if not off:
        return 0, 0.0
    act = activation_bytes(
        s, c.micro_batch, seq, recompute="none", wbytes=wb, fused_loss=kernels, fused_norms=kernels
    )
    return off, act["saved"] / s.layers


def _offload_seconds(c: Candidate, spec: ModelSpec, *, seq: int, wb: int, kernels: bool, pcie_gbs: float,
                    forward_s: float, backward_s: float) -> float:  # fmt: skip
    """PCIe time of one micro-batch's offloaded activations that compute does not hide: each direction moves the
    offloaded layers' activations, out during forward and back during backward."""
    off, layer = _offloaded(c, spec, seq=seq, wb=wb, kernels=kernels)
    if not off:
        return 0.0
    io = off / c.pp * layer / c.tp / (pcie_gbs * 1e9)  # a stage's share of the layers, like the times given
    return max(0.1 * io, io - forward_s) + max(0.1 * io, io - backward_s)


@functools.lru_cache(maxsize=16)
def _chunk_layout(numels: tuple[int, ...], dp: int, hidden: int) -> ChunkLayout:
    """Gemini's chunk layout, searched once per model and group size (seconds for a 70B model; a plan prices
    dozens of Gemini rows)."""
    return ChunkLayout.of(
        list(numels), [True] * len(numels), world_size=dp, chunk=ChunkConfig(hidden_dim=hidden)
    )


def _late_share(spec: ModelSpec) -> float:
    """The share of per-parameter gradients (ddp, fsdp) that backward produces after it has begun the first decoder
    layer: that layer's and, unless tied to the head, the input embedding's. The first layer's recomputation is
    the last, so it runs beside all the other gradients but not these."""
    embedding = 0 if spec.tied else spec.shape.vocab * spec.shape.hidden
    return (embedding + spec.layer_params) / spec.params


def _time(c: Candidate, spec: ModelSpec, hw: Hardware, *, seq: int, dp: int, wb: int, kernels: bool) -> dict:
    k, shard = c.accumulation, c.tp * c.pp
    P = spec.params / shard
    tokens = c.micro_batch * seq
    mb = step_seconds(
        spec, hw, tokens=tokens, seq=seq, wbytes=wb, recompute=c.recompute, kernels=kernels, tp=c.tp
    )
    off = int(c.offload_activations * spec.shape.layers) / spec.shape.layers
    if off:  # recomputation is per layer: the offloaded layers' share runs as without it
        plain = step_seconds(
            spec, hw, tokens=tokens, seq=seq, wbytes=wb, recompute="none", kernels=kernels, tp=c.tp
        )
        mb = (1 - off) * mb + off * plain
    mb /= c.pp
    backward = mb * (0.75 if c.recompute == "full" else 2 / 3)
    bw = hw.comm_gbs * 1e9
    pcie = hw.pcie_gbs * 1e9
    t: dict[str, float] = {"compute": k * mb}
    if off:
        t["activation offload (exposed)"] = k * _offload_seconds(
            c, spec, seq=seq, wb=wb, kernels=kernels, pcie_gbs=hw.pcie_gbs, forward_s=mb - backward,
            backward_s=backward,
        )  # fmt: skip
    # memory-bound weight traffic around the matmuls, per micro-batch: DDP's autocast reads fp32 weights and writes
    # bf16 copies every forward and folds bf16 gradients into fp32 ones; FSDP2 also casts into its gather buffers
    # (forward and backward) and gradients into fp32 for its reduce-scatter
    traffic = {"ddp": 16 if wb == 2 else 8, "fsdp": 26 if wb == 2 else 16}.get(c.plugin, 0)
    if traffic:
        t["weight casts"] = k * traffic * P / (0.6 * hw.copy_gbs * 1e9)
    if c.pp > 1:  # 1F1B: (pp - 1) micro-batch slots idle out of k + pp - 1
        t["pipeline bubble"] = (c.pp - 1) * mb
    if c.tp > 1:
        # two all-reduces of the activations forward and two backward per layer (sequence parallel: the same bytes
        # as all-gather + reduce-scatter), not overlapped
        per_layer = 4 * tokens * spec.shape.hidden * wb * 2 * (c.tp - 1) / c.tp
        t["tensor-parallel comm"] = k * spec.shape.layers / c.pp * per_layer / bw
    # data-parallel communication, once per step (no_sync before the last micro-batch) except FSDP's gathers
    ring = (dp - 1) / dp if dp > 1 else 0.0
    comm = 0.0
    if c.plugin == "ddp":
        comm = 2 * ring * 4 * P / bw
    elif c.plugin in ("zero1", "zero2", "hybrid"):
        reduce = 1 if c.plugin == "zero2" else 2  # a reduce-scatter, or an all-reduce
        comm = (reduce + 1) * ring * wb * P / bw  # and the all-gather of the updated parameters
    elif c.plugin == "fsdp":
        gathers = 3 if c.recompute == "full" else 2
        comm = k * (gathers * ring * wb * P + ring * 4 * P) / bw
    elif c.plugin == "gemini":
        gathers = 3 if c.recompute == "full" else 2
        comm = (k * gathers * ring * wb * P + ring * wb * P) / bw
    if comm:
        t["data-parallel comm (exposed)"] = max(0.1 * comm, comm - _OVERLAP * backward)
    if c.plugin == "gemini" and c.offload_param_frac:
        passes = 3 if c.recompute == "full" else 2
        io = k * passes * c.offload_param_frac * wb * P / pcie
        t["parameter uploads (exposed)"] = max(0.1 * io, io - k * mb)
    on_host = c.host_params_frac * P / dp
    on_device = P / dp - on_host
    t["device optimizer"] = _OPT_BYTES * on_device / (0.6 * hw.copy_gbs * 1e9)
    if on_host:
        # the host Adam and the gradient/parameter copies run concurrently, chunk by chunk; the overlapped step
        # starts each chunk as its gradient arrives during the last backward
        host = max(on_host / hw.host_adam_params_per_s, 2 * wb * on_host / pcie)
        t["host optimizer (exposed)"] = max(0.05 * host, host - _OVERLAP * backward)
    return t
