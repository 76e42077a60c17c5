"""Build a cai Booster plugin from a short name, the way the examples' ``--plugin`` flag spells it."""

from __future__ import annotations

from dataclasses import dataclass

PLUGINS = ("ddp", "fsdp", "zero1", "zero2", "gemini")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True, frozen=True)
class PluginChoice:
    """What ``--plugin`` and its companion flags ask for.

    ``offload_optim_frac`` / ``offload_param_frac`` / ``shard_param_frac`` are Gemini's (Colossal-AI's meaning);
    ``cpu_offload`` is LowLevelZero's and FSDP's all-or-nothing optimizer offload.
    """

    name: str
    precision: str = "fp32"
    max_norm: float = 0.0
    cpu_offload: bool = False
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in PLUGINS:
            raise ValueError(f"--plugin {self.name!r} is not one of {', '.join(PLUGINS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for field in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            value = getattr(self, field)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{field.replace('_', '-')} {value} must be in [0, 1]")
        offloads = self.offload_optim_frac > 0 or self.offload_param_frac > 0 or self.shard_param_frac < 1
        if offloads and self.name != "gemini":
            raise ValueError(
                f"--shard-param-frac/--offload-*-frac are GeminiPlugin's; got --plugin {self.name}. "
                "Use --plugin gemini, or --cpu-offload for zero1/zero2/fsdp"
            )
        if self.cpu_offload and self.name not in ("zero1", "zero2", "fsdp"):
            raise ValueError(f"--cpu-offload applies to zero1, zero2 and fsdp, not --plugin {self.name}")

    @property
    def label(self) -> str:
        return {
            "ddp": "TorchDDP",
            "fsdp": "TorchFSDP",
            "zero1": "LowLevelZero-1",
            "zero2": "LowLevelZero-2",
        }.get(self.name, "Gemini")


def make_booster(choice: PluginChoice):
    """A ``cai.booster.Booster`` with the plugin ``choice`` names, configured for its precision."""
    from cai.booster import Booster
    from cai.booster import plugin as plugins

    if choice.name == "ddp":
        # TorchDDP does not own precision: the Booster's mixed precision casts for it.
        mixed = None if choice.precision == "fp32" else choice.precision
        return Booster(plugin=plugins.TorchDDPPlugin(), mixed_precision=mixed)
    if choice.name == "fsdp":
        return Booster(
            plugin=plugins.TorchFSDPPlugin(precision=choice.precision, cpu_offload=choice.cpu_offload)
        )
    if choice.name in ("zero1", "zero2"):
        plugin = plugins.LowLevelZeroPlugin(
            stage=int(choice.name[-1]),
            precision=choice.precision,
            max_norm=choice.max_norm,
            cpu_offload=choice.cpu_offload,
        )
        return Booster(plugin=plugin)
    plugin = plugins.GeminiPlugin(
        precision=choice.precision,
        max_norm=choice.max_norm,
        shard_param_frac=choice.shard_param_frac,
        offload_optim_frac=choice.offload_optim_frac,
        offload_param_frac=choice.offload_param_frac,
        # host optimizer chunks update during backward whenever nothing needs the whole gradient first
        overlap_host_step=choice.offload_optim_frac > 0
        and choice.max_norm == 0
        and choice.precision != "fp16",
    )
    return Booster(plugin=plugin)
