"""cai-infer: inference engine with a paged KV cache, continuous batching and sampling for Hugging Face causal LMs."""

from importlib.metadata import version as _version

from ._async import AsyncInferenceEngine
from ._attention import ATTENTION_NAME, PagedKVCache
from ._blocks import BlockManager
from ._config import InferenceConfig
from ._engine import InferenceEngine, RequestOutput
from ._lockstep import LockstepDriver
from ._sampling import SamplingParams

__version__ = _version("cai-infer")

__all__ = [
    "ATTENTION_NAME",
    "AsyncInferenceEngine",
    "BlockManager",
    "InferenceConfig",
    "InferenceEngine",
    "LockstepDriver",
    "PagedKVCache",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
