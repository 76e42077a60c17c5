"""cai-pipeline: Pipeline parallelism: stage manager, partitioning, P2P and 1F1B / interleaved / zero-bubble schedules."""

from importlib.metadata import version as _version

from cai.pipeline._stage import Batch, Criterion, Hidden, Stage, StageOutput

__version__ = _version("cai-pipeline")

__all__ = ["Batch", "Criterion", "Hidden", "Stage", "StageOutput", "__version__"]
