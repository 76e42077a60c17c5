"""cai-shardformer: Tensor and sequence parallel layers and per-architecture policies for Hugging Face models."""

from importlib.metadata import version as _version

__version__ = _version("cai-shardformer")

__all__ = ["__version__"]
