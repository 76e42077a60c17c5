"""cai-zero: ZeRO-1/2: sharded fp32 master weights, optimizer state and gradients with bucketed, overlapped communication."""

from importlib.metadata import version as _version

__version__ = _version("cai-zero")

__all__ = ["__version__"]
