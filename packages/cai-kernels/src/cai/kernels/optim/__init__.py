"""Adam optimizers: CPUAdam (native multi-threaded CPU kernel), HybridAdam (CPU and GPU parameters in one
optimizer), FusedAdam (torch's fused kernels), and `adam_update`, the low-level step for flat fp32 master shards
that can write the updated parameter as bf16/fp16 into a buffer in the same pass; the fp16 dynamic loss scaler.

>>> from cai.kernels.optim import CPUAdam, FusedAdam, HybridAdam
"""

from cai.kernels.optim._functional import adam_update
from cai.kernels.optim._loader import cpu_adam_status
from cai.kernels.optim._loss_scale import DynamicLossScaler, LossScaleConfig
from cai.kernels.optim._optimizers import CPUAdam, FusedAdam, HybridAdam

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "FusedAdam",
    "HybridAdam",
    "LossScaleConfig",
    "adam_update",
    "cpu_adam_status",
]
