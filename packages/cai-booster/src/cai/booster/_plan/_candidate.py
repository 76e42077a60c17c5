"""One configuration the planner prices: a plugin with its offload settings, a recompute policy, and how a rank's
share of the global batch is cut into micro-batches; and the plugin it stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Call", "Candidate"]

PluginName = Literal["ddp", "fsdp", "zero1", "zero2", "gemini", "hybrid"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A configuration.

    Attributes:
        plugin: ``ddp`` (TorchDDPPlugin, bf16 autocast over fp32 weights), ``fsdp`` (TorchFSDPPlugin), ``zero1`` /
            ``zero2`` (LowLevelZeroPlugin), ``gemini`` (GeminiPlugin), ``hybrid`` (HybridParallelPlugin, ZeRO-1 over
            its data-parallel axis).
        recompute: activation checkpointing of every decoder layer (``cai.booster.activation_checkpointing``)
            that is not offloaded.
        offload_activations: the leading fraction of decoder layers whose activations wait in host memory
            (``activation_checkpointing(offload=...)``).
        micro_batch: sequences per rank per forward.
        accumulation: micro-batches per optimizer step (the earlier ones under ``booster.no_sync``).
        offload: zero1/zero2: fp32 masters and Adam on the host, each bucket's host step overlapped with backward.
        offload_optim_frac, offload_param_frac: gemini's static placement.
        tp, pp: hybrid's tensor-parallel size and pipeline stages (1F1B; micro-batches = ``accumulation``).
    """

    plugin: PluginName
    recompute: Recompute
    micro_batch: int
    accumulation: int = 1
    offload: bool = False
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    tp: int = 1
    pp: int = 1
    offload_activations: float = 0.0

    @property
    def activations(self) -> str:
        """The recompute policy, and the share of layers offloaded when there is one."""
        if not self.offload_activations:
            return self.recompute
        return f"{self.recompute} + {self.offload_activations:g} on host"

    @property
    def host_params_frac(self) -> float:
        """The share of the optimizer's work done on the host."""
        return 1.0 if self.offload else self.offload_optim_frac

    @property
    def plugin_label(self) -> str:
        if self.plugin == "gemini":
            parts = [f"optim {self.offload_optim_frac:g}"] if self.offload_optim_frac else []
            parts += [f"params {self.offload_param_frac:g}"] if self.offload_param_frac else []
            return "gemini" + (f" (host: {', '.join(parts)})" if parts else "")
        if self.plugin in ("zero1", "zero2") and self.offload:
            return f"{self.plugin} + host optim"
        if self.plugin == "hybrid":
            return f"hybrid tp{self.tp} pp{self.pp}"
        return self.plugin

    @property
    def label(self) -> str:
        return f"{self.plugin_label}, {self.activations}, mb {self.micro_batch} x {self.accumulation}"

    def plugin_call(self, precision: str) -> Call:
        """The plugin as a call: its class and keyword arguments (Colossal-AI's names where they exist)."""
        if self.plugin == "ddp":
            return Call("TorchDDPPlugin", {})  # precision: Booster(mixed_precision=...)
        if self.plugin == "fsdp":
            return Call("TorchFSDPPlugin", {"precision": precision})
        if self.plugin in ("zero1", "zero2"):
            stage = int(self.plugin[-1])
            if self.offload:  # the overlapped host step is cai-zero's own switch
                zero = Call("ZeroConfig", {"stage": stage, "cpu_offload": True, "overlap_cpu_step": True})
                config = Call("LowLevelZeroConfig", {"zero": zero, "precision": precision})
                return Call("LowLevelZeroPlugin", {"config": config})
            return Call("LowLevelZeroPlugin", {"stage": stage, "precision": precision})
        if self.plugin == "gemini":
            kw: dict = {"precision": precision}
            if self.offload_optim_frac:
                kw["offload_optim_frac"] = self.offload_optim_frac
            if self.offload_param_frac:
                kw.update(offload_param_frac=self.offload_param_frac, max_prefetch=2)
            return Call("GeminiPlugin", kw)
        kw = {"tp_size": self.tp, "pp_size": self.pp, "zero_stage": 1, "precision": precision}
        if self.pp > 1:
            kw["num_microbatches"] = self.accumulation
        return Call("HybridParallelPlugin", kw)


@dataclass(frozen=True)
class Call:
    """``name(**kwargs)``, where a value may itself be a ``Call``: printed as code, or built."""

    name: str
    kwargs: dict

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v if isinstance(v, Call) else repr(v)}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def build(self):
        from cai.booster import plugin as plugins
        from cai.zero import ZeroConfig

        classes = {"ZeroConfig": ZeroConfig, **{n: getattr(plugins, n) for n in plugins.__all__}}
        kwargs = {k: v.build() if isinstance(v, Call) else v for k, v in self.kwargs.items()}
        return classes[self.name](**kwargs)
