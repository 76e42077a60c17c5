"""cai-shardformer: tensor-parallel layers, autograd collectives and per-architecture policies for Hugging Face models."""

from importlib.metadata import version as _version

from cai.shardformer._config import SUPPORT_SP_MODE, ShardConfig
from cai.shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from cai.shardformer._dropout import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    RNGStatesTracker,
    get_rng_tracker,
)
from cai.shardformer._embedding import (
    Embedding1D,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    vocab_parallel_cross_entropy,
)
from cai.shardformer._linear import FusedLinear1D_Col, Linear1D_Col, Linear1D_Row, ParallelModule, enable_fp8
from cai.shardformer._moe import ExpertParallelExperts
from cai.shardformer._ops import (
    copy_to_tp_region,
    gather_from_tp_region,
    gather_seq,
    reduce_from_tp_region,
    reduce_grad,
    reduce_scatter_seq,
    scatter_to_tp_region,
)
from cai.shardformer._plan import tp_plan
from cai.shardformer._policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription
from cai.shardformer._ring_attn import ring_attention, zigzag_indices
from cai.shardformer._shardformer import ShardFormer, shard_model
from cai.shardformer._state import (
    load_sharded_state_dict,
    sharded_state_dict,
    tp_model_state,
    tp_optimizer_state,
)
from cai.shardformer._ulysses import ulysses_attention
from cai.shardformer.policies.moe import ExpertParallelPolicy

__version__ = _version("cai-shardformer")

__all__ = [
    "SUPPORT_SP_MODE",
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "Embedding1D",
    "ExpertParallelExperts",
    "ExpertParallelPolicy",
    "FusedLinear1D_Col",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "ModulePolicyDescription",
    "ParallelModule",
    "Policy",
    "RNGStatesTracker",
    "ShardConfig",
    "ShardFormer",
    "SubModuleReplacementDescription",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "__version__",
    "copy_to_tp_region",
    "enable_fp8",
    "gather_from_tp_region",
    "gather_seq",
    "get_rng_tracker",
    "load_sharded_state_dict",
    "reduce_from_tp_region",
    "reduce_grad",
    "reduce_scatter_seq",
    "ring_attention",
    "scatter_to_tp_region",
    "shard_model",
    "sharded_state_dict",
    "tp_model_state",
    "tp_optimizer_state",
    "tp_plan",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
    "zigzag_indices",
]
