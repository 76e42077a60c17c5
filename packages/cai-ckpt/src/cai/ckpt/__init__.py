"""cai-ckpt: layout-independent, crash-safe, parallel checkpoints in Hugging Face safetensors layout.

``save_model``/``load_model`` and ``save_optimizer``/``load_optimizer`` work on plain modules and optimizers
and on any object implementing the state protocol (``sharded_state_dict()``/``load_sharded_state_dict(read)``);
``save_state``/``load_state`` add the scheduler, grad scaler, RNG and data position for an exact resume.
"""

from importlib.metadata import version as _version

from cai.ckpt._api import load_model, load_optimizer, save_model, save_optimizer
from cai.ckpt._format import CheckpointError
from cai.ckpt._load import CheckpointReader
from cai.ckpt._state import Stateful, latest_checkpoint, load_state, save_state
from cai.ckpt._txn import wait

__version__ = _version("cai-ckpt")

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Stateful",
    "__version__",
    "latest_checkpoint",
    "load_model",
    "load_optimizer",
    "load_state",
    "save_model",
    "save_optimizer",
    "save_state",
    "wait",
]
