"""Per-architecture policies (Colossal-AI's module names: `cai.shardformer.policies.llama`, ...)."""

from cai.shardformer.policies.auto_policy import get_autopolicy

__all__ = ["get_autopolicy"]
