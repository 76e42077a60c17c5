"""What ``boost()`` hands back: a model wrapper that remembers the user's module, and an optimizer wrapper with
the Colossal-AI methods (``backward``, ``clip_grad_by_norm``, ...) and optional fp16 loss scaling."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._precision import DynamicLossScaler, grads_have_inf
from cai.kernels import trim_training_forward
from cai.mesh import advance_step

__all__ = ["ModelWrapper", "OptimizerWrapper"]


class ModelWrapper(nn.Module):
    """The boosted model: ``forward`` calls the wrapped (DDP/FSDP/...) module; ``unwrap()`` gives the user's module,
    whose parameter names are the checkpoint keys."""

    def __init__(self, module: nn.Module, *, unwrapped: nn.Module | None = None) -> None:
        super().__init__()
        self.module = module
        # Stored outside _modules so that the user's module is not registered twice.
        object.__setattr__(self, "_cai_unwrapped", unwrapped if unwrapped is not None else module)
        # No KV cache in training forwards and no host test for packed sequences ([Note: packed-sequence check]).
        trim_training_forward(self.unwrap())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The user's model's ``generate`` (Hugging Face's). Under GeminiPlugin and TorchFSDPPlugin call it inside
        ``booster.gathered(model)``, which gathers the parameters once instead of once per token."""
        module = self.unwrap(unwrap_peft=False)
        if not hasattr(module, "generate"):
            raise AttributeError(f"ModelWrapper.generate: {type(module).__name__} has no generate()")
        return module.generate(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        module = self._cai_unwrapped
        if unwrap_peft and hasattr(module, "get_base_model") and type(module).__name__.startswith("Peft"):
            return module.get_base_model()
        return module


class OptimizerWrapper:
    """A torch optimizer with Colossal-AI's wrapper methods; with ``scaler`` it implements fp16 loss scaling.

    ``step()`` unscales the gradients (unless ``clip_grad_by_norm`` already did), skips the update when any rank
    saw inf/nan, and updates the scale.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        *,
        scaler: DynamicLossScaler | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.optim = optim
        self.scaler = scaler
        self.group = group
        self._unscaled = False
        self.boosted_model: ModelWrapper | None = (
            None  # set by the plugin; names the parameters for checkpoints
        )

    # ---- torch.optim.Optimizer surface ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @property
    def state(self) -> Any:
        return self.optim.state

    def parameters(self) -> list[nn.Parameter]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.optim.add_param_group(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._unscaled = False

    def step(self, *args: Any, **kwargs: Any) -> Any:
        advance_step()  # the step that collective timeouts report (a skipped fp16 step still counts)
        if self.scaler is None:
            return self.optim.step(*args, **kwargs)
        self._unscale()
        found_inf = grads_have_inf(self.parameters(), self.group)
        self.scaler.update(found_inf)
        self._unscaled = False
        if found_inf:
            return None
        return self.optim.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    # ---- Colossal-AI OptimizerWrapper methods -----------------------------------------------------------
    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward(inputs=inputs, retain_graph=retain_graph)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, inputs: Any = None, retain_graph: bool = False
    ):
        if self.scaler is not None:
            grad = grad * self.scaler.scale
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def unscale_grad(self) -> None:
        self._unscale()

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, **_: Any) -> torch.Tensor:
        """Clip all gradients to a global norm (over every rank's shard for sharded parameters); returns the norm."""
        self._unscale()
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type=norm_type, foreach=False)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self._unscale()
        torch.nn.utils.clip_grad_value_(self.parameters(), clip_value)

    def get_grad_norm(self, norm_type: float = 2.0, **_: Any) -> float:
        self._unscale()
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=False)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return float(norm) if math.isfinite(float(norm)) else float("inf")

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def _unscale(self) -> None:
        if self.scaler is None or self._unscaled:
            return
        inv = 1.0 / self.scaler.scale
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(inv)
        self._unscaled = True
