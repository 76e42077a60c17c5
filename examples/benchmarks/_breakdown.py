"""Where a training step's time goes: torch.profiler's kernel (GPU) or operator (CPU) times over a few steps, put into
the buckets of a step profile: matmul, attention, fused Triton kernels, optimizer, communication, copies, other
(elementwise and reductions), and the idle time the device spends waiting for the host.

Buckets are read from the names: cuBLAS / CUTLASS GEMMs and ``aten::mm``-like operators are matmuls; flash, fused
multi-head and SDPA kernels attention; NCCL or gloo collectives communication; Adam kernels and cai's host Adam the
optimizer; Triton kernels (cai-kernels' norms, SwiGLU, rotary, fused loss and FP8 quantisers by their names, and
torch.compile's) the fused kernels. Idle is the step's wall time less the device's busy time (kernels on all
streams summed, communication left out, since it runs beside compute); on the CPU every operator is host time, and
idle is what no operator covers (Python, the launcher).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

BUCKETS = ("matmul", "attention", "fused kernels", "optimizer", "communication", "copies", "other")

_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d::", "all_reduce", "allreduce", "all_gather", "reduce_scatter")),
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product", "combine_splits_kernel")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk", "scaled_mm", "f8f8bf16", "grouped_mm", "aten::mm",
                "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to", "aten::_to_copy")),
    ("fused kernels", ("triton",)),
)  # fmt: skip
# cai-kernels' Triton kernels appear under their function names alone
_CAI_FUSED = {"_norm_fwd_kernel", "_norm_bwd_kernel", "swiglu_fwd_kernel", "swiglu_bwd_kernel",
              "swiglu_packed_fwd_kernel", "rope", "rope_kv_write_kernel", "kv_write_kernel", "ce_stats_kernel",
              "ce_grad_kernel", "quantize_rows_kernel", "quantize_split_kernel", "row_amax_kernel"}  # fmt: skip


def bucket(name: str) -> str:
    # Inductor's kernels are named after the ops they fuse (a quantisation feeding _scaled_mm carries its name)
    if name.startswith("triton_") or name in _CAI_FUSED:
        return "fused kernels"
    low = name.lower()
    for label, keys in _RULES:
        if any(k in low for k in keys):
            return label
    return "other"


def step_breakdown(
    step: Callable[[], None],
    *,
    device: torch.device,
    steps: int = 2,
    top: list | None = None,
    gaps: list | None = None,
    syncs: list | None = None,
    matmuls: list | None = None,
    trace: str | None = None,
) -> dict[str, float]:
    """Milliseconds per step in each of ``BUCKETS`` plus ``"idle"`` and ``"step"`` (the wall time), over ``steps``
    profiled steps (run them after warm-up: compilation and allocation would count). ``top``, if given, receives
    the ten largest kernels (operators on the CPU) outside the matmul and attention buckets as ``(ms per step,
    bucket, name, callers)``: what the step spends besides its products; ``callers`` (GPU only) lists the operator
    chains that launched the kernel (innermost first, for example ``aten::copy_ < aten::clone <
    autograd::engine::evaluate_function: ViewBackward0``) with their ms per step, largest first. ``gaps``, if
    given (GPU only), receives where the device waited: ``(ms per step, count, chain)`` for the operator chains
    whose kernels started after the device had been idle for more than 20 us, summed over those waits, largest
    first. ``syncs``, if given (GPU only), receives the places that made the host wait for the device during one
    more step (``torch.cuda.set_sync_debug_mode``): ``(count, "file:line")``, most frequent first. ``matmuls``, if
    given (GPU only), receives the matmul time by launching operator chain, ``(ms per step, chain)``, largest
    first. ``trace``, if given, is a path the profiled steps are written to as a Chrome trace (gzipped when it ends
    in ``.gz``)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    if trace:
        prof.export_chrome_trace(trace)
    if cuda and syncs is not None:
        syncs.extend(_host_syncs(step, device))
    per_name: dict[str, float] = {}
    callers: dict[str, dict[str, float]] = {}
    if cuda:
        events = prof.events()
        for evt in events:
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                # the kernels themselves; not the ranges that record_function (the optimizer's step, compiled
                # regions) mirrors on the device timeline, whose time is their kernels' again
                if not getattr(evt, "is_user_annotation", False):
                    per_name[evt.name] = per_name.get(evt.name, 0.0) + evt.time_range.elapsed_us()
                continue
            launches = getattr(
                evt, "kernels", ()
            )  # an operator's kernels, filed under its chain of operators
            if launches:
                chain = _chain(evt)
                for kernel in launches:
                    by_chain = callers.setdefault(kernel.name, {})
                    by_chain[chain] = by_chain.get(chain, 0.0) + kernel.duration / 1e3 / steps
        if gaps is not None:
            gaps.extend(_idle_gaps(prof, events, steps))
    else:  # the operators' self time (top-level ones only would miss nested work; self time counts it once)
        for evt in prof.key_averages():
            per_name[evt.key] = float(evt.self_cpu_time_total)
    out = dict.fromkeys(BUCKETS, 0.0)
    rest = []
    for name, us in per_name.items():
        label = bucket(name)
        out[label] += us / 1e3 / steps
        if us > 0 and label not in ("matmul", "attention"):
            ranked = sorted(callers.get(name, {}).items(), key=lambda kv: -kv[1])[:3]
            rest.append((us / 1e3 / steps, label, name, ranked))
    if top is not None:
        top.extend(sorted(rest, reverse=True)[:10])
    if matmuls is not None:
        by_chain: dict[str, float] = {}
        for name, chains in callers.items():
            if bucket(name) == "matmul":
                for chain, ms in chains.items():
                    by_chain[chain] = by_chain.get(chain, 0.0) + ms
        matmuls.extend(sorted(((ms, chain) for chain, ms in by_chain.items()), reverse=True)[:12])
    busy = sum(v for k, v in out.items() if k != "communication")
    out["idle"] = max(0.0, wall_ms - busy)
    out["step"] = wall_ms
    return out


