"""Choosing between the Triton kernels and the pure-torch fallbacks at run time.

[Note: implementation choice]
Every kernel entry point calls `use_triton(tensor)` once per call. The answer depends on:
- `CAI_KERNELS_IMPL` = `auto` (default) | `triton` | `torch`;
- `CAI_KERNELS_FALLBACK` (any non-empty value other than `0`) forces the torch path, whatever else is set;
- in `auto`, Triton is used for CUDA tensors when `triton` imports;
- `triton` forces the Triton kernels, also on CPU tensors, which only works under `TRITON_INTERPRET=1` (this is
  how the tests run the real kernels on a machine without a GPU);
- while `torch.compile` traces, always the torch path: Inductor fuses it with the ops around it, where tracing
  the Triton launcher and autotuner would break the graph and recompile.
Triton is imported lazily, so `import cai.kernels` never fails because Triton is missing.
"""

from __future__ import annotations

import functools
import os

import torch

IMPL_ENV = "CAI_KERNELS_IMPL"
FALLBACK_ENV = "CAI_KERNELS_FALLBACK"
_IMPLS = ("auto", "triton", "torch")

KERNEL_NAMES = (
    "rms_norm",
    "layer_norm",
    "rotary",
    "swiglu",
    "fused_linear_cross_entropy",
    "paged_attention",
    "gemv",
)


@functools.cache
def _triton_import() -> tuple[bool, str]:
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising something else
        return False, f"triton is not importable ({type(exc).__name__}: {exc}); install cai-kernels[triton]"
    return True, f"triton {triton.__version__}"


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _requested_impl() -> str:
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        return "torch"
    impl = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if impl not in _IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not one of {_IMPLS}; unset it for automatic choice")
    return impl


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for `tensor` (see [Note: implementation choice])."""
    if torch.compiler.is_compiling():  # dynamo traces the torch path; Inductor fuses it with its neighbours
        return False
    impl = _requested_impl()
    if impl == "torch":
        return False
    ok, why = _triton_import()
    if impl == "triton":
        if not ok:
            raise RuntimeError(f"{IMPL_ENV}=triton but {why}")
        if tensor.device.type != "cuda" and not _interpret():
            raise RuntimeError(
                f"{IMPL_ENV}=triton with a {tensor.device.type} tensor needs TRITON_INTERPRET=1 "
                "(set before the first kernel call); use a CUDA tensor or unset the variable"
            )
        return True
    return ok and tensor.device.type == "cuda"


def _choice() -> tuple[str, str]:
    if os.environ.get(FALLBACK_ENV, "") not in ("", "0"):
        return "torch", f"{FALLBACK_ENV} is set"
    try:
        impl = _requested_impl()
    except ValueError as exc:
        return "error", str(exc)
    ok, why = _triton_import()
    if impl == "torch":
        return "torch", f"{IMPL_ENV}=torch"
    if impl == "triton":
        if not ok:
            return "error", f"{IMPL_ENV}=triton but {why}"
        where = "CUDA and TRITON_INTERPRET=1 CPU tensors" if _interpret() else "CUDA tensors only"
        return "triton", f"{IMPL_ENV}=triton, {why}, for {where}"
    if not ok:
        return "torch", why
    if not torch.cuda.is_available():
        return "torch", f"{why} importable but no CUDA device; Triton runs on CUDA tensors only"
    return "triton", f"{why} on {torch.cuda.get_device_name()}"


def kernel_report() -> list[tuple[str, str, str]]:
    """List each kernel with the implementation it uses for CUDA tensors and why.

    Returns:
        `[(kernel name, "triton" | "torch" | "error", reason), ...]`, one row per kernel in `rms_norm, layer_norm,
        rotary, swiglu, fused_linear_cross_entropy, paged_attention, gemv`. CPU tensors always take the torch path
        unless `CAI_KERNELS_IMPL=triton` and `TRITON_INTERPRET=1`. A last row `("cpu_adam", impl, reason)` says
        what CPUAdam/HybridAdam use for CPU parameters (`cai.kernels.optim.cpu_adam_status()`: `native-avx512
        | native-avx2 | native-scalar | torch-fused`; the first call builds the native library).
        `cai check` prints this table.
    """
    # Imported here: the optimizer package must not load (or build) anything when only kernels are used.
    from cai.kernels.optim import cpu_adam_status

    impl, why = _choice()
    return [(name, impl, why) for name in KERNEL_NAMES] + [("cpu_adam", *cpu_adam_status())]
