"""Reading named tensors back, each rank only the slices its current layout needs.

Everything that can be checked without reading tensor data is checked before the first tensor is copied
(keys, shapes, every needed file's presence, size and header), so a bad checkpoint raises without leaving the
model or optimizer half-loaded. Checksums are verified as the bytes are read (see [Note: block checksums]):
each rank checks exactly the blocks it reads, in the thread that read them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from cai.ckpt._checksum import checksum_function, unpack
from cai.ckpt._format import (
    FORMAT_NAME,
    MANIFEST_NAME,
    MODEL_INDEX_NAME,
    MODEL_SINGLE_NAME,
    CheckpointError,
    _Bytes,
    dtype_from_name,
    file_checksum,
    read_bytes,
    read_header,
    read_header_and_start,
    read_into,
    read_json,
)
from cai.ckpt._txn import dist_info
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


def _corrupted(path: Path, what: str) -> str:
    return (
        f"{path} fails checksum verification ({what}): the file is corrupted; load another checkpoint, "
        "or pass verify=False to load it as it is"
    )


def manifest_entry(manifest: dict | None, path: Path) -> dict | None:
    """``path``'s entry in ``manifest`` (None without a manifest); a file it does not list raises."""
    if manifest is None:
        return None
    rel = path.relative_to(manifest["root"]).as_posix()
    entry = manifest["files"].get(rel)
    if entry is None:
        raise CheckpointError(f"{path} is not listed in the manifest of {manifest['root']}: a foreign file")
    return entry


def check_file(manifest: dict | None, path: Path, *, verify: bool, whole: bool = True) -> None:
    """``path`` exists and (with a manifest) is listed with this size; with ``verify``, its checksums match.

    ``whole``: verify every byte now (small files read in one piece). Without it, a safetensors file with block
    checksums is verified later, block by block, as its tensors are read; whole-file checksums of older
    checkpoints are always checked here.
    """
    if not path.exists():
        raise CheckpointError(f"missing checkpoint file {path}")
    entry = manifest_entry(manifest, path)
    if entry is None:
        return
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{path} has {size} bytes, its manifest says {entry['bytes']}: the file is truncated or replaced"
        )
    if not verify:
        return
    if "checksums" in entry:
        if whole:
            _verify_blocks_of_file(path, entry["checksums"])
        return
    for name in (
        "crc32c",
        "crc32",
    ):  # small files, and every file of a checkpoint from before block checksums
        if name in entry:
            actual = file_checksum(path, name)
            if actual != entry[name]:
                raise CheckpointError(
                    _corrupted(path, f"{name} {actual:#010x}, the manifest says {entry[name]:#010x}")
                )
            return


def _verify_blocks_of_file(path: Path, sums: dict) -> None:
    header, start = read_header_and_start(path)
    check = _BlockCheck(path, sums)
    check.header(start)
    for name, info in header.items():
        b, e = info["data_offsets"]
        n = e - b
        if n:
            data = torch.empty(n, dtype=torch.uint8)
            read_into(path, start + b, data)
            problem = check.tensor(name, start + b, n, 0, n, _Bytes(data).view)
            if problem:
                raise CheckpointError(problem)


_CRC_THREADS = min(8, os.cpu_count() or 1)
_PARALLEL_MIN_BLOCKS = 64  # 16 MiB a thread at least
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _crc_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_CRC_THREADS, thread_name_prefix="cai-ckpt-crc")
        return _pool