def _idle_gaps(prof, events, steps: int, min_us: float = 20.0) -> list[tuple[float, int, str]]:
    # the raw kineto events: a kernel's launching operator is the CPU event whose correlation id it links to
    raw = prof.profiler.kineto_results.events()
    cpu = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    kernels = sorted(
        (
            (e.start_ns() / 1e3, e.end_ns() / 1e3, e.name(), e.linked_correlation_id())
            for e in raw
            if e.device_type() == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", lambda: False)()
        ),
        key=lambda k: k[0],
    )
    waits: dict[str, list] = {}
    busy_until = None
    for start, end, name, corr in kernels:
        if busy_until is not None and start - busy_until > min_us:
            launcher = cpu.get(corr)
            chain = f"{name[:40]} < {_chain(launcher, depth=3) if launcher is not None else '?'}"
            entry = waits.setdefault(chain, [0.0, 0])
            entry[0] += (start - busy_until) / 1e3 / steps
            entry[1] += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    return sorted(((ms, n, chain) for chain, (ms, n) in waits.items()), reverse=True)[:8]


def _host_syncs(step: Callable[[], None], device: torch.device) -> list[tuple[int, str]]:
    import warnings

    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    places: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{w.filename}:{w.lineno}"
            places[where] = places.get(where, 0) + 1
    return sorted(((n, where) for where, n in places.items()), reverse=True)


def _chain(evt, depth: int = 4) -> str:
    names = []
    while evt is not None and len(names) < depth:
        if not evt.name.startswith("cuda"):  # the runtime's launch calls
            names.append(evt.name)
        evt = evt.cpu_parent
    return " < ".join(names)


def table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table, one column per row of ``rows`` (its label), milliseconds and shares of the step."""
    labels = list(rows)
    lines = ["| ms per step | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for key in (*BUCKETS, "idle", "step"):
        cells = []
        for label in labels:
            ms, step = rows[label][key], rows[label]["step"]
            cells.append(f"{ms:.1f}" if key == "step" else f"{ms:.1f} ({100 * ms / step:.0f}%)")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
