"""On-disk format: file names, the safetensors container (streamed with a checksum), JSON files, headers.

[Note: why a hand-written safetensors writer]
The safetensors library serialises a whole dict at once, so a rank would hold a full shard file in memory
before the first byte is written. The format is a little-endian u64 header length, a JSON header
(name -> dtype, shape, byte offsets; ``__metadata__``) and the raw bytes, so it is written here tensor by
tensor, with the checksums of the header and of every tensor's blocks computed on the way
(see [Note: block checksums] in ``_checksum.py``). Reading uses the safetensors library (mmap and
slicing), after the header has been validated here so that a damaged file is reported by name.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Any

import torch

from cai.ckpt._checksum import BLOCK, BlockSums, algorithm, checksum_function, pack

FORMAT_NAME = "cai-ckpt"
FORMAT_VERSION = 2  # 2: per-block CRC32C of every tensor; 1: a CRC32 per file
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
MODEL_INDEX_NAME = "model.safetensors.index.json"
MODEL_SINGLE_NAME = "model.safetensors"
OPTIM_INDEX_NAME = "optimizer.safetensors.index.json"
PARAM_GROUPS_NAME = "param_groups.json"
CONFIG_NAME = "config.json"
TMP_PREFIX = ".tmp-"

# Test hook: seconds to sleep after each tensor written, so that a test can kill a process mid-save.
_DELAY_ENV = "CAI_CKPT_TEST_WRITE_DELAY"

_DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPE_TO_ST[torch.float8_e4m3fn] = "F8_E4M3"
    _DTYPE_TO_ST[torch.float8_e5m2] = "F8_E5M2"
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}
_CHUNK = 64 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded: missing/unexpected keys, shape mismatch, damaged or foreign files."""


def shard_file_name(prefix: str, index: int, total: int) -> str:
    return f"{prefix}-{index:05d}-of-{total:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_TO_ST[dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} cannot be stored in safetensors (supported: {sorted(map(str, _DTYPE_TO_ST))})"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _ST_TO_DTYPE[name]
    except KeyError:
        raise CheckpointError(f"unknown safetensors dtype {name!r}") from None


