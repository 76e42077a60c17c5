"""cai-gemini: chunked ZeRO-3 with heterogeneous (GPU/CPU) memory, prefetch and a memory planner.

>>> from cai import gemini
>>> model, optimizer = gemini.shard(model, optimizer, config=gemini.GeminiConfig(offload_optim_frac=1.0))
"""

from importlib.metadata import version as _version

from cai.gemini._api import shard
from cai.gemini._config import ChunkConfig, GeminiConfig, LossScaleConfig
from cai.gemini._memory import CudaMemoryTracker, MemoryTracker
from cai.gemini._model import GeminiModel
from cai.gemini._optim import GeminiOptimizer
from cai.gemini._planner import (
    WORKSPACE_BYTES,
    ChunkLayout,
    MemoryPlan,
    PlanRow,
    TransformerShape,
    activation_bytes,
    estimate,
    host_peak,
    plan,
)
from cai.gemini._search import ChunkSearchResult, search_chunk_size

GeminiDDP = GeminiModel  # Colossal-AI's name

__version__ = _version("cai-gemini")

__all__ = [
    "WORKSPACE_BYTES",
    "ChunkConfig",
    "ChunkLayout",
    "ChunkSearchResult",
    "CudaMemoryTracker",
    "GeminiConfig",
    "GeminiDDP",
    "GeminiModel",
    "GeminiOptimizer",
    "LossScaleConfig",
    "MemoryPlan",
    "MemoryTracker",
    "PlanRow",
    "TransformerShape",
    "__version__",
    "activation_bytes",
    "estimate",
    "host_peak",
    "plan",
    "search_chunk_size",
    "shard",
]
