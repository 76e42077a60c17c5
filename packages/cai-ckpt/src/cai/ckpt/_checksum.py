"""Checksums of checkpoint bytes: CRC32C per block of every tensor, so that a rank verifies exactly what it reads.

[Note: block checksums]
A save records, for each safetensors file, one checksum of its header and one per ``BLOCK`` bytes of every
tensor (blocks start at the tensor's first byte, so a whole-tensor read needs no bytes beyond the tensor). A
rank that reads a slice (a ZeRO flat range, a row block) checks the blocks that overlap it and reads at most
one block's worth of extra bytes at each end. CRC32C runs on the CPU's CRC instruction through the ``crc32c``
wheel (several GB/s per thread, without the GIL), in the thread that read the bytes, so I/O threads and ranks
verify in parallel. Without the wheel, saves record zlib's CRC32 (about half the speed) and say which in the
manifest; a checkpoint written with CRC32C is then verified by a slow pure-Python CRC32C, after one warning.
Checkpoints written before block checksums list one whole-file CRC32 per file, verified by reading the file.
"""

from __future__ import annotations

import base64
import sys
import warnings
import zlib
from collections.abc import Callable
from typing import Any

BLOCK = 256 << 10  # small enough that a slice read verifies little beyond itself; 16 KiB of sums per GiB

try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - exercised by monkeypatching in the tests
    _crc32c = None

_warned = False


def _warn_once(what: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"cai-ckpt: the crc32c package is not installed; {what}. Install it with `pip install crc32c`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE: list[int] | None = None


def _crc32c_python(data: Any, value: int = 0) -> int:
    """CRC32C without the wheel: correct, at a few MB/s."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _make_table()
    table = _TABLE
    c = value ^ 0xFFFFFFFF
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def algorithm() -> str:
    """The checksum new saves record: ``crc32c`` with the wheel, else zlib's ``crc32``."""
    if _crc32c is not None:
        return "crc32c"
    _warn_once("checkpoints are saved with zlib CRC32 checksums instead of hardware CRC32C")
    return "crc32"


def checksum_function(name: str) -> Callable[[Any, int], int]:
    """``f(buffer, previous) -> int`` for the algorithm ``name`` recorded in a manifest."""
    if name == "crc32":
        return zlib.crc32
    if name == "crc32c":
        if _crc32c is not None:
            return _crc32c.crc32c
        _warn_once("CRC32C checksums are verified in pure Python, slowly")
        return _crc32c_python
    raise ValueError(f"unknown checksum algorithm {name!r} (known: crc32c, crc32)")


def pack(sums: list[int]) -> str:
    """Block checksums as base64 of little-endian u32s (a quarter of the JSON of a list of numbers)."""
    return base64.b64encode(b"".join(s.to_bytes(4, "little") for s in sums)).decode()


def unpack(text: str) -> list[int]:
    raw = base64.b64decode(text)
    if sys.byteorder == "little":
        return list(memoryview(raw).cast("I"))
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


class BlockSums:
    """Checksums of one byte stream (a tensor's data) cut into ``BLOCK``-byte blocks, fed in any chunk sizes."""

    def __init__(self, fn: Callable[[Any, int], int]):
        self.fn = fn
        self.sums: list[int] = []
        self._value = 0
        self._filled = 0  # bytes of the current, unfinished block

    def update(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(BLOCK - self._filled, len(data) - pos)
            self._value = self.fn(data[pos : pos + take], self._value)
            self._filled += take
            pos += take
            if self._filled == BLOCK:
                self.sums.append(self._value)
                self._value, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self.sums.append(self._value)
            self._value, self._filled = 0, 0
        return self.sums
