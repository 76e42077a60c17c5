"""Read a Hugging Face safetensors checkpoint directory straight into shards, and build the lazy model that
``from_pretrained`` returns inside ``LazyInitContext``.

Each requested piece is read with a safetensors slice of only the rows its ``ShardSpec`` covers, so host memory
stays bounded by one tensor's slab (well under one shard file), whatever the model size.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from cai.booster._state import named_tensors
from cai.mesh import ShardSpec

__all__ = [
    "build_from_pretrained",
    "check_checkpoint_keys",
    "load_pretrained_into",
    "safetensors_reader",
    "unexpected_keys",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _weight_map(path: str) -> dict[str, str]:
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"no {_INDEX} or {_SINGLE} in {path!r}: pretrained weights must be safetensors")


def safetensors_reader(path: str) -> Callable[[str, ShardSpec, torch.dtype], torch.Tensor]:
    """``read(name, spec, dtype)`` over the safetensors files of a checkpoint directory (state protocol reader)."""
    from safetensors import safe_open

    weight_map = _weight_map(path)

    def read(name: str, spec: ShardSpec, dtype: torch.dtype) -> torch.Tensor:
        file = weight_map.get(name)
        if file is None:
            raise KeyError(f"{name!r} is not in the checkpoint {path!r} ({len(weight_map)} tensors)")
        with safe_open(file, framework="pt") as f:
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != spec.global_shape:
                raise ValueError(f"{name!r}: checkpoint shape {shape} != model shape {spec.global_shape}")
            region = sl[spec.read_region()] if shape else f.get_tensor(name)
        return spec.cut_region(region).to(dtype)

    return read


def unexpected_keys(model: nn.Module, keys: Iterable[str]) -> list[str]:
    """``keys`` (checkpoint tensors ``model`` has no place for) without those Hugging Face skips on load: the
    model's ``_keys_to_ignore_on_load_unexpected`` patterns, and the ``rotary_emb.inv_freq`` and ``position_ids``
    buffers of older checkpoints. Sorted."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [b for b, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    skip = re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None
    return sorted(k for k in keys if skip is None or skip.search(k) is None)


def check_checkpoint_keys(model: nn.Module, path: str) -> None:
    """Raise ``ValueError`` naming the tensors ``model`` (whole, before any plugin cut it) reads that the checkpoint
    lacks, and the checkpoint's tensors that the model has no place for: a checkpoint of another depth or head
    than the config says would otherwise load in part, silently. Keys that Hugging Face skips on load are skipped
    here too (the model's ``_keys_to_ignore_on_load_unexpected`` patterns, and the ``rotary_emb.inv_freq`` and
    ``position_ids`` buffers of older checkpoints)."""
    stored = set(_weight_map(path))
    wanted = named_tensors(model)  # what the loaders read: tied weights once, persistent buffers
    missing = sorted(set(wanted) - stored)
    unexpected = unexpected_keys(model, stored - set(model.state_dict(keep_vars=True)))  # tied: every name
    if not missing and not unexpected:
        return

    def listed(keys: list[str]) -> str:
        return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    found = [f"{len(missing)} missing from it ({listed(missing)})"] if missing else []
    if unexpected:
        found.append(f"{len(unexpected)} in it that the model has no place for ({listed(unexpected)})")
    raise ValueError(
        f"the checkpoint {path!r} does not match {type(model).__name__}: {len(wanted)} tensors to read, "
        f"{'; '.join(found)}. Build the model with the checkpoint's own config. To leave checkpoint tensors out "
        "on purpose, add patterns that match them to the model's _keys_to_ignore_on_load_unexpected; a model "
        "with tensors of its own (a new head) is built with from_pretrained outside LazyInitContext"
    )


def load_pretrained_into(state: object, path: str) -> None:
    """Fill a state-protocol object (``load_sharded_state_dict``) from a pretrained safetensors directory.

    A Hugging Face model with tied embeddings stores the tied weight once; ``named_parameters`` also yields it
    once, so every requested name must be in the checkpoint (a missing name raises ``KeyError``).
    """
    state.load_sharded_state_dict(safetensors_reader(path))  # type: ignore[attr-defined]


