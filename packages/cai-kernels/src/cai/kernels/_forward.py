"""Two costs of a Hugging Face training forward that the training step does not need: the KV cache, and the host's
test for packed sequences. :func:`trim_training_forward` removes both from a model's training forwards."""

from __future__ import annotations

import contextvars
import inspect
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["trim_training_forward"]

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
_CACHE_INPUTS = ("use_cache", "past_key_values")
_OWN_POSITIONS = contextvars.ContextVar("cai_own_positions", default=False)
# transformers' own check, called whenever the positions are not the model's own
_packed_check_original = None


def trim_training_forward(model: nn.Module) -> bool:
    """Make ``model``'s training forwards skip what training does not use, with the same results. Idempotent.

    - **KV cache.** A Hugging Face model builds one whenever ``config.use_cache`` is on (the default), in training
      too: every layer's keys and values copied (two copy kernels a layer) and held for as long as the outputs
      live, past backward. A training forward gets ``use_cache=False`` unless the caller passes ``use_cache`` or
      ``past_key_values``. The config is left alone, so evaluation and ``generate`` keep their caches.
    - **Packed-sequence test.** For the model types that number the tokens 0..T-1 when given no positions, a
      training forward without ``attention_mask``, ``position_ids``, ``past_key_values`` and ``cache_position``
      answers transformers' packed-sequence test itself, without the host reading the device
      ([Note: packed-sequence check]). Positions the caller passes are tested as before.

    Installed as forward hooks on ``model``, so they hold whoever calls it (DDP, FSDP, a PEFT wrapper). Returns
    whether anything was installed: False for a module that is not such a model.
    """
    if hasattr(model, "_cai_trimmed_forward"):
        return True
    config = getattr(model, "config", None)
    no_cache = getattr(config, "use_cache", None) is not None and _takes_use_cache(model)
    own_positions = getattr(config, "model_type", None) in _ARANGE_POSITION_MODELS and _install_packed_check()
    if not (no_cache or own_positions):
        return False
    model._cai_trimmed_forward = (no_cache, own_positions)
    model._cai_position_tokens = []  # one entry for each forward in progress
    model.register_forward_pre_hook(_enter, with_kwargs=True)
    model.register_forward_hook(_leave, always_call=True)  # also when the forward raises
    return True


def _enter(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    no_cache, own_positions = module._cai_trimmed_forward
    if not module.training or torch.compiler.is_compiling():
        module._cai_position_tokens.append(None)
        return None
    if no_cache and not _CACHE_INPUTS & kwargs.keys():
        kwargs = {**kwargs, "use_cache": False}
    own = own_positions and len(args) <= 1 and all(kwargs.get(k) is None for k in _POSITION_INPUTS)
    module._cai_position_tokens.append(_OWN_POSITIONS.set(True) if own else None)
    return args, kwargs


def _leave(module: nn.Module, args: tuple, output: Any) -> None:
    token = module._cai_position_tokens.pop()
    if token is not None:
        _OWN_POSITIONS.reset(token)


def _takes_use_cache(module: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    if _OWN_POSITIONS.get():
        return None
    return _packed_check_original(position_ids)


def _install_packed_check() -> bool:
    """Route transformers' packed-sequence check through ``_find_packed_sequence_indices`` (once per process)."""
    global _packed_check_original
    # Loaded by every modeling file that builds masks with it; cai-kernels does not import transformers itself.
    masking_utils = sys.modules.get("transformers.masking_utils")
    current = getattr(masking_utils, "find_packed_sequence_indices", None)
    if current is None:
        return False
    if current is not _find_packed_sequence_indices:
        _packed_check_original = current
        masking_utils.find_packed_sequence_indices = _find_packed_sequence_indices
    return True
