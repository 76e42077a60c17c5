"""Reading named tensors back, each rank only the slices its current layout needs.

Everything that can be checked without reading tensor data is checked before the first tensor is copied
(keys, shapes, every needed file's presence, size and header, optionally its checksum), so a bad checkpoint
raises without leaving the model or optimizer half-loaded.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cai.ckpt._format import (
    FORMAT_NAME,
    MANIFEST_NAME,
    MODEL_INDEX_NAME,
    MODEL_SINGLE_NAME,
    CheckpointError,
    dtype_from_name,
    file_crc32,
    read_header,
    read_header_and_start,
    read_into,
    read_json,
)
from cai.mesh import ShardSpec


def _fmt(names: Any, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def find_manifest(path: Path) -> dict | None:
    """The manifest of the checkpoint directory that holds ``path`` (itself or its parent), if any."""
    for d in (path, path.parent):
        if (d / MANIFEST_NAME).exists():
            manifest = read_json(d / MANIFEST_NAME)
            if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
                return {"root": d, **manifest}
    return None


def check_file(manifest: dict | None, path: Path, *, verify: bool) -> None:
    """``path`` exists and (with a manifest) is listed with this size; with ``verify``, its CRC32 matches."""
    if not path.exists():
        raise CheckpointError(f"missing checkpoint file {path}")
    if manifest is None:
        return
    rel = path.relative_to(manifest["root"]).as_posix()
    entry = manifest["files"].get(rel)
    if entry is None:
        raise CheckpointError(f"{path} is not listed in the manifest of {manifest['root']}: a foreign file")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{path} has {size} bytes, its manifest says {entry['bytes']}: the file is truncated or replaced"
        )
    if verify and file_crc32(path) != entry["crc32"]:
        raise CheckpointError(f"{path} fails checksum verification: the file is corrupted")


class CheckpointReader:
    """Read tensors by name from ``directory`` (an index plus shard files, or a single safetensors file).

    Example::

        with CheckpointReader("ckpt/step-000100/model") as r:
            w = r.read("model.embed_tokens.weight", ShardSpec.block((V, H), dim=0, index=rank, parts=world))
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        index_name: str = MODEL_INDEX_NAME,
        single_name: str | None = MODEL_SINGLE_NAME,
        verify: bool = False,
    ):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.verify = verify
        self.manifest = find_manifest(self.dir)
        index_path = self.dir / index_name
        self.aliases: dict[str, str] = {}
        if index_path.exists():
            self._check_file(index_path)
            index = read_json(index_path)
            if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
                raise CheckpointError(f"{index_path} has no 'weight_map': not a safetensors index")
            self.weight_map: dict[str, str] = index["weight_map"]
            self.aliases = dict((index.get("metadata") or {}).get("aliases") or {})
        elif single_name and (self.dir / single_name).exists():
            self.weight_map = dict.fromkeys(read_header(self.dir / single_name), single_name)
        else:
            found = sorted(p.name for p in self.dir.iterdir())
            pickles = [n for n in found if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
            hint = f"; {_fmt(pickles)} are pickle files, which cai-ckpt never loads" if pickles else ""
            raise CheckpointError(
                f"{self.dir} holds no {index_name}{' or ' + single_name if single_name else ''} (found: {_fmt(found) or 'nothing'}){hint}"
            )
        self._headers: dict[str, dict] = {}
        self._starts: dict[str, int] = {}
        self._handles: dict[str, Any] = {}

    # ---- names -------------------------------------------------------------------------------------------
    def names(self) -> set[str]:
        return set(self.weight_map) | set(self.aliases)

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name) if name not in self.weight_map else name

    def header(self, name: str) -> dict[str, Any]:
        name = self.resolve(name)
        fname = self.weight_map[name]
        if fname not in self._headers:
            path = self.dir / fname
            self._check_file(path)
            self._headers[fname], self._starts[fname] = read_header_and_start(path)
        header = self._headers[fname]
        if name not in header:
            raise CheckpointError(
                f"{self.dir / fname} does not contain {name!r}, which the index places there: the file belongs to "
                f"another checkpoint (it holds {_fmt(header, 5)})"
            )
        return header[name]

    def _check_file(self, path: Path) -> None:
        check_file(self.manifest, path, verify=self.verify)

    # ---- validation --------------------------------------------------------------------------------------
    def check(
        self, expected: dict[str, tuple[int, ...]], *, strict: bool, optional: set[str] = frozenset()
    ) -> None:
        """Raise listing missing and unexpected keys (``optional`` names may be absent), then shape mismatches."""
        have = self.names()
        missing = set(expected) - have - set(optional)
        unexpected = have - set(expected) if strict else set()
        unexpected -= set(self.aliases)  # a tied name the target stores once is not an error
        if missing or unexpected:
            parts = [f"checkpoint {self.dir} does not match:"]
            if missing:
                parts.append(f"missing keys ({len(missing)}): {_fmt(missing)}")
            if unexpected:
                parts.append(f"unexpected keys ({len(unexpected)}): {_fmt(unexpected)}")
            raise CheckpointError(" ".join(parts))
        for name, shape in expected.items():
            if name not in have:
                continue
            stored = tuple(self.header(name)["shape"])
            if stored != tuple(shape):
                raise CheckpointError(
                    f"shape mismatch for {name!r}: checkpoint has {stored} (in {self.weight_map[self.resolve(name)]}), "
                    f"the current model needs {tuple(shape)}"
                )

    # ---- reading -----------------------------------------------------------------------------------------
    def read(self, name: str, spec: ShardSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The local piece described by ``spec`` of tensor ``name``, in ``dtype`` (default: as stored)."""
        info = self.header(name)
        if tuple(info["shape"]) != spec.global_shape:
            raise CheckpointError(
                f"shape mismatch for {name!r}: checkpoint has {tuple(info['shape'])}, the reader asked for {spec.global_shape}"
            )
        real = self.resolve(name)
        fname = self.weight_map[real]
        stored = dtype_from_name(info["dtype"])
        want = dtype or stored
        region_slices = spec.read_region()
        shape = spec.global_shape
        if all(sl.start == 0 and sl.stop == n for sl, n in zip(region_slices[1:], shape[1:])):
            # Whole tensors and row ranges (flat ZeRO pieces, dim-0 blocks) are one contiguous byte range, read
            # straight from the file: no mmap, and the GIL is released, so several files load in parallel.
            rows = region_slices[0] if shape else slice(0, 1)
            row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=stored).element_size()
            region = torch.empty((rows.stop - rows.start, *shape[1:]) if shape else (), dtype=stored)
            read_into(
                self.dir / fname,
                self._starts[fname] + info["data_offsets"][0] + rows.start * row_bytes,
                region,
            )
            local = spec.cut_region(region)
            return local.to(want) if local.dtype != want else local
        handle = self._handles.get(fname)
        if handle is None:
            try:
                handle = self._handles[fname] = safe_open(str(self.dir / fname), framework="pt")
            except Exception as e:
                raise CheckpointError(f"cannot open {self.dir / fname}: {e}") from None
        try:
            region = handle.get_slice(real)[spec.read_region()]
        except Exception as e:
            raise CheckpointError(f"cannot read {real!r} from {self.dir / fname}: {e}") from None
        local = spec.cut_region(region)
        return local.to(want) if local.dtype != want else local

    def read_whole_into(self, name: str, out: torch.Tensor) -> bool:
        """Read the whole tensor ``name`` straight into ``out`` when no conversion is needed (CPU, contiguous,
        same dtype and shape); returns False, having done nothing, otherwise."""
        info = self.header(name)
        if (
            out.device.type != "cpu"
            or not out.is_contiguous()
            or tuple(info["shape"]) != tuple(out.shape)
            or dtype_from_name(info["dtype"]) != out.dtype
        ):
            return False
        fname = self.file_of(name)
        read_into(self.dir / fname, self._starts[fname] + info["data_offsets"][0], out)
        return True

    def file_of(self, name: str) -> str:
        return self.weight_map[self.resolve(name)]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            self.close()
