"""cai-booster: Booster facade and plugins (TorchDDP, TorchFSDP, LowLevelZero, Gemini, ...); installs every cai package."""

from importlib.metadata import version as _version

__version__ = _version("cai-booster")

__all__ = ["__version__"]