# from_pretrained keywords that say where the files come from: passed on with the config's
_HUB = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
# keywords that shape only how eager loading reads or reports files: no effect on a model Booster.boost fills
_IGNORED = (
    "_commit_hash", "_fast_init", "_from_auto", "_from_pipeline", "adapter_name", "disable_mmap", "from_flax",
    "from_tf", "low_cpu_mem_usage", "mirror", "offload_state_dict", "resume_download", "tqdm_class", "weights_only",
)  # fmt: skip
# keywords that change which weights are read or where they go: Booster.boost reads safetensors into its own layout
_UNSUPPORTED = (
    "adapter_kwargs", "device_map", "device_mesh", "distributed_config", "gguf_file", "ignore_mismatched_sizes",
    "kernel_config", "key_mapping", "max_memory", "offload_buffers", "offload_folder", "output_loading_info",
    "quantization_config", "state_dict", "tp_plan", "tp_size", "use_kernels", "variant",
)  # fmt: skip
_SAFETENSORS_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def build_from_pretrained(
    cls: type, path: str | os.PathLike, *model_args: Any, **kwargs: Any
) -> tuple[nn.Module, str]:
    """What ``cls.from_pretrained(path, **kwargs)`` builds, without reading weights: the config loaded with the
    same keywords (those naming config attributes override them, the rest go to the model's ``__init__``), the
    same ``dtype`` (``"auto"``: the config's, else the checkpoint's), ``attn_implementation`` and
    ``trust_remote_code``. Returns the model, in eval mode as ``from_pretrained`` leaves it, and the directory
    its safetensors files are in."""
    from transformers import AutoConfig, PretrainedConfig

    if model_args:
        raise TypeError(
            f"{cls.__name__}.from_pretrained inside LazyInitContext takes the model's own arguments as keywords, "
            f"got {len(model_args)} positional"
        )
    given = sorted(k for k in _UNSUPPORTED if kwargs.pop(k, None) not in (None, False, {}, ""))
    if kwargs.get("use_safetensors") is False:
        given.append("use_safetensors=False")
    if given:
        raise ValueError(
            f"{cls.__name__}.from_pretrained inside LazyInitContext: {', '.join(given)} not supported; Booster.boost "
            "places the model and reads its safetensors weights into each rank's part, so leave them out (or build "
            "the model outside the context)"
        )
    for k in (*_IGNORED, "use_safetensors"):
        kwargs.pop(k, None)
    trust_remote_code = kwargs.pop("trust_remote_code", None)
    hub = {k: kwargs.pop(k) for k in _HUB if k in kwargs}
    dtype = kwargs.pop("dtype", None)
    legacy_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else legacy_dtype
    build = {k: kwargs.pop(k) for k in ("attn_implementation", "experts_implementation") if k in kwargs}
    config = kwargs.pop("config", None)
    kwargs.update(kwargs.pop("config_kwargs", None) or {})
    if isinstance(config, PretrainedConfig):
        config, model_kwargs = copy.deepcopy(config), kwargs
    else:
        source = config if config is not None else path
        if cls.config_class is not None:  # the class is resolved already, remote code or not
            config, model_kwargs = cls.config_class.from_pretrained(
                source, return_unused_kwargs=True, **hub, **kwargs
            )
        else:
            config, model_kwargs = AutoConfig.from_pretrained(
                source, return_unused_kwargs=True, trust_remote_code=trust_remote_code, **hub, **kwargs
            )
        model_kwargs.pop("_commit_hash", None)
    weights = os.path.join(os.fspath(path), hub["subfolder"]) if hub.get("subfolder") else os.fspath(path)
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or _checkpoint_dtype(weights)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is not None:
        build["dtype"] = dtype
    config.name_or_path = os.fspath(path)
    model = cls._from_config(config, **build, **model_kwargs)
    return model.eval(), weights


def _checkpoint_dtype(path: str) -> torch.dtype | None:
    """The dtype of the first floating-point tensor of a local safetensors checkpoint (``dtype="auto"``)."""
    from safetensors import safe_open

    try:
        weight_map = _weight_map(path)
    except FileNotFoundError:
        return None
    for file in dict.fromkeys(weight_map.values()):
        with safe_open(file, framework="pt") as f:
            names = f.keys()
            for name in names:
                dtype = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    return None
