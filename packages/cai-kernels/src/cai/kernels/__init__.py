"""cai-kernels: Triton training kernels (norms, rotary, SwiGLU, fused linear cross-entropy) and Adam optimizers (CPUAdam, FusedAdam, HybridAdam), each with a pure-torch fallback."""

from importlib.metadata import version as _version

__version__ = _version("cai-kernels")

__all__ = ["__version__"]
