"""cai-gemini: Chunked ZeRO-3 with heterogeneous (GPU/CPU) memory, prefetch and a memory planner."""

from importlib.metadata import version as _version

__version__ = _version("cai-gemini")

__all__ = ["__version__"]
