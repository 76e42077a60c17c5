"""``plan()``: every configuration the model can train with on the given machine and budgets, priced in memory and
time, the fastest one that fits first."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torch import nn

from cai.booster._plan._candidate import Candidate
from cai.booster._plan._estimate import Estimate, estimate_candidate
from cai.booster._plan._hardware import Hardware
from cai.booster._plan._spec import ModelSpec

__all__ = ["Plan", "PlanRow", "largest_model", "plan"]

GiB = 1024**3
RECOMPUTE = ("none", "selective", "full")
PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini", "hybrid")
# A configuration that offloads to the host must be predicted this much faster to rank above one that does not: the
# model does not price the host threads' interference with the training process, and the host's bandwidth varied by
# about 5% between runs on the same machine (examples/benchmarks/RESULTS.md).
OFFLOAD_MARGIN = 0.02
GEMINI_OPTIM_FRACS = tuple(i / 10 for i in range(11))  # the share of the optimizer on the host


@dataclass(frozen=True)
class PlanRow:
    """One configuration with its predictions: per-rank peaks, step time, tokens/s per GPU and whether it fits."""

    candidate: Candidate
    plugin: str  # the plugin as code
    gpu_bytes: int
    host_bytes: int
    step_s: float
    tokens_per_s: float  # per GPU
    mfu: float | None
    fits: bool
    estimate: Estimate = field(repr=False)

    @property
    def score(self) -> float:
        """What rows are ranked by: tokens/s, less ``OFFLOAD_MARGIN`` for a row that offloads to the host."""
        return self.tokens_per_s * (1 - OFFLOAD_MARGIN if self.candidate.host_params_frac else 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label,
            "candidate": asdict(self.candidate),
            "plugin": self.plugin,
            "gpu_gib": round(self.gpu_bytes / GiB, 3),
            "host_gib": round(self.host_bytes / GiB, 3),
            "step_s": round(self.step_s, 5),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "mfu": None if self.mfu is None else round(self.mfu, 4),
            "fits": self.fits,
            "gpu_parts_gib": {k: round(v / GiB, 3) for k, v in self.estimate.gpu_parts.items()},
            "host_parts_gib": {k: round(v / GiB, 3) for k, v in self.estimate.host_parts.items()},
            "time_parts_s": {k: round(v, 5) for k, v in self.estimate.time_parts.items()},
        }


@dataclass(frozen=True)
class Plan:
    """Every priced configuration, feasible ones first, fastest first (``PlanRow.score``: host offload must win by
    ``OFFLOAD_MARGIN``). ``best`` is the first (None if nothing fits);
    ``str(plan)`` is a table of the leading rows."""

    model: ModelSpec
    hardware: Hardware
    rows: list[PlanRow]
    gpus: int
    seq_len: int
    global_batch: int
    precision: str
    gpu_budget_bytes: int
    host_budget_bytes: int

    @property
    def best(self) -> PlanRow | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None

    @property
    def feasible(self) -> list[PlanRow]:
        return [r for r in self.rows if r.fits]

    def find(self, **fields: Any) -> PlanRow:
        """The row whose candidate has these field values (``plan.find(plugin="zero2", recompute="full",
        micro_batch=4)``); the first of several."""
        for r in self.rows:
            if all(getattr(r.candidate, k) == v for k, v in fields.items()):
                return r
        raise KeyError(f"no planned configuration has {fields}")

    def table(self, limit: int | None = 15) -> str:
        mfu = self.hardware.peak_tflops is not None
        head = ["", "configuration", "activations", "micro-batch x accum", "GPU GiB", "host GiB", "tok/s/GPU"]
        head += ["MFU"] if mfu else []
        head += ["fits"]
        feasible = self.feasible
        shown = feasible[:limit] if limit else feasible
        if not feasible:  # show what came closest
            shown = sorted(self.rows, key=lambda r: r.gpu_bytes)[: limit or None]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in shown:
            c = r.candidate
            cells = ["*" if r is self.best else "", c.plugin_label, c.activations, f"{c.micro_batch} x {c.accumulation}",
                     f"{r.gpu_bytes / GiB:.1f}", f"{r.host_bytes / GiB:.1f}", f"{r.tokens_per_s:,.0f}"]  # fmt: skip
            cells += [f"{100 * r.mfu:.1f}%"] if mfu else []
            cells += ["yes" if r.fits else "no"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: what is best and why, or what would fit."""
        n = len(self.feasible)
        if self.best is None:
            closest = min(self.rows, key=lambda r: r.gpu_bytes)
            return (
                f"nothing fits {self.gpu_budget_bytes / GiB:.1f} GiB of GPU and {self.host_budget_bytes / GiB:.1f} "
                f"GiB of host memory: the smallest configuration ({closest.candidate.label}) needs "
                f"{closest.gpu_bytes / GiB:.1f} GiB of GPU and {closest.host_bytes / GiB:.1f} GiB of host memory; "
                "use more GPUs, a shorter sequence or a smaller global batch"
            )
        b = self.best
        runner = next(
            (r for r in self.feasible[1:] if r.candidate.plugin_label != b.candidate.plugin_label), None
        )
        why = f"fastest of {n} that fit"
        if runner is not None:
            why += f" ({b.tokens_per_s / runner.tokens_per_s:.2f}x the next plugin, {runner.candidate.label})"
        return (
            f"{b.plugin}, activations {b.candidate.activations}, micro-batch {b.candidate.micro_batch} x "
            f"{b.candidate.accumulation} accumulation: predicted {b.tokens_per_s:,.0f} tok/s/GPU at "
            f"{b.gpu_bytes / GiB:.1f} GiB GPU and {b.host_bytes / GiB:.1f} GiB host; {why}"
        )

    def __str__(self) -> str:
        return self.render()

    def render(self, limit: int | None = 15) -> str:
        """The inputs, the table of the leading ``limit`` feasible rows (None: all), and the summary line."""
        s = self.model.shape
        head = (
            f"{self.model.name}: {self.model.params / 1e9:.2f}B parameters (h{s.hidden} L{s.layers} vocab {s.vocab}), "
            f"{self.gpus} GPU(s), sequence {self.seq_len}, global batch {self.global_batch}, {self.precision}; "
            f"budgets {self.gpu_budget_bytes / GiB:.1f} GiB GPU, {self.host_budget_bytes / GiB:.1f} GiB host; "
            f"rates: {self.hardware.source}"
        )
        return f"{head}\n\n{self.table(limit)}\n\n{self.summary()}"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model.name,
                "params": self.model.params,
                "shape": asdict(self.model.shape),
            },
            "gpus": self.gpus,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "precision": self.precision,
            "gpu_budget_gib": self.gpu_budget_bytes / GiB,
            "host_budget_gib": self.host_budget_bytes / GiB,
            "hardware": self.hardware.to_json(),
            "best": self.best.to_json() if self.best else None,
            "rows": [r.to_json() for r in self.rows],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def plot(self, path: str) -> None:
        """Tokens/s against GPU memory of every configuration, feasible ones filled, the best marked
        (needs matplotlib: ``pip install 'cai-booster[plot]'``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("Plan.plot needs matplotlib: pip install 'cai-booster[plot]'") from None
        fig, ax = plt.subplots(figsize=(8, 5))
        for fits, style in (
            (False, dict(facecolors="none", edgecolors="grey")),
            (True, dict(color="tab:blue")),
        ):
            rows = [r for r in self.rows if r.fits == fits]
            ax.scatter([r.gpu_bytes / GiB for r in rows], [r.tokens_per_s for r in rows], s=14,
                       label="fits" if fits else "does not fit", **style)  # fmt: skip
        if self.best:
            ax.scatter([self.best.gpu_bytes / GiB], [self.best.tokens_per_s], marker="*", s=200, color="tab:red",
                       label=f"best: {self.best.candidate.label}")  # fmt: skip
        ax.axvline(self.gpu_budget_bytes / GiB, color="tab:red", linestyle="--", linewidth=1)
        ax.set_xlabel("predicted GPU peak (GiB)")
        ax.set_ylabel("predicted tokens/s per GPU")
        ax.set_title(
            f"{self.model.name}, {self.gpus} GPU(s), seq {self.seq_len}, global batch {self.global_batch}"
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _powers_of_two_dividing(n: int) -> list[int]:
    return [m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256) if m <= n and n % m == 0]


def candidates(
    spec: ModelSpec, *, gpus: int, global_batch: int, device: str = "cuda", plugins: tuple[str, ...] | None = None,
    recompute: tuple[str, ...] = RECOMPUTE, micro_batches: tuple[int, ...] | None = None, host_offload: bool = True,
    offload_activations: tuple[float, ...] = (0.0,),
) -> list[tuple[Candidate, int]]:  # fmt: skip
    """Every configuration to price, each with its data-parallel size."""
    layouts: list[tuple[dict, int]] = []  # (fields, dp)
    if global_batch % gpus == 0:
        layouts += [({"plugin": "ddp"}, gpus), ({"plugin": "fsdp"}, gpus), ({"plugin": "zero2"}, gpus)]
        if gpus > 1:
            layouts.append(({"plugin": "zero1"}, gpus))
        layouts += [({"plugin": "gemini", "offload_optim_frac": f}, gpus) for f in GEMINI_OPTIM_FRACS]
        if device == "cuda" and host_offload:  # host offload only means something beside a GPU
            layouts.append(({"plugin": "zero2", "offload": True}, gpus))
            layouts += [
                ({"plugin": "gemini", "offload_optim_frac": f, "offload_param_frac": 1.0}, gpus)
                for f in (0.9, 1.0)
            ]
        else:
            layouts = [(f, dp) for f, dp in layouts if not f.get("offload_optim_frac")]
    s = spec.shape
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if tp * pp == 1 or gpus % (tp * pp) or s.heads % tp or s.kv_heads % tp or s.layers < pp:
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp == 0:
                layouts.append(({"plugin": "hybrid", "tp": tp, "pp": pp}, dp))
    out = []
    for fields, dp in layouts:
        if plugins and fields["plugin"] not in plugins:
            continue
        per_rank = global_batch // dp
        for mb in micro_batches or _powers_of_two_dividing(per_rank):
            if per_rank % mb:
                continue
            acc = per_rank // mb
            if fields.get("pp", 1) > 1 and acc < fields["pp"]:
                continue  # 1F1B needs at least as many micro-batches as stages
            for r in recompute:
                for f in offload_activations:
                    # host offload only means something beside a GPU; with every layer on the host, the recompute
                    # policy would apply to none
                    if f and (device != "cuda" or (f == 1.0 and r != "none")):
                        continue
                    c = Candidate(
                        recompute=r, micro_batch=mb, accumulation=acc, offload_activations=f, **fields
                    )
                    out.append((c, dp))
    return out


def plan(
    model: str | nn.Module | ModelSpec,
    *,
    gpu_budget_bytes: int | None = None,
    host_budget_bytes: int | None = None,
    gpus: int = 1,
    seq_len: int = 2048,
    global_batch: int | None = None,
    precision: str = "bf16",
    kernels: bool = True,
    hardware: Hardware | None = None,
    device: str = "cuda",
    plugins: tuple[str, ...] | None = None,
    recompute: tuple[str, ...] = RECOMPUTE,
    micro_batches: tuple[int, ...] | None = None,
    host_offload: bool = True,
    offload_activations: tuple[float, ...] = (0.0,),
) -> Plan:
    """Price every configuration of training ``model`` on ``gpus`` GPUs: predicted per-GPU and host peaks and
    tokens/s, feasible configurations first, fastest first.

    Args:
        model: a preset (``1b``, ``3b``, ``8b``, ``13b``, ``70b``), a Hugging Face config path or hub name, a
            model (meta or lazy is enough), or a ``ModelSpec``.
        gpu_budget_bytes, host_budget_bytes: memory one GPU and the host may use (default: the machine's, from
            ``hardware``).
        gpus: GPUs of the job (all on one host for the host budget).
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step over all GPUs (default 8 per GPU).
        precision: working precision (``"bf16"``, ``"fp16"``, ``"fp32"``); masters and Adam stay fp32.
        kernels: cai-kernels' fused kernels and loss are applied (``cai.kernels.patch_hf_model``).
        hardware: the machine's rates (default: the stored calibration of this machine, else built-in H200
            figures; see ``cai.booster.calibrate``).
        device: ``"cuda"`` or ``"cpu"`` (no host offload rows, no CUDA workspace or context).
        plugins, recompute, micro_batches: restrict the search to these values.
        host_offload: consider optimizer and parameter offload to the host (an optimizer that steps there).
        offload_activations: fractions of the decoder layers whose activations may wait in host memory
            (``activation_checkpointing(offload=...)``), each combined with every recompute policy for the other
            layers. Only 0 by default: the PCIe overlap the estimate assumes is not calibrated yet.

    Example::

        p = plan("8b", gpu_budget_bytes=24 * 2**30, host_budget_bytes=120 * 2**30, global_batch=32)
        print(p)                 # the table, then the best configuration and why
        plugin = p.best.candidate.plugin_call("bf16").build()
    """
    unknown = sorted(set(plugins or ()) - set(PLUGINS)) + sorted(set(recompute) - set(RECOMPUTE))
    if unknown:
        raise ValueError(
            f"plan: {', '.join(map(repr, unknown))} unknown; plugins are {', '.join(PLUGINS)} and recompute "
            f"policies {', '.join(RECOMPUTE)}"
        )
    if not offload_activations or any(not 0.0 <= f <= 1.0 for f in offload_activations):
        raise ValueError(f"plan: offload_activations={offload_activations!r}; give fractions in [0, 1]")
    spec = ModelSpec.resolve(model)
    hw = hardware or Hardware.load() or Hardware.h200()
    global_batch = global_batch or 8 * gpus
    if global_batch < 1 or gpus < 1 or seq_len < 1:
        raise ValueError(f"plan: gpus={gpus}, seq_len={seq_len} and global_batch={global_batch} must be >= 1")
    gpu_budget = gpu_budget_bytes if gpu_budget_bytes is not None else hw.gpu_mem_bytes
    host_budget = host_budget_bytes if host_budget_bytes is not None else hw.host_mem_bytes
    rows = []
    for c, dp in candidates(spec, gpus=gpus, global_batch=global_batch, device=device, plugins=plugins,
                            recompute=recompute, micro_batches=micro_batches, host_offload=host_offload,
                            offload_activations=offload_activations):  # fmt: skip
        e = estimate_candidate(
            c, spec, hw, seq=seq_len, dp=dp, precision=precision, kernels=kernels, device=device
        )
        tokens = global_batch * seq_len / gpus / e.step_s
        mfu = None
        if hw.peak_tflops:
            s = spec.shape
            mfu = tokens * (6 * spec.params + 12 * s.layers * s.hidden * seq_len) / (hw.peak_tflops * 1e12)
        # the host holds every rank's offloaded state: the process once per GPU
        host_total = e.host_bytes * gpus
        fits = e.gpu_bytes <= gpu_budget and host_total <= host_budget
        rows.append(
            PlanRow(c, str(c.plugin_call(precision)), e.gpu_bytes, host_total, e.step_s, tokens, mfu, fits, e)
        )
    if not rows:
        raise ValueError(
            f"plan: no configuration divides global_batch={global_batch} over gpus={gpus}; use a global batch that "
            "is a multiple of the number of GPUs"
        )
    rows.sort(key=lambda r: (not r.fits, -r.score if r.fits else r.gpu_bytes))
    return Plan(spec, hw, rows, gpus, seq_len, global_batch, precision, gpu_budget, host_budget)


def largest_model(model: str | nn.Module | ModelSpec, *, log=None, **plan_kwargs: Any) -> Plan:
    """The plan of the deepest model of ``model``'s width that some configuration fits: ``model``'s hidden, MLP,
    head and vocabulary sizes as a Llama-style model, its decoder layers grown (or shrunk) to the most that
    ``plan(..., **plan_kwargs)`` still finds a feasible row for. ``plan.model`` is that model (``.params``,
    ``.shape.layers``). Raises ``ValueError`` when not even one layer fits.

    Example::

        p = largest_model("8b", gpu_budget_bytes=139 * 2**30, host_budget_bytes=128 * 2**30)
        print(p.model.params, p.best.candidate.label)
    """
    base = ModelSpec.resolve(model)
    plans: dict[int, Plan] = {}

    def fits(layers: int) -> bool:
        if layers not in plans:
            spec = ModelSpec.from_shape(
                replace(base.shape, layers=layers), name=f"{base.name} at {layers} layers", tied=base.tied
            )
            plans[layers] = plan(spec, **plan_kwargs)
            if log:
                p = plans[layers]
                log(
                    f"{layers} layers, {spec.params / 1e9:.2f}B parameters: {'fits' if p.best else 'does not fit'}"
                )
        return plans[layers].best is not None

    lo, hi = 0, base.shape.layers  # lo fits (0: none known), hi does not (once found)
    if fits(hi):
        lo, hi = hi, 2 * hi
        while fits(hi):
            lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise ValueError(
            f"largest_model: not one decoder layer of {base.name}'s width fits: {plans[1].summary()}"
        )
    return plans[lo]
