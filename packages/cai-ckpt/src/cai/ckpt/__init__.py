"""cai-ckpt: Layout-independent, crash-safe, parallel checkpoints in Hugging Face safetensors layout."""

from importlib.metadata import version as _version

__version__ = _version("cai-ckpt")

__all__ = ["__version__"]
