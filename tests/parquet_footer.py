"""A Parquet file's footer read without Polars: the Thrift compact protocol, decoded by hand.

Tests use it to check what Polars wrote (codec, row groups, statistics, sizes) against the
format's own bytes, not against the library that wrote them (so it has its own varint reader,
not `rundir.event_steps`'). Only what a footer holds is decoded: structs become `{field id:
value}` dicts, lists Python lists, binaries bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

__all__ = ["BROTLI", "ZSTD", "column_chunks", "read_footer"]

# parquet.thrift's CompressionCodec values.
BROTLI = 4
ZSTD = 6


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 integer at `pos`, and the position after it."""
    shift = result = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _value(buf: bytes, pos: int, kind: int) -> tuple[Any, int]:
    """One value of compact type `kind` at `pos`, and the position after it."""
    if kind in (1, 2):  # a struct field's boolean is in its type nibble
        return kind == 1, pos
    if kind == 3:
        return struct.unpack_from("b", buf, pos)[0], pos + 1
    if kind in (4, 5, 6):
        n, pos = _varint(buf, pos)
        return _zigzag(n), pos
    if kind == 7:
        return struct.unpack_from("<d", buf, pos)[0], pos + 8
    if kind == 8:
        n, pos = _varint(buf, pos)
        return bytes(buf[pos : pos + n]), pos + n
    if kind in (9, 10):
        head = buf[pos]
        pos += 1
        size, element = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(buf, pos)
        items = []
        for _ in range(size):
            if element in (1, 2):  # a list's booleans are one byte each
                items.append(buf[pos] == 1)
                pos += 1
            else:
                item, pos = _value(buf, pos, element)
                items.append(item)
        return items, pos
    if kind == 12:
        return _struct(buf, pos)
    raise ValueError(f"Thrift compact type {kind} is not used in Parquet footers")


def _struct(buf: bytes, pos: int) -> tuple[dict[int, Any], int]:
    fields: dict[int, Any] = {}
    field = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        delta, kind = head >> 4, head & 0x0F
        if delta:
            field += delta
        else:
            n, pos = _varint(buf, pos)
            field = _zigzag(n)
        fields[field], pos = _value(buf, pos, kind)


def read_footer(path: Path) -> dict[int, Any]:
    """The file's FileMetaData struct (3: num_rows, 4: row groups, 5: key-value metadata)."""
    data = Path(path).read_bytes()
    if data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise ValueError(f"{path} is not a Parquet file")
    length = struct.unpack("<I", data[-8:-4])[0]
    return _struct(data[-8 - length : -8], 0)[0]


def column_chunks(path: Path) -> list[list[dict[str, Any]]]:
    """Per row group, per column: its name, codec, rows, compressed and uncompressed bytes,
    and its min and max statistics as raw bytes (None when absent)."""
    groups = []
    for group in read_footer(path)[4]:
        chunks = []
        for chunk in group[1]:
            meta = chunk[3]
            statistics = meta.get(12, {})
            chunks.append(
                {
                    "name": ".".join(p.decode() for p in meta[3]),
                    "codec": meta[4],
                    "rows": group[3],
                    "uncompressed": meta[6],
                    "compressed": meta[7],
                    "min": statistics.get(6),
                    "max": statistics.get(5),
                }
            )
        groups.append(chunks)
    return groups
