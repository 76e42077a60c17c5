"""cai-pipeline: pipeline parallelism for Hugging Face models: the stage manager, cutting a model into stages
(by layer count or by cost, interleaved and V chunks), tied embeddings across stages, and per-stage checkpoints.

The contract between stages and schedules is in ``cai.pipeline._stage`` ([Note: stage contract]).
"""

from importlib.metadata import version as _version

from cai.pipeline._layout import PipelineLayout, layout_from_pp_plan
from cai.pipeline._manager import PipelineStageManager, distribute_layers
from cai.pipeline._model import PipelineModel, build_stages
from cai.pipeline._partition import balance_layers, partition_by_cost
from cai.pipeline._split import PipelineStage, split_model
from cai.pipeline._stage import Batch, Criterion, Hidden, Stage, StageOutput

__version__ = _version("cai-pipeline")

__all__ = [
    "Batch",
    "Criterion",
    "Hidden",
    "PipelineLayout",
    "PipelineModel",
    "PipelineStage",
    "PipelineStageManager",
    "Stage",
    "StageOutput",
    "__version__",
    "balance_layers",
    "build_stages",
    "distribute_layers",
    "layout_from_pp_plan",
    "partition_by_cost",
    "split_model",
]