class _BlockCheck:
    """Verifies the bytes read from one safetensors file against its block checksums."""

    def __init__(self, path: Path, sums: dict):
        self.path = path
        self.fn = checksum_function(sums["algorithm"])
        self.name = sums["algorithm"]
        self.block = int(sums["block"])
        self.expected_header = int(sums["header"])
        self.packed: dict[str, str] = sums["tensors"]
        self._sums: dict[str, list[int]] = {}

    def header(self, start: int) -> None:
        actual = self.fn(read_bytes(self.path, 0, start), 0)
        if actual != self.expected_header:
            raise CheckpointError(_corrupted(self.path, f"its header, {self.name}"))

    def tensor(self, name: str, start: int, nbytes: int, lo: int, hi: int, data: memoryview) -> str | None:
        """Check the blocks of tensor ``name`` (at file offset ``start``) that overlap its bytes ``[lo, hi)``, which
        ``data`` holds; bytes of those blocks outside ``data`` are read from the file. Returns the problem, if any."""
        if hi <= lo:
            return None
        sums = self._sums.get(name)
        if sums is None:
            if name not in self.packed:
                return _corrupted(self.path, f"tensor {name!r} has no checksums in the manifest")
            sums = self._sums[name] = unpack(self.packed[name])
        b = self.block
        k0, k1 = lo // b, -(-hi // b)

        def check(ka: int, kb: int) -> int | None:
            """The first block in ``[ka, kb)`` whose checksum does not match."""
            fn = self.fn
            for k in range(ka, kb):
                first, last = k * b, min((k + 1) * b, nbytes)
                crc = 0
                if first < lo:
                    crc = fn(read_bytes(self.path, start + first, lo - first), crc)
                crc = fn(data[max(first, lo) - lo : min(last, hi) - lo], crc)
                if last > hi:
                    crc = fn(read_bytes(self.path, start + hi, last - hi), crc)
                if k >= len(sums) or crc != sums[k]:
                    return k
            return None

        # A large read is checked by several threads (the CRC functions release the GIL): one I/O thread's file
        # would otherwise wait for a single core to checksum gigabytes.
        parts = min(_CRC_THREADS, (k1 - k0) // _PARALLEL_MIN_BLOCKS)
        if parts > 1:
            bounds = [k0 + (k1 - k0) * i // parts for i in range(parts + 1)]
            futures = [_crc_pool().submit(check, a, z) for a, z in itertools.pairwise(bounds)]
            bad = [k for k in (f.result() for f in futures) if k is not None]
            k = bad[0] if bad else None
        else:
            k = check(k0, k1)
        if k is None:
            return None
        first, last = k * b, min((k + 1) * b, nbytes)
        return _corrupted(self.path, f"tensor {name!r}, its bytes {first}..{last}, {self.name} block {k}")


class CheckpointReader:
    """Read tensors by name from ``directory`` (an index plus shard files, or a single safetensors file).

    With ``verify`` (the default), the bytes of every read are checked against the manifest's checksums (a
    directory without a cai manifest, such as a Hugging Face download, has none); a mismatch raises
    ``CheckpointError`` naming the file and the tensor.

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
        verify: bool = True,
    ):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self.verify = verify
        self.manifest = find_manifest(self.dir)
        # Checksum mismatches found while a sharded target loads: kept until every rank has finished reading,
        # then raised on all of them together (``raise_if_corrupt``), so that no rank is left in a collective.
        self.defer_failures = False
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._checks: dict[str, _BlockCheck | None] = {}
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

    def add_ties(self, ties: dict[str, str]) -> None:
        """Let the target's tied names (``alias -> name``, one tensor under both) that the checkpoint lacks read
        the name it has, so a weight stored once under either fills both (see [Note: tied weights])."""
        have = self.names()
        for alias, name in ties.items():
            if alias not in have and name in have:
                self.aliases[alias] = self.resolve(name)
            elif name not in have and alias in have:
                self.aliases[name] = self.resolve(alias)

    def header(self, name: str) -> dict[str, Any]:
        name = self.resolve(name)
        fname = self.weight_map[name]
        if fname not in self._headers:
            path = self.dir / fname
            check_file(self.manifest, path, verify=self.verify, whole=False)
            self._headers[fname], self._starts[fname] = read_header_and_start(path)
            entry = manifest_entry(self.manifest, path) if self.verify else None
            self._checks[fname] = check = (
                _BlockCheck(path, entry["checksums"]) if entry and "checksums" in entry else None
            )
            if check is not None:
                check.header(self._starts[fname])
        header = self._headers[fname]
        if name not in header:
            raise CheckpointError(
                f"{self.dir / fname} does not contain {name!r}, which the index places there: the file belongs to "
                f"another checkpoint (it holds {_fmt(header, 5)})"
            )
        return header[name]

    def _check_file(self, path: Path) -> None:
        check_file(self.manifest, path, verify=self.verify, whole=True)

    def _verify(self, name: str, lo: int, hi: int, data: memoryview) -> None:
        """Check bytes ``[lo, hi)`` of tensor ``name`` (held in ``data``) against the block checksums."""
        fname = self.file_of(name)
        check = self._checks.get(fname)
        if check is None:
            return
        b, e = self.header(name)["data_offsets"]
        problem = check.tensor(self.resolve(name), self._starts[fname] + b, e - b, lo, hi, data)
        if problem is None:
            return
        problem = f"checkpoint {self.dir}: {problem}"
        if not self.defer_failures:
            raise CheckpointError(problem)
        with self._lock:
            self.failures.append(problem)

    def raise_if_corrupt(self, group: Any = None) -> None:
        """Raise on every rank of ``group`` if any rank read corrupted bytes (a collective when it has several
        ranks); the target may then hold some of those bytes."""
        rank, world = dist_info(group)
        found = [(rank, f) for f in self.failures]
        if world > 1:
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, found, group=group)
            found = [f for other in everyone for f in other]
        if found:
            ranks = sorted({r for r, _ in found})
            raise CheckpointError(
                f"{found[0][1]} (found by ranks {ranks}, {len(found)} damaged reads in all); the target now "
                "holds some of these bytes: load it again from a good checkpoint"
            )

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
            region = self._read_rows(name, rows, row_bytes, stored)
            local = spec.cut_region(region)
            return local.to(want) if local.dtype != want else local
        if self._checks.get(fname) is not None:
            # Verified reads take the rows that hold the slice, contiguously, so that their blocks can be checked.
            rows = region_slices[0]
            row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=stored).element_size()
            span = self._read_rows(name, rows, row_bytes, stored)
            local = spec.cut_region(span[(slice(None), *region_slices[1:])])
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

    def _read_rows(self, name: str, rows: slice, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` of tensor ``name`` (the whole 0-d tensor for ``()``), read and verified."""
        info = self.header(name)
        shape = tuple(info["shape"])
        fname = self.file_of(name)
        region = torch.empty((rows.stop - rows.start, *shape[1:]) if shape else (), dtype=dtype)
        lo = rows.start * row_bytes
        read_into(self.dir / fname, self._starts[fname] + info["data_offsets"][0] + lo, region)
        if self.verify:
            data = _Bytes(region).view
            self._verify(name, lo, lo + len(data), data)
        return region

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
        if self.verify:
            data = _Bytes(out).view
            self._verify(name, 0, len(data), data)
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
