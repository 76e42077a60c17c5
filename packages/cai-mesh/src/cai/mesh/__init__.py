"""cai-mesh: parallel axes, device mesh, launch, coordination, logging, accelerator, ShardSpec."""

from importlib.metadata import version as _version

from cai.mesh._shard_spec import LocalShard, ShardSpec, assemble

__version__ = _version("cai-mesh")

__all__ = ["LocalShard", "ShardSpec", "__version__", "assemble"]
