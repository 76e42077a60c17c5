"""cai-zero: ZeRO-1/2: sharded fp32 master weights, optimizer state and gradients with bucketed, overlapped communication."""

from importlib.metadata import version as _version

from cai.zero._compat import LowLevelZeroOptimizer
from cai.zero._config import LossScaleConfig, ZeroConfig
from cai.zero._optimizer import ZeroOptimizer

__version__ = _version("cai-zero")

__all__ = ["LossScaleConfig", "LowLevelZeroOptimizer", "ZeroConfig", "ZeroOptimizer", "__version__"]
