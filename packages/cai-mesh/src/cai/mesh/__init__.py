"""cai-mesh: parallel axes, device mesh, launch, coordination, logging, accelerator, ShardSpec.

The multi-process test helpers live in the submodule ``cai.mesh.testing`` (not re-exported here).
"""

from importlib.metadata import version as _version

from cai.mesh._accelerator import (
    BaseAccelerator,
    CpuAccelerator,
    CudaAccelerator,
    auto_set_accelerator,
    get_accelerator,
    get_current_device,
    set_accelerator,
)
from cai.mesh._collectives import (
    all_gather_into_tensor,
    fp8_all_gather_into_tensor,
    fp8_all_reduce,
    fp8_reduce_scatter_tensor,
    reduce_scatter_tensor,
)
from cai.mesh._coordinator import DistCoordinator
from cai.mesh._guard import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    advance_step,
    current_step,
    debug_checks_on,
)
from cai.mesh._hooks import register_grad_hooks_weakly
from cai.mesh._launch import (
    free_port,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    set_seed,
)
from cai.mesh._logging import DistributedLogger, disable_existing_loggers, get_dist_logger
from cai.mesh._parallel_dims import AXES, ParallelDims, ParallelMesh
from cai.mesh._shard_spec import FlatPiece, LocalShard, ShardSpec, assemble, flat_pieces
from cai.mesh._state import (
    Read,
    ShardedOptimizerState,
    ShardedState,
    load_param_groups_state,
    param_groups_state,
)

__version__ = _version("cai-mesh")

__all__ = [
    "AXES",
    "DEFAULT_TIMEOUT",
    "BaseAccelerator",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CpuAccelerator",
    "CudaAccelerator",
    "DistCoordinator",
    "DistributedLogger",
    "FlatPiece",
    "LocalShard",
    "ParallelDims",
    "ParallelMesh",
    "Read",
    "ShardSpec",
    "ShardedOptimizerState",
    "ShardedState",
    "__version__",
    "advance_step",
    "all_gather_into_tensor",
    "assemble",
    "auto_set_accelerator",
    "current_step",
    "debug_checks_on",
    "disable_existing_loggers",
    "flat_pieces",
    "fp8_all_gather_into_tensor",
    "fp8_all_reduce",
    "fp8_reduce_scatter_tensor",
    "free_port",
    "get_accelerator",
    "get_current_device",
    "get_dist_logger",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_param_groups_state",
    "param_groups_state",
    "reduce_scatter_tensor",
    "register_grad_hooks_weakly",
    "set_accelerator",
    "set_seed",
]
