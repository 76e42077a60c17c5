"""cai-pipeline: pipeline parallelism for Hugging Face models: the stage manager, cutting a model into stages
(by layer count or by cost, interleaved and V chunks), tied embeddings across stages, and per-stage checkpoints;
P2P with a metadata cache and the GPipe / 1F1B / interleaved / zero-bubble V schedules, with a timeline.

The contract between stages and schedules is in ``cai.pipeline._stage`` ([Note: stage contract]).
"""

from importlib.metadata import version as _version

from cai.pipeline._clip import clip_grad_norm_
from cai.pipeline._layout import PipelineLayout, layout_from_pp_plan
from cai.pipeline._manager import PipelineStageManager, distribute_layers
from cai.pipeline._model import PipelineModel, build_stages
from cai.pipeline._p2p import PipelineP2P
from cai.pipeline._partition import balance_layers, partition_by_cost
from cai.pipeline._plan import Action
from cai.pipeline._schedules import (
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    ZeroBubbleVPipeScheduler,
    build_schedule,
    split_batch,
)
from cai.pipeline._split import LocalState, PipelineStage, split_model
from cai.pipeline._stage import Batch, Criterion, Hidden, Stage, StageOutput
from cai.pipeline._timeline import Event, Timeline

__version__ = _version("cai-pipeline")

__all__ = [
    "Action",
    "Batch",
    "Criterion",
    "Event",
    "GPipeSchedule",
    "Hidden",
    "InterleavedSchedule",
    "LocalState",
    "OneForwardOneBackwardSchedule",
    "PipelineLayout",
    "PipelineModel",
    "PipelineP2P",
    "PipelineSchedule",
    "PipelineStage",
    "PipelineStageManager",
    "Stage",
    "StageOutput",
    "Timeline",
    "ZeroBubbleVPipeScheduler",
    "__version__",
    "balance_layers",
    "build_schedule",
    "build_stages",
    "clip_grad_norm_",
    "distribute_layers",
    "layout_from_pp_plan",
    "partition_by_cost",
    "split_batch",
    "split_model",
]
