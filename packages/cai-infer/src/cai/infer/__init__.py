"""cai-infer: Inference engine: paged KV cache, continuous batching, sampling, speculative decoding, serving."""

from importlib.metadata import version as _version

__version__ = _version("cai-infer")

__all__ = ["__version__"]
