"""cai-booster: the Booster facade and plugins (TorchDDP, TorchFSDP, LowLevelZero, Gemini), mixed precision,
lazy initialisation, resumable distributed data loading, LoRA, activation checkpointing, compiled blocks, and the
planner (``plan``, ``largest_model``, ``cai plan``, ``Booster(plugin="auto")``)."""

from importlib.metadata import version as _version

from cai.booster._booster import Booster
from cai.booster._checkpointing import activation_checkpointing
from cai.booster._compile import compile_blocks
from cai.booster._dataloader import ResumableDataLoader, StatefulDistributedSampler, prepare_dataloader
from cai.booster._lazy import LazyInitContext, set_pretrained_path
from cai.booster._plan import Hardware, ModelSpec, Plan, calibrate, largest_model, plan
from cai.booster._precision import (
    DynamicLossScaler,
    LossScalerConfig,
    MixedPrecision,
    mixed_precision_factory,
)
from cai.booster._wrappers import ModelWrapper, OptimizerWrapper

__version__ = _version("cai-booster")

__all__ = [
    "Booster",
    "DynamicLossScaler",
    "Hardware",
    "LazyInitContext",
    "LossScalerConfig",
    "MixedPrecision",
    "ModelSpec",
    "ModelWrapper",
    "OptimizerWrapper",
    "Plan",
    "ResumableDataLoader",
    "StatefulDistributedSampler",
    "__version__",
    "activation_checkpointing",
    "calibrate",
    "compile_blocks",
    "largest_model",
    "mixed_precision_factory",
    "plan",
    "prepare_dataloader",
    "set_pretrained_path",
]
