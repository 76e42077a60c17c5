"""Multi-process test helpers: a pooled gloo harness, a collective counter, a reference model, comparisons.

See the ``run_distributed`` docstring for the harness and [Note: bytes of a collective] in ``_counter`` for what
the counter measures.
"""

from cai.mesh.testing._compare import assert_close
from cai.mesh.testing._counter import CollectiveCounter, CollectiveEvent
from cai.mesh.testing._models import TinyTransformer, make_batch
from cai.mesh.testing._pool import (
    DistributedTestError,
    DistributedTestTimeout,
    one_thread,
    run_distributed,
    shutdown_pools,
)

__all__ = [
    "CollectiveCounter",
    "CollectiveEvent",
    "DistributedTestError",
    "DistributedTestTimeout",
    "TinyTransformer",
    "assert_close",
    "make_batch",
    "one_thread",
    "run_distributed",
    "shutdown_pools",
]