class _Bytes:
    """The bytes of a contiguous CPU tensor as a memoryview, without numpy (not a dependency).

    The view does not own the memory: the object keeps the tensor alive for as long as the view is in use.
    """

    def __init__(self, t: torch.Tensor):
        self.tensor = t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        self.view = (
            memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")
        )


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor (header first, from the known names, dtypes and shapes)."""

    def __init__(
        self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self._sizes: dict[str, int] = {}
        self._order = [name for name, _, _ in entries]
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": dtype_name(dtype),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._sizes[name] = nbytes
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 -- closed in close()
        self._bytes = 0
        self._sums = _Sums(self._order)
        self._next = 0
        self._delay = float(os.environ.get(_DELAY_ENV, "0") or 0)
        self._put(memoryview(struct.pack("<Q", len(raw)) + raw), None, None)

    def _put(self, mv: memoryview, owner: Any, name: str | None) -> None:
        for i in range(0, len(mv), _CHUNK):
            chunk = mv[i : i + _CHUNK]
            # ``owner`` keeps the memory alive until the checksum thread is done with it.
            self._sums.put(chunk, owner, name)
            self._file.write(chunk)
            self._bytes += len(chunk)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"SafetensorsWriter: got {name!r}, expected {expected!r} next")
        data = _Bytes(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        mv = data.view
        if len(mv) != self._sizes[name]:
            raise RuntimeError(
                f"SafetensorsWriter: {name!r} has {len(mv)} bytes, header says {self._sizes[name]}"
            )
        self._put(mv, data, name)
        self._next += 1
        if self._delay:
            time.sleep(self._delay)

    def close(self) -> dict[str, int]:
        """Finish the file; returns its manifest entry (bytes, header and block checksums)."""
        if self._next != len(self._order):
            raise RuntimeError(
                f"SafetensorsWriter: {self.path.name} closed after {self._next} of {len(self._order)} tensors"
            )
        sums = self._sums.result()
        self._file.flush()
        os.fsync(self._file.fileno())  # durable before the commit marker says so
        self._file.close()
        return {"bytes": self._bytes, "checksums": sums}


class _Sums:
    """The header checksum and every tensor's block checksums (see [Note: block checksums]), computed in a helper
    thread so that checksumming chunk i overlaps the write of chunk i+1 (the CRC functions release the GIL).

    A plain thread rather than an executor: asynchronous saves may still be writing at interpreter exit,
    when executors refuse new work.
    """

    def __init__(self, names: list[str]) -> None:
        self.algorithm = algorithm()
        self._fn = checksum_function(self.algorithm)
        self._header = 0
        self._tensors = {name: BlockSums(self._fn) for name in names}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            chunk, _, name = item
            if name is None:
                self._header = self._fn(chunk, self._header)
            else:
                self._tensors[name].update(chunk)

    def put(self, chunk: memoryview, owner: Any, name: str | None) -> None:
        self._queue.put((chunk, owner, name))

    def result(self) -> dict[str, Any]:
        self._queue.put(None)
        self._thread.join()
        return {
            "algorithm": self.algorithm,
            "block": BLOCK,
            "header": self._header,
            "tensors": {name: pack(sums.finish()) for name, sums in self._tensors.items()},
        }


def write_json(path: Path, obj: Any) -> dict[str, int]:
    """Write JSON (atomically: a process killed mid-write leaves the old file); returns its manifest entry."""
    data = json.dumps(obj, indent=2, sort_keys=False).encode()
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    name = algorithm()
    return {"bytes": len(data), name: checksum_function(name)(data, 0)}


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"missing checkpoint file {path}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint file {path} is not valid JSON ({e}); the file is damaged"
        ) from None


def file_checksum(path: Path, name: str) -> int:
    """The whole-file checksum ``name`` (``crc32c`` or ``crc32``) of ``path``."""
    fn = checksum_function(name)
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = fn(chunk, crc)
    return crc


def _looks_like_pickle(head: bytes) -> bool:
    # pickle protocol 2+ starts with 0x80 <proto>; torch.save's zip container starts with "PK".
    return (len(head) >= 2 and head[0] == 0x80 and head[1] <= 5) or head[:2] == b"PK"


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """Parse and validate a safetensors header; a damaged, truncated or foreign file raises CheckpointError naming it."""
    return read_header_and_start(path)[0]


def read_header_and_start(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """``read_header`` plus the byte offset where the data section starts."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(9)
            if head[8:9] != b"{" and _looks_like_pickle(head):
                raise CheckpointError(
                    f"{path} is a pickle/torch.save file; cai-ckpt reads only safetensors and never unpickles (it could run code)"
                )
            if len(head) < 9:
                raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head[:8])
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(
                    f"{path} has a corrupted or truncated header (header length {n}, file size {size})"
                )
            raw = head[8:] + f.read(n - 1)
    except FileNotFoundError:
        raise CheckpointError(f"missing checkpoint file {path}") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupted safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    end = 0
    for name, info in header.items():
        try:
            b, e = info["data_offsets"]
            dtype = dtype_from_name(info["dtype"])
            numel = torch.Size(info["shape"]).numel()
        except (KeyError, TypeError, ValueError, CheckpointError) as err:
            raise CheckpointError(f"{path} has a corrupted header entry for {name!r} ({err})") from None
        if e - b != numel * torch.empty((), dtype=dtype).element_size() or b < 0:
            raise CheckpointError(f"{path} has a corrupted header entry for {name!r} (offsets {b}..{e})")
        end = max(end, e)
    if end > data:
        raise CheckpointError(
            f"{path} is truncated: its header needs {end} data bytes, the file holds {data}"
        )
    return header, 8 + n


def read_into(path: Path, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes at ``offset`` (plain reads release the GIL)."""
    if not out.numel():
        return
    data = _Bytes(out)
    if data.tensor.data_ptr() != out.data_ptr():
        raise ValueError("read_into: the output tensor must be contiguous")
    mv = data.view
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(mv):
            n = f.readinto(mv[done:])
            if not n:
                raise CheckpointError(f"{path} ended early while reading (it was truncated during the load)")
            done += n


def read_bytes(path: Path, offset: int, n: int) -> bytes:
    """``n`` bytes of ``path`` at ``offset`` (a short read means the file was truncated during the load)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    if len(data) != n:
        raise CheckpointError(f"{path} ended early while reading (it was truncated during the load)")
    return data
