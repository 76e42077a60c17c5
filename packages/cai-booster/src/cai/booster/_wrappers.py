"""What ``boost()`` hands back: a model wrapper that remembers the user's module, and an optimizer wrapper with
the Colossal-AI methods (``backward``, ``clip_grad_by_norm``, ...) and optional fp16 loss scaling."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cai.booster._precision import DynamicLossScaler, grads_have_inf
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
        self._cai_no_train_cache = _takes_use_cache(self.unwrap())
        self._cai_numbers_tokens = _numbers_tokens(self.unwrap()) and _install_packed_check()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = self._cai_unwrapped.training
        # A Hugging Face model builds a KV cache whenever config.use_cache is on (the default), in training too:
        # every layer's keys and values copied into it (two copy kernels a layer) and held for as long as the
        # outputs live, past backward. Training forwards skip it unless the caller asks for a cache.
        if training and self._cai_no_train_cache and not {"use_cache", "past_key_values"} & kwargs.keys():
            kwargs["use_cache"] = False
        if (
            training
            and self._cai_numbers_tokens
            and len(args) <= 1  # input_ids alone; a second positional argument is an attention mask
            and all(kwargs.get(k) is None for k in _POSITION_INPUTS)
        ):
            token = _GENERATED_POSITIONS.set(True)
            try:
                return self.module(*args, **kwargs)
            finally:
                _GENERATED_POSITIONS.reset(token)
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


# [Note: packed-sequence check]
# Without an attention mask or a cache, transformers' causal-mask builder looks for packed sequences in the position
# ids (`find_packed_sequence_indices`: positions that do not step by one) and tests the answer on the host, which
# waits for the device at the start of every training forward; the device then idles while the host issues the
# first kernels of the next forward. When the caller passes no positions, mask or cache, the models below number
# the tokens 0..T-1 themselves, so there is nothing packed to find: during such a forward the check answers
# "none" (what it would have computed) without reading the device. Positions the caller passes are checked as before.
_ARANGE_POSITION_MODELS = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3",
     "olmo2", "granite"}
)  # fmt: skip
_POSITION_INPUTS = ("attention_mask", "position_ids", "past_key_values", "cache_position")
_GENERATED_POSITIONS = contextvars.ContextVar("cai_generated_positions", default=False)
# transformers' own check, called whenever the positions are not the model's own
_packed_check_original = None


def _numbers_tokens(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "model_type", None) in _ARANGE_POSITION_MODELS


def _find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    if _GENERATED_POSITIONS.get():
        return None
    return _packed_check_original(position_ids)


def _install_packed_check() -> bool:
    """Route transformers' packed-sequence check through ``_find_packed_sequence_indices`` (once per process)."""
    global _packed_check_original
    try:
        from transformers import masking_utils
    except ImportError:
        return False
    current = getattr(masking_utils, "find_packed_sequence_indices", None)
    if current is None:
        return False
    if current is not _find_packed_sequence_indices:
        _packed_check_original = current
        masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices
    return True


def _takes_use_cache(module: nn.Module) -> bool:
    """Whether ``module`` is a model with a ``config.use_cache`` whose forward takes ``use_cache``."""
    if getattr(getattr(module, "config", None), "use_cache", None) is None:
        return False
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


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
