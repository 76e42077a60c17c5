"""Adam optimizers: CPUAdam (native multi-threaded CPU kernel), HybridAdam (CPU and GPU parameters in one
optimizer), FusedAdam (torch's fused kernels), and `adam_update`, the low-level step for flat fp32 master shards
that can write the updated parameter as bf16/fp16 into a buffer in the same pass; the host Adam stepper of offloaded
optimizers (cai-zero, cai-gemini), their working-precision gradient shard and the fp16 dynamic loss scaler.

>>> from cai.kernels.optim import CPUAdam, FusedAdam, HybridAdam
"""

from cai.kernels.optim._functional import adam_update
from cai.kernels.optim._grad import accumulate_grad_shard
from cai.kernels.optim._host import HostStepper, adam_step, adamw_mode
from cai.kernels.optim._loader import cpu_adam_status
from cai.kernels.optim._loss_scale import DynamicLossScaler, LossScaleConfig
from cai.kernels.optim._optimizers import CPUAdam, FusedAdam, HybridAdam, adam_state

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "FusedAdam",
    "HostStepper",
    "HybridAdam",
    "LossScaleConfig",
    "accumulate_grad_shard",
    "adam_state",
    "adam_step",
    "adam_update",
    "adamw_mode",
    "cpu_adam_status",
]
