"""cai-kernels: Triton kernels for training (norms, rotary, SwiGLU, fused linear cross-entropy, mixture-of-experts
grouped GEMM) and serving (paged attention, the K/V cache write, the single-row matmul), FP8 linear layers and Adam
optimizers (CPUAdam, FusedAdam, HybridAdam), each with a pure-torch fallback.

Every kernel function picks the Triton kernel for CUDA tensors and a pure-torch implementation otherwise;
`CAI_KERNELS_FALLBACK=1` forces the torch path and `CAI_KERNELS_IMPL=triton|torch|auto` chooses explicitly
(`triton` on CPU tensors needs `TRITON_INTERPRET=1`). :func:`kernel_report` says which is in use and why.
"""

from importlib.metadata import version as _version

from cai.kernels._dispatch import kernel_report, use_triton
from cai.kernels._forward import trim_training_forward
from cai.kernels._fp8 import (
    Fp8Linear,
    convert_to_fp8,
    fp8_linear,
    fp8_matmul,
    fp8_tensor_cores,
    fp8_weights_ready,
    quantize_rowwise,
)
from cai.kernels._fused_ce import fused_linear_cross_entropy
from cai.kernels._gemv import gemv
from cai.kernels._hf import FusedLMHead, defer_lm_head_loss, is_swiglu_mlp, patch_hf_model
from cai.kernels._moe import grouped_linear, permute_tokens, unpermute_tokens
from cai.kernels._norm import LayerNorm, RMSNorm, layer_norm, rms_norm
from cai.kernels._paged_attention import paged_attention, paged_kv_write, paged_rope_kv_write
from cai.kernels._residual import is_pre_norm_layer
from cai.kernels._rope import apply_rotary_pos_emb
from cai.kernels._swiglu import SwiGLUMLP, swiglu, swiglu_packed

__version__ = _version("cai-kernels")

__all__ = [
    "Fp8Linear",
    "FusedLMHead",
    "LayerNorm",
    "RMSNorm",
    "SwiGLUMLP",
    "__version__",
    "apply_rotary_pos_emb",
    "convert_to_fp8",
    "defer_lm_head_loss",
    "fp8_linear",
    "fp8_matmul",
    "fp8_tensor_cores",
    "fp8_weights_ready",
    "fused_linear_cross_entropy",
    "gemv",
    "grouped_linear",
    "is_pre_norm_layer",
    "is_swiglu_mlp",
    "kernel_report",
    "layer_norm",
    "paged_attention",
    "paged_kv_write",
    "paged_rope_kv_write",
    "patch_hf_model",
    "permute_tokens",
    "quantize_rowwise",
    "rms_norm",
    "swiglu",
    "swiglu_packed",
    "trim_training_forward",
    "unpermute_tokens",
    "use_triton",
]
