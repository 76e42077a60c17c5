"""Read a Hugging Face safetensors checkpoint directory straight into shards.

Each requested piece is read with a safetensors slice of only the rows its ``ShardSpec`` covers, so host memory
stays bounded by one tensor's slab (well under one shard file), whatever the model size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from cai.mesh import ShardSpec

__all__ = ["load_pretrained_into", "safetensors_reader"]

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


def load_pretrained_into(state: object, path: str) -> None:
    """Fill a state-protocol object (``load_sharded_state_dict``) from a pretrained safetensors directory.

    A Hugging Face model with tied embeddings stores the tied weight once; ``named_parameters`` also yields it
    once, so every requested name must be in the checkpoint (a missing name raises ``KeyError``).
    """
    state.load_sharded_state_dict(safetensors_reader(path))  # type: ignore[attr-defined]
