"""CPUAdam, HybridAdam and FusedAdam: Adam/AdamW optimizers that update each parameter where it lives."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cai.kernels.optim._functional import adam_update, torch_adam_update


def _check_hyperparameters(lr, betas, eps, weight_decay, nvme_offload_fraction=0.0, **extra) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr={lr} is invalid; use a learning rate >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas} is invalid; use two values in [0, 1), e.g. (0.9, 0.999)")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps} is invalid; use eps >= 0, e.g. 1e-8")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay={weight_decay} is invalid; use weight_decay >= 0")
    if nvme_offload_fraction != 0.0:
        raise NotImplementedError(
            f"nvme_offload_fraction={nvme_offload_fraction}: NVMe offload of optimizer state is not supported; "
            "use nvme_offload_fraction=0.0 (optimizer state stays in host memory)"
        )
    if extra.get("amsgrad", False):
        raise ValueError("amsgrad=True is not supported by cai's Adam kernels; use amsgrad=False")
    if extra.get("maximize", False):
        raise ValueError("maximize=True is not supported by cai's Adam kernels; negate the loss instead")


def adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """``optimizer.state[p]`` in torch Adam's layout, created zeroed on first use: ``step`` a 0-d float32 tensor (on
    the parameter's device for CUDA parameters, as torch's fused Adam keeps it; on the host otherwise),
    ``exp_avg`` and ``exp_avg_sq`` shaped and typed like ``p``. A loaded ``step`` is moved to that device."""
    state = optimizer.state[p]
    step_device = p.device if p.device.type == "cuda" else torch.device("cpu")
    if not state:
        # Moments in the parameter's dtype, as torch does (fp32 for fp32 master weights, the case the native
        # kernel serves; bf16/fp16 parameters go through torch's kernels).
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif state["step"].device != step_device or state["step"].dtype != torch.float32:
        state["step"] = state["step"].to(device=step_device, dtype=torch.float32)
    return state


class _Adam(torch.optim.Optimizer):
    """Shared implementation. State per parameter uses torch Adam's names: `step` (0-d float32 tensor, on the
    parameter's device for CUDA parameters as in torch's fused Adam), `exp_avg`, `exp_avg_sq`."""

    # True: CPU parameters use the native kernel; False: torch's fused CPU kernel.
    _native_cpu = True

    def __init__(
        self, params, *, lr, bias_correction, betas, eps, weight_decay, adamw_mode, **extra: Any
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, **extra)
        extra.pop("nvme_offload_fraction", None)
        extra.pop("nvme_offload_dir", None)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            amsgrad=False,
            maximize=False,
            **{k: v for k, v in extra.items() if k not in ("amsgrad", "maximize")},
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A state_dict saved by torch.optim.Adam(W) has no `adamw_mode`/`bias_correction` in its groups.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", self.defaults.get("bias_correction", True))
            group.setdefault("adamw_mode", self.defaults.get("adamw_mode", True))
            _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                   amsgrad=group.get("amsgrad", False), maximize=group.get("maximize", False))  # fmt: skip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, div_scale: float = -1.0) -> float | None:
        """One update of every parameter that has a gradient. `div_scale` > 0 divides the gradients first
        (an fp16 loss scale); the gradients themselves are not modified."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = div_scale if div_scale > 0 else None
        for group in self.param_groups:
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = dict(
                lr=float(group["lr"]),  # a tensor lr (torch allows one) becomes a number
                beta1=beta1,
                beta2=beta2,
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw_mode=group["adamw_mode"],
                bias_correction=group["bias_correction"],
                grad_scale=grad_scale,
            )
            # Parameters the torch kernels update, batched per (device, dtype) into one fused launch.
            batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, dict]]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = adam_state(self, p)
                if p.device.type == "cpu" and self._native_cpu:
                    state["step"] += 1
                    adam_update(
                        _local(p),
                        _local(p.grad),
                        _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]),
                        step=state["step"].item(),
                        **hyper,
                    )
                else:
                    batches[(p.device, p.dtype)].append((p, p.grad, state))
            for items in batches.values():
                steps = [s["step"] for _, _, s in items]
                torch._foreach_add_(steps, 1)
                torch_adam_update(
                    [p for p, _, _ in items],
                    [g for _, g, _ in items],
                    [s["exp_avg"] for _, _, s in items],
                    [s["exp_avg_sq"] for _, _, s in items],
                    steps,
                    **hyper,
                )
        return loss


class CPUAdam(_Adam):
    """Adam/AdamW for parameters in host memory, with the native multi-threaded CPU kernel.

    Args (names and defaults as Colossal-AI's CPUAdam):
        model_params: parameters or parameter groups.
        lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.
        adamw_mode=True: decoupled weight decay (AdamW); False applies L2 decay to the gradient (Adam).
        nvme_offload_fraction=0.0, nvme_offload_dir=None: NVMe offload is not supported (non-zero raises).
        amsgrad=False: True raises (not supported).

    Parameters should be fp32; gradients may be fp32, bf16 or fp16 (fp32 master weights with low-precision
    gradients). CUDA parameters, if any, are updated on the GPU with torch's fused kernel. The state_dict has
    torch Adam's layout (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints move between this and torch.optim.AdamW.
    `step(closure=None, div_scale=-1)`: div_scale > 0 divides gradients by it first (an fp16 loss scale).

    Which CPU implementation runs: `cai.kernels.optim.cpu_adam_status()`.

    Example:
        >>> opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        model_params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        *,
        amsgrad: bool = False,
    ) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adamw_mode, amsgrad=amsgrad,
                         nvme_offload_fraction=nvme_offload_fraction, nvme_offload_dir=nvme_offload_dir)  # fmt: skip


class HybridAdam(CPUAdam):
    """One Adam/AdamW over parameters that live on CPU or GPU: each is updated where it lives (native CPU kernel
    in host memory, torch's fused multi-tensor kernel on the GPU). Arguments as CPUAdam; extra keyword
    arguments are stored in the parameter-group defaults (as Colossal-AI does), except amsgrad=True and
    maximize=True, which raise.

    Example:
        >>> opt = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        model_params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        **defaults: Any,
    ) -> None:
        _Adam.__init__(self, model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                       weight_decay=weight_decay, adamw_mode=adamw_mode, nvme_offload_fraction=nvme_offload_fraction,
                       nvme_offload_dir=nvme_offload_dir, **defaults)  # fmt: skip


class FusedAdam(_Adam):
    """Adam/AdamW with torch's fused multi-tensor kernels (one launch per device and dtype), for GPU parameters;
    CPU parameters work too, through torch's fused CPU kernel.

    Args (names and defaults as Colossal-AI's FusedAdam): params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, adamw_mode=True, weight_decay=0.0, amsgrad=False (True raises),
    set_grad_none=True (the default of zero_grad's set_to_none).

    Example:
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.1)
    """

    _native_cpu = False

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adamw_mode, amsgrad=amsgrad)  # fmt: skip
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters): the native kernel works on plain memory."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
