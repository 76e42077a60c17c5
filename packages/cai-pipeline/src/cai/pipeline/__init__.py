"""cai-pipeline: Pipeline parallelism: stage manager, partitioning, P2P and 1F1B / interleaved / zero-bubble schedules."""

from importlib.metadata import version as _version

from cai.pipeline._p2p import PipelineP2P
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
    "OneForwardOneBackwardSchedule",
    "PipelineP2P",
    "PipelineSchedule",
    "Stage",
    "StageOutput",
    "Timeline",
    "ZeroBubbleVPipeScheduler",
    "__version__",
    "build_schedule",
    "split_batch",
]
