"""Plugins: one parallel strategy each, composed from the cai packages' functions and typed configs."""

from cai.booster.plugin._auto import AutoPlugin
from cai.booster.plugin._base import BoostContext, Capabilities, DPPluginBase, Plugin
from cai.booster.plugin._gemini import GeminiPlugin
from cai.booster.plugin._hybrid import HybridParallelConfig, HybridParallelPlugin, PipelineConfig
from cai.booster.plugin._low_level_zero import LowLevelZeroConfig, LowLevelZeroPlugin
from cai.booster.plugin._moe_hybrid import MoeHybridParallelConfig, MoeHybridParallelPlugin
from cai.booster.plugin._torch_ddp import DDPConfig, TorchDDPPlugin
from cai.booster.plugin._torch_fsdp import FSDPConfig, TorchFSDPPlugin

PLUGINS: tuple[type[Plugin], ...] = (
    TorchDDPPlugin,
    TorchFSDPPlugin,
    LowLevelZeroPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    MoeHybridParallelPlugin,
)

__all__ = [
    "PLUGINS",
    "AutoPlugin",
    "BoostContext",
    "Capabilities",
    "DDPConfig",
    "DPPluginBase",
    "FSDPConfig",
    "GeminiPlugin",
    "HybridParallelConfig",
    "HybridParallelPlugin",
    "LowLevelZeroConfig",
    "LowLevelZeroPlugin",
    "MoeHybridParallelConfig",
    "MoeHybridParallelPlugin",
    "PipelineConfig",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]
